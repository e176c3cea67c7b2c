"""Relabelling (DAgger) in the bc stage and `oakemu record --relabel`, in the real emulator.

The demos are short follow-style games: the spec they are recorded with cuts every game
after `FRAMES` emulator frames, and the clone, which plays the demos' spec, plays its
relabelled games under the same cut, so a whole relabelled game stays short.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from oakemu_rl.agents.recording import RecordConfig, record
from oakemu_rl.agents.scripted import make_demonstrator
from oakemu_rl.bootstrap.bc import BCConfig, train_bc
from oakemu_rl.checkpoint import lineage_inputs, load_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.demos import DemoFile
from oakemu_rl.demos.dataset import split_episodes
from oakemu_rl.envs import EnvSpec, action_meanings
from oakemu_rl.errors import ConfigError
from oakemu_rl.fsutil import sha256_file
from oakemu_rl.metrics import read_metrics

FRAMES = 320
"""Emulator frames per game (80 agent steps at frame skip 4)."""
SPEC = EnvSpec(game="pong", max_episode_frames=FRAMES)
DEMO_SEED = 11
"""The demos are games 11 and 12; relabelled games follow from 13."""
MEANINGS = list(action_meanings("pong"))
FOLLOW_LABELS = {MEANINGS.index(m) for m in ("NOOP", "RIGHT", "LEFT")}
"""All the follow style ever does (agents/scripted.py, PongFollower): hold RIGHT or LEFT
towards the ball, or let go; never FIRE, RIGHTFIRE or LEFTFIRE."""


def record_follow(path: Path, episodes: int = 2, seed: int = DEMO_SEED) -> Path:
    record(RecordConfig(out=path, spec=SPEC, episodes=episodes, seed=seed, progress=False),
           make_demonstrator(SPEC, seed=seed, style="follow"))
    return path


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def episodes_of(path: Path) -> list:
    with DemoFile(path) as demo:
        return list(demo.episodes)


def actions_of(path: Path) -> np.ndarray:
    with DemoFile(path) as demo:
        return np.concatenate([demo.read(i, "actions") for i in range(len(demo.episodes))])


@pytest.fixture(scope="module")
def relabelled_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`oakemu bootstrap bc` with two relabelling rounds of one game each."""
    tmp = tmp_path_factory.mktemp("dagger")
    demos = record_follow(tmp / "demos.h5")
    run_dir = tmp / "run"
    result = invoke("bootstrap", "bc", str(demos), "--relabel-episodes", "1",
                    "--relabel-rounds", "2", "--relabel-style", "follow", "--epochs", "1",
                    "--architecture", "tiny", "--batch-size", "32", "--device", "cpu",
                    "--run-dir", str(run_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    return {"demos": demos, "run": run_dir, "output": result.output}


def test_the_demos_are_short_whole_games(relabelled_run: dict) -> None:
    episodes = episodes_of(relabelled_run["demos"])
    assert [e.seed for e in episodes] == [DEMO_SEED, DEMO_SEED + 1]
    assert all(e.recorder == "scripted" and e.truncated for e in episodes)
    assert all(0 < e.length <= FRAMES // SPEC.frame_skip for e in episodes)


def test_cli_bc_relabels_in_rounds_and_keeps_each_rounds_curves(relabelled_run: dict) -> None:
    run_dir = relabelled_run["run"]
    assert relabelled_run["output"].strip().splitlines()[-1] == (
        f"wrote {run_dir / 'bc.pt'}; next: oakemu bootstrap calibrate --run-dir {run_dir}")
    for name in ("relabelled.h5", "relabelled2.h5"):
        [episode] = episodes_of(run_dir / name)  # relabel_episodes 1: one whole game
        assert episode.recorder == "relabelled", name
        assert 0 < episode.length <= FRAMES // SPEC.frame_skip
        assert episode.terminated or episode.truncated
        assert set(actions_of(run_dir / name).tolist()) <= FOLLOW_LABELS, name
    assert not (run_dir / "relabelled3.h5").exists()
    # The first clone's curves (demos only) and round 1's clone's are kept beside the last.
    for prefix in ("bc_first_", "bc_round1_", "bc_"):
        assert len(read_metrics(run_dir / f"{prefix}metrics.jsonl")) == 1, prefix  # 1 epoch
        assert (run_dir / f"{prefix}curves.png").stat().st_size > 0, prefix
    assert not (run_dir / "bc_round2_metrics.jsonl").exists()


def test_bc_pt_lineage_names_the_demos_and_both_relabelled_files(relabelled_run: dict) -> None:
    run_dir, demos = relabelled_run["run"], relabelled_run["demos"]
    bc = load_checkpoint(run_dir / "bc.pt")
    assert bc.stage == "bc" and bc.steps["bc/epochs"] == 1
    assert [link["stage"] for link in bc.lineage] == ["bc"]  # a fresh model each time
    files = [demos, run_dir / "relabelled.h5", run_dir / "relabelled2.h5"]
    assert bc.lineage[0]["inputs"] == [{"path": str(f.resolve()), "sha256": sha256_file(f)}
                                       for f in files]
    assert lineage_inputs(bc, "bc") == [str(f.resolve()) for f in files]
    assert bc.lineage[0]["config"]["relabel_episodes"] == 1
    assert bc.lineage[0]["config"]["relabel_rounds"] == 2
    assert bc.lineage[0]["config"]["relabel_style"] == "follow"
    # the last clone trained on the training episodes of all three files, one epoch
    opened = [DemoFile(f) for f in files]
    try:
        train, _ = split_episodes(opened, BCConfig.val_fraction, BCConfig.seed)
    finally:
        for demo in opened:
            demo.close()
    assert {ref.file for ref in train} >= {1, 2}  # relabelled frames among them
    assert bc.steps["bc/samples"] == sum(ref.length for ref in train)


def test_relabelled_seeds_continue_after_the_demos(relabelled_run: dict) -> None:
    run_dir = relabelled_run["run"]
    last_demo_seed = max(e.seed for e in episodes_of(relabelled_run["demos"]))
    assert last_demo_seed == DEMO_SEED + 1
    [first] = episodes_of(run_dir / "relabelled.h5")
    [second] = episodes_of(run_dir / "relabelled2.h5")
    assert first.seed == last_demo_seed + 1  # round 1: the game after the demos'
    assert second.seed == first.seed + 1  # round 2: the game after round 1's


def test_relabel_seed_sets_the_first_relabelled_game(tmp_path: Path) -> None:
    demos = record_follow(tmp_path / "demos.h5", episodes=2)
    config = BCConfig(epochs=1, architecture="tiny", batch_size=32, relabel_episodes=1,
                      relabel_rounds=2, relabel_epochs=1, relabel_style="follow",
                      relabel_seed=500)
    path = train_bc(config, [str(demos)], run_dir=tmp_path / "run", device="cpu",
                    progress=False)
    assert [e.seed for e in episodes_of(path.parent / "relabelled.h5")] == [500]
    assert [e.seed for e in episodes_of(path.parent / "relabelled2.h5")] == [501]


def test_relabel_noise_moves_the_clone_in_its_rounds_never_the_labels(tmp_path: Path) -> None:
    """bc's relabel_noise: the same relabelling game (same clone, same seed) goes elsewhere
    when the clone plays random moves, and every label stays the script's own choice."""
    demos = record_follow(tmp_path / "demos.h5", episodes=2)
    recorded = {}
    for noise in (0.0, 1.0):
        config = BCConfig(epochs=1, architecture="tiny", batch_size=32, relabel_episodes=1,
                          relabel_epochs=1, relabel_style="follow", relabel_seed=500,
                          relabel_noise=noise, seed=3)
        path = train_bc(config, [str(demos)], run_dir=tmp_path / f"run{noise}", device="cpu",
                        progress=False)
        with DemoFile(path.parent / "relabelled.h5") as demo:
            recorded[noise] = (demo.read(0, "frames"), demo.read(0, "actions"))
    (frames, labels), (noisy_frames, noisy_labels) = recorded[0.0], recorded[1.0]
    np.testing.assert_array_equal(frames[0], noisy_frames[0])
    assert len(frames) != len(noisy_frames) or not np.array_equal(frames, noisy_frames)
    assert set(labels.tolist()) <= FOLLOW_LABELS
    assert set(noisy_labels.tolist()) <= FOLLOW_LABELS and len(noisy_labels) >= 40
    with pytest.raises(ConfigError, match=r"relabel_noise=1\.5 is out of range"):
        BCConfig(relabel_noise=1.5)


def test_record_relabel_noise_moves_the_clone_never_the_labels(relabelled_run: dict,
                                                               tmp_path: Path) -> None:
    clone = relabelled_run["run"] / "bc.pt"
    recorded = {}
    for noise in ("0", "1.0"):
        out = tmp_path / f"noise{noise}.h5"
        result = invoke("record", "--demonstrator", "scripted", "--style", "follow",
                        "--relabel", str(clone), "--noise", noise, "--episodes", "1",
                        "--seed", "40", "--out", str(out), "--device", "cpu")
        assert result.exit_code == 0, result.output
        [episode] = episodes_of(out)
        assert episode.recorder == "relabelled" and episode.seed == 40
        with DemoFile(out) as demo:
            assert demo.spec == SPEC  # the clone's own spec, cut after FRAMES frames
            recorded[noise] = (demo.read(0, "frames"), demo.read(0, "actions"))
    (frames, labels), (noisy_frames, noisy_labels) = recorded["0"], recorded["1.0"]
    # Random moves (FIRE, RIGHTFIRE, LEFTFIRE among them) steer the game elsewhere ...
    np.testing.assert_array_equal(frames[0], noisy_frames[0])
    assert len(frames) != len(noisy_frames) or not np.array_equal(frames, noisy_frames)
    # ... but every stored label is still the follow style's own choice.
    assert set(labels.tolist()) <= FOLLOW_LABELS
    assert set(noisy_labels.tolist()) <= FOLLOW_LABELS
    assert len(noisy_labels) >= 40  # enough steps that a noisy label would have shown


def test_a_relabel_style_the_game_lacks_is_refused_before_any_training(relabelled_run: dict,
                                                                       tmp_path: Path) -> None:
    """As `pipeline run` does (bc.relabel_style is checked when the file loads): a typo must
    not cost a whole BC run, nor replace the run directory's bc.pt."""
    run_dir = tmp_path / "run"
    result = invoke("bootstrap", "bc", str(relabelled_run["demos"]), "--relabel-episodes", "1",
                    "--relabel-style", "fancy", "--epochs", "1", "--architecture", "tiny",
                    "--device", "cpu", "--run-dir", str(run_dir), "--no-progress")
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "Error: the scripted pong player has no style 'fancy'; styles: planner, follow, human"]
    assert not (run_dir / "bc.pt").exists()
