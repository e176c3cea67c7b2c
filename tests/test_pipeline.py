"""`oakemu pipeline run`: a tiny preset end to end, resumption, and config errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from oakemu_rl.checkpoint import lineage_inputs, load_checkpoint, save_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.demos import DemoFile
from oakemu_rl.errors import ConfigError
from oakemu_rl.finetune.ppo import PPOConfig, seeds_overlap
from oakemu_rl.metrics import read_metrics
from oakemu_rl.pipeline import _same_policy, load_pipeline, ppo_progress

TINY = """
name = "tiny"

[env]
game = "pong"

[demos]
episodes = 2
max_steps = 60

[bc]
epochs = 1
batch_size = 32
architecture = "tiny"

[calibrate]
num_envs = 2
holdout_envs = 1
num_steps = 16
iterations = 1

[ppo]
total_steps = 64
num_envs = 2
num_steps = 16
warmup_updates = 1
warmup_ramp_updates = 1
eval_episodes = 0
checkpoint_every = 1

[evaluate]
episodes = 2
max_steps = 30
"""


def write(tmp_path: Path, text: str, name: str = "tiny.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run(*args: str):
    return CliRunner().invoke(cli, ["pipeline", "run", *args, "--no-progress"])


def refused_in_one_line(path: Path, message: str) -> None:
    """Loading `path` fails with `message`, and running it says so in one line and creates
    no run directory."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_pipeline(path)
    run_dir = path.parent / "run"
    result = run(str(path), "--run-dir", str(run_dir))
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1 and message in result.output
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path, str]:
    tmp_path = tmp_path_factory.mktemp("pipeline")
    config = write(tmp_path, TINY)
    run_dir = tmp_path / "run"
    result = run(str(config), "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    return config, run_dir, result.output


def test_every_stage_runs_and_reports(finished) -> None:
    _, run_dir, output = finished
    for name in ("demos.h5", "bc.pt", "calibrated.pt", "ppo.pt", "test.json", "report.md",
                 "bc_curves.png", "calibration_scatter.png", "pipeline_state.json"):
        assert (run_dir / name).exists(), name
    assert load_checkpoint(run_dir / "ppo.pt").steps["ppo/global_step"] == 64
    scores = json.loads((run_dir / "test.json").read_text())
    assert set(scores) == {"bc", "calibrate", "ppo", "demonstrator"}
    assert all(s["lengths"] == [30, 30] for s in scores.values())
    assert all(s["episodes"] == 2 and "sem" in s for s in scores.values())
    # the calibrated policy is bc's, bit for bit: its games are bc's games, not replayed
    assert scores["calibrate"] == {**scores["bc"], "same_policy_as": "bc"}
    assert "same_policy_as" not in scores["ppo"]
    for line in ("demonstrator", "bc ", "calibrated", "ppo ", "calibration explained variance",
                 "least-squares value head on the BC features", "record", "wall time"):
        assert line in output, line
    # the summary shows each stage's own steps, by their namespaced names: 60 training
    # samples (one of the two 60-step games is held out), 2 envs x 16 steps per iteration
    for row in (r"bc +\d+s +bc/epochs=1, bc/samples=60",
                r"calibrate +\d+s +calibrate/env_steps=32, calibrate/iterations=1",
                r"ppo +\d+s +ppo/updates=2, ppo/global_step=64"):
        assert re.search(rf"^{row}$", output, re.M), (row, output)
    # every score with its standard error and its number of games, on the test seeds
    assert "(test seeds 1000-1001)" in output
    for name in ("demonstrator", "bc", "calibrated", "ppo"):
        assert re.search(rf"^{name} +[+-]\d+\.\d\d ± \d+\.\d\d \(2 games\)$", output,
                         re.M), (name, output)
    report = (run_dir / "report.md").read_text()
    assert re.search(r"^ppo +[+-]\d+\.\d\d ± \d+\.\d\d \(2 games\)$", report, re.M)
    assert "![BC train/validation curves](bc_curves.png)" in report
    assert "calibration explained variance" in report


def test_same_policy_looks_past_the_value_head_only(finished, tmp_path: Path) -> None:
    _, run_dir, _ = finished
    bc, calibrated = run_dir / "bc.pt", run_dir / "calibrated.pt"
    assert _same_policy(bc, calibrated)
    checkpoint = load_checkpoint(calibrated)
    checkpoint.state_dict["policy_head.bias"] = checkpoint.state_dict["policy_head.bias"] + 1e-6
    save_checkpoint(tmp_path / "moved.pt", checkpoint)
    assert not _same_policy(bc, tmp_path / "moved.pt")


def test_rerun_skips_finished_stages(finished) -> None:
    config, run_dir, _ = finished
    before = {p: (run_dir / p).stat().st_mtime_ns for p in ("bc.pt", "calibrated.pt", "ppo.pt")}
    result = run(str(config), "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    assert result.output.count("(up to date)") == 5
    after = {p: (run_dir / p).stat().st_mtime_ns for p in before}
    assert before == after


def test_force_redoes_a_stage_and_what_follows(finished) -> None:
    config, run_dir, _ = finished
    bc_before = (run_dir / "bc.pt").stat().st_mtime_ns
    ppo_before = (run_dir / "ppo.pt").stat().st_mtime_ns
    result = run(str(config), "--run-dir", str(run_dir), "--force", "ppo")
    assert result.exit_code == 0, result.output
    assert result.output.count("(up to date)") == 3  # record, bc, calibrate
    assert (run_dir / "bc.pt").stat().st_mtime_ns == bc_before
    assert (run_dir / "ppo.pt").stat().st_mtime_ns != ppo_before


def test_a_changed_setting_reruns_from_that_stage(finished, tmp_path: Path) -> None:
    _, run_dir, _ = finished
    changed = write(tmp_path, TINY.replace("iterations = 1", "iterations = 2"))
    result = run(str(changed), "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    assert result.output.count("(up to date)") == 2  # record and bc only
    assert load_checkpoint(run_dir / "calibrated.pt").steps["calibrate/iterations"] >= 1


def test_relabelling_rounds_in_the_bc_stage(finished, tmp_path: Path) -> None:
    _, run_dir, _ = finished
    first = load_checkpoint(run_dir / "bc.pt")
    relabel = write(tmp_path, TINY.replace("[bc]",
                                           "[bc]\nrelabel_episodes = 1\n"
                                           "relabel_rounds = 2\nrelabel_epochs = [2, 3]", 1))
    relabel_dir = tmp_path / "relabel"
    result = run(str(relabel), "--run-dir", str(relabel_dir))
    assert result.exit_code == 0, result.output
    for name, seed in (("relabelled.h5", 2), ("relabelled2.h5", 3)):  # after the 2 demos
        with DemoFile(relabel_dir / name) as demo:
            [episode] = demo.episodes
            assert episode.recorder == "relabelled" and episode.seed == seed
    bc = load_checkpoint(relabel_dir / "bc.pt")
    assert [link["stage"] for link in bc.lineage] == ["bc"]  # a fresh model, no parent
    assert len(read_metrics(relabel_dir / "bc_metrics.jsonl")) == 3  # relabel_epochs[1]
    assert sorted(lineage_inputs(bc, "bc")) == sorted(
        str((relabel_dir / name).resolve())
        for name in ("demos.h5", "relabelled.h5", "relabelled2.h5"))
    assert bc.steps["bc/samples"] > first.steps["bc/samples"]  # more frames per epoch
    assert len(read_metrics(relabel_dir / "bc_first_metrics.jsonl")) == 1  # bc.epochs
    assert len(read_metrics(relabel_dir / "bc_round1_metrics.jsonl")) == 2  # [0]
    # Changing only the relabelling keeps the recording and redoes bc onwards.
    again = write(tmp_path, relabel.read_text().replace("relabel_epochs = [2, 3]",
                                                        "relabel_epochs = 1"), "again.toml")
    result = run(str(again), "--run-dir", str(relabel_dir))
    assert result.exit_code == 0, result.output
    assert result.output.count("(up to date)") == 1  # record
    assert len(read_metrics(relabel_dir / "bc_metrics.jsonl")) == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("[bc]", "[bc]\nepochz = 3"), "unknown key bc.epochz"),
        (("epochs = 1", 'epochs = "one"'), "bc.epochs must be an integer"),
        (("game = \"pong\"", "game = \"pongg\""), "unknown game 'pongg'"),
        (("[evaluate]", "[evalu]"), "unknown key evalu"),
        (("num_envs = 2\nholdout_envs = 1", "num_envs = 2\nholdout_envs = 5"),
         "holdout_envs=5 is out of range"),
        (("warmup_updates = 1", "warmup_updates = true"), "ppo.warmup_updates must be an integer"),
        (("[demos]", '[demos]\nstyle = "fancy"'),
         "demos.style='fancy' is not a style of the scripted pong player (styles: planner, "
         "follow, human)"),
        (('game = "pong"', 'game = "space_invaders"'),
         "no scripted demonstrator for space_invaders: set demos.path"),
        (("[bc]", "[bc]\nrelabel_episodes = -1"),
         "bc option relabel_episodes=-1 is out of range: --relabel-episodes must be ≥ 0"),
        (("[bc]", "[bc]\nrelabel_rounds = 0"),
         "bc option relabel_rounds=0 is out of range: --relabel-rounds must be ≥ 1"),
        (("[bc]", "[bc]\nrelabel_epochs = [2, 3]"),
         "bc option relabel_epochs=(2, 3) is out of range: --relabel-epochs must be one "
         "number, or a list of relabel_rounds = 1 numbers"),
        (("[bc]", "[bc]\nrelabel_epochs = [0]"), "bc option relabel_epochs=(0,) is out of range"),
        (("[bc]", '[bc]\nrelabel_epochs = "many"'),
         "bc.relabel_epochs must be an integer or a list of integers, got 'many'"),
        (("[bc]", '[bc]\nrelabel_episodes = 1\nrelabel_style = "fancy"'),
         "bc.relabel_style='fancy' is not a style of the scripted pong player (styles: "
         "planner, follow, human)"),
        (("[demos]", "[demos]\nrelabel_episodes = 4"),
         "demos.relabel_episodes has moved: set it as relabel_episodes under [bc]"),
        (("eval_episodes = 0", "eval_episodes = 3\neval_seed = 1001"),
         "evaluate.seed=1000 (test seeds 1000 to 1001) overlaps ppo.eval_seed=1001 (PPO's "
         "selection games, seeds 1001 to 1003): the final test must play other games"),
        (("max_steps = 30", "max_steps = 30\nseed = 2"),
         "evaluate.seed=2 (test seeds 2 to 3) overlaps ppo.seed=0 (PPO's training envs, "
         "seeds 1 to 3)"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, edit, message) -> None:
    refused_in_one_line(write(tmp_path, TINY.replace(*edit, 1)), message)


def test_the_final_test_plays_ten_games_apart_from_training_and_selection(
        tmp_path: Path) -> None:
    pipeline = load_pipeline(write(tmp_path, TINY.replace("episodes = 2\nmax_steps = 30", "")))
    assert pipeline.evaluate.episodes >= 10
    test = set(pipeline.evaluate.seeds)
    assert not test & set(PPOConfig().selection_seeds)  # the default selection games
    assert not test & set(pipeline.ppo.training_seeds())


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    result = run(str(write(tmp_path, "name = [")))
    assert result.exit_code != 0 and "is not valid TOML" in result.output
    result = run(str(tmp_path / "nope.toml"))
    assert result.exit_code != 0 and "does not exist" in result.output


def test_a_file_changes_its_base_key_by_key(tmp_path: Path) -> None:
    base = write(tmp_path, TINY)
    child = write(tmp_path, 'base = "tiny.toml"\n[ppo]\ntotal_steps = 128\n'
                  '[bc]\nepochs = 3\n', "child.toml")
    parent, pipeline = load_pipeline(base), load_pipeline(child)
    assert pipeline.name == "child"  # its own file name, not the base's name
    assert pipeline.ppo.total_steps == 128 and parent.ppo.total_steps == 64
    assert pipeline.bc.epochs == 3 and pipeline.bc.architecture == "tiny"  # kept from base
    assert pipeline.ppo.num_steps == parent.ppo.num_steps
    for part in ("env", "demos", "calibrate", "evaluate"):
        assert getattr(pipeline, part) == getattr(parent, part), part
    grandchild = write(tmp_path, 'base = "child.toml"\nname = "g"\n[bc]\nbatch_size = 16\n',
                       "grandchild.toml")
    deep = load_pipeline(grandchild)
    assert (deep.name, deep.bc.batch_size, deep.bc.epochs, deep.ppo.total_steps) == \
        ("g", 16, 3, 128)


def test_a_base_files_paths_are_its_own(tmp_path: Path) -> None:
    """[env] paths in a base file are read next to the base file, not the file using it."""
    (tmp_path / "presets").mkdir()
    write(tmp_path / "presets", 'name = "gb"\n[env]\ngame_config = "mine.toml"\n', "gb.toml")
    child = write(tmp_path, 'base = "presets/gb.toml"\n')
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "presets" / "mine.toml"))):
        load_pipeline(child)


@pytest.mark.parametrize("text, says", [
    ('base = "tiny.toml"\n', "pipeline base files form a loop"),
    ('base = "other.toml"\n', "base other.toml: pipeline file"),
    ("base = 3\n", "base must be the path of another pipeline file, not 3"),
])
def test_a_bad_base_is_refused_in_one_line(tmp_path: Path, text: str, says: str) -> None:
    refused_in_one_line(write(tmp_path, text), says)


PRESETS = sorted((Path(__file__).resolve().parents[1] / "pipelines").glob("*.toml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_shipped_presets_load(preset: Path) -> None:
    pipeline = load_pipeline(preset)
    assert pipeline.name == preset.stem
    if preset.name in ("pong.toml", "pong-long.toml", "breakout.toml",
                       "breakout-long.toml"):  # practised players
        assert pipeline.demos.style == "human"


def test_the_presets_are_there() -> None:
    assert {p.name for p in PRESETS} >= {"pong.toml", "pong-long.toml", "pong-quick.toml",
                                         "breakout.toml"}


@pytest.mark.parametrize("base, long_name", [("pong.toml", "pong-long.toml"),
                                             ("breakout.toml", "breakout-long.toml")])
def test_a_long_preset_shares_its_bases_stages_before_ppo(base: str, long_name: str) -> None:
    """Run in its base preset's directory, a long preset reuses that recording, clone and
    calibration, which holds only while the settings of those stages are the same."""
    folder = PRESETS[0].parent
    main, long = load_pipeline(folder / base), load_pipeline(folder / long_name)
    for part in ("env", "demos", "bc", "calibrate"):
        assert getattr(long, part) == getattr(main, part), part
    assert long.ppo.threads == 2  # one stage at a time: PPO has both cores
    assert long.ppo.total_steps > main.ppo.total_steps
    assert long.evaluate.episodes >= 20 and long.ppo.eval_episodes >= 20
    tests = range(long.evaluate.seed, long.evaluate.seed + long.evaluate.episodes)
    assert not seeds_overlap(tests, long.ppo.training_seeds())
    assert not seeds_overlap(tests, long.ppo.selection_seeds)


def test_an_option_added_later_leaves_earlier_runs_up_to_date() -> None:
    """A stage's fingerprint leaves out options added after runs were made while they hold
    their default: it is then what the stages computed before those options existed, so an
    earlier run directory stays up to date; setting one makes the stage stale."""
    import dataclasses

    from oakemu_rl.bootstrap.bc import BCConfig
    from oakemu_rl.finetune.ppo import PPOConfig
    from oakemu_rl.pipeline import LATER_OPTIONS, SPEED_OPTIONS, _fingerprint, _settings

    for stage, config, changed in (("ppo", PPOConfig(), {"bc_coef": 0.1,
                                                         "label_rollouts": "planner"}),
                                   ("ppo", PPOConfig(), {"precision": "bf16"}),
                                   ("bc", BCConfig(), {"relabel_noise": 0.1})):
        name = type(config).__name__
        before = {k: v for k, v in dataclasses.asdict(config).items()
                  if k not in LATER_OPTIONS | SPEED_OPTIONS
                  and f"{name}.{k}" not in LATER_OPTIONS}
        assert len(before) < len(dataclasses.asdict(config))
        assert _fingerprint(stage, _settings(config), ["up"]) == \
            _fingerprint(stage, before, ["up"])
        other = dataclasses.replace(config, **changed)
        assert _fingerprint(stage, _settings(other), ["up"]) != \
            _fingerprint(stage, _settings(config), ["up"])
    # a name given with its config class is left out of that class's stage alone
    assert "precision" not in _settings(PPOConfig()) and "precision" in _settings(BCConfig())


def test_default_stage_fingerprints_stay_what_earlier_runs_stored() -> None:
    """Each stage's fingerprint of its default settings is pinned: a new option must go
    into pipeline.LATER_OPTIONS, or every earlier run directory turns stale and reruns
    its stages. (A changed default does make them stale; then update the pin.)"""
    from oakemu_rl.bootstrap.bc import BCConfig
    from oakemu_rl.bootstrap.calibrate import CalibrateConfig
    from oakemu_rl.finetune.ppo import PPOConfig
    from oakemu_rl.pipeline import DemoSource, FinalTestConfig, _fingerprint, _settings

    pinned = {"record": (DemoSource(), "70af2013010efa02"),
              "bc": (BCConfig(), "1dab5d999d3e2ec2"),
              "calibrate": (CalibrateConfig(), "0052a5a35de249a8"),
              "ppo": (PPOConfig(), "59ba420f2d351398"),
              "test": (FinalTestConfig(), "8c7e1bf5a041c470")}
    for stage, (config, fingerprint) in pinned.items():
        assert _fingerprint(stage, _settings(config)) == fingerprint, (
            f"the {stage} stage's default fingerprint changed: name a new option in "
            "pipeline.LATER_OPTIONS")
    # the processes that play games change how fast they play, not what they make
    assert _settings(FinalTestConfig(workers=3)) == _settings(FinalTestConfig())
    assert _settings(DemoSource(workers=3)) == _settings(DemoSource())
    assert _settings(BCConfig(relabel_workers=3)) == _settings(BCConfig())
    with pytest.raises(ConfigError, match=r"evaluate.workers=-1 is out of range: it must be ≥ 0"):
        FinalTestConfig(workers=-1)


def test_the_report_sets_each_evaluation_beside_the_sampled_games_before_it() -> None:
    """One row per greedy evaluation: the sampled training games and the mean entropy of
    the updates since the evaluation before it, not of the whole run."""
    records = [
        {"step": 10, "charts/episodic_return": -21.0},
        {"step": 16, "charts/update": 1, "losses/entropy": 1.0},
        {"step": 20, "charts/episodic_return": -19.0},
        {"step": 32, "charts/update": 2, "losses/entropy": 0.5, "eval/greedy_return": -3.0,
         "eval/greedy_return_sem": 0.5, "eval/episodes": 20},
        {"step": 48, "charts/update": 3, "losses/entropy": 0.25},
        {"step": 64, "charts/update": 4, "losses/entropy": 0.75, "eval/greedy_return": 4.0,
         "eval/greedy_return_sem": 1.0, "eval/episodes": 20},
        {"step": 70, "charts/episodic_return": 5.0},
    ]
    header, rule, first, second = ppo_progress(records)
    assert header.startswith("| step | update | greedy") and rule.startswith("| --- |")
    assert first == "| 32 | 2 | -3.00 ± 0.50 (20 games) | -20.00 ± 1.00 (2 games) | 0.75 |"
    assert second == "| 64 | 4 | +4.00 ± 1.00 (20 games) | no game ended | 0.50 |"
    assert ppo_progress(records[:3]) == []  # no evaluation, no table
    # a metrics file from before evaluations logged their games says so
    old = {"step": 32, "charts/update": 2, "eval/greedy_return": -3.0}
    assert ppo_progress([old])[2] == \
        "| 32 | 2 | -3.00 (games and SE not recorded) | no game ended | - |"
