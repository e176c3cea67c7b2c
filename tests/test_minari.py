"""Minari datasets in and out: real minari, real emulator, datasets made here."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

minari = pytest.importorskip("minari")

import ale_py  # noqa: E402
import gymnasium as gym  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from oakemu_rl.checkpoint import lineage_inputs, load_checkpoint  # noqa: E402
from oakemu_rl.cli import cli  # noqa: E402
from oakemu_rl.demos import DemoFile, DemoWriter, EpisodeBuffer  # noqa: E402
from oakemu_rl.demos.minari_io import (  # noqa: E402
    METADATA_KEY,
    ale_grayscale,
    export_minari,
    gym_env_spec,
    import_minari,
    minari_game,
    resolve_demo_paths,
)
from oakemu_rl.envs import EnvSpec, action_meanings, make_env  # noqa: E402
from oakemu_rl.errors import DemoFileError  # noqa: E402

gym.register_envs(ale_py)

MINIMAL = action_meanings("pong")
FULL = action_meanings("pong", True)


@pytest.fixture(autouse=True)
def minari_root(tmp_path_factory, monkeypatch) -> Path:
    """Every test gets its own empty MINARI_DATASETS_PATH."""
    root = tmp_path_factory.mktemp("minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


def train_bc_on(demo: Path, run_dir: Path) -> Path:
    """The one call into behaviour cloning (its signature may change)."""
    from oakemu_rl.bootstrap.bc import BCConfig, train_bc

    return train_bc(BCConfig(epochs=1, batch_size=32, architecture="tiny", val_fraction=0.5,
                             precision="fp32"), (str(demo),), run_dir=str(run_dir),
                     device="cpu", progress=False)


def record_demo(path: Path, spec: EnvSpec, episodes: list[tuple[int, str, int]]) -> Path:
    """Random play in our env written with our writer: (seed, recorder, steps) each."""
    env = make_env(spec)
    rng = np.random.default_rng(1)
    writer = DemoWriter(path, spec)
    n = env.action_space.n
    for seed, recorder, steps in episodes:
        observation, _ = env.reset(seed=seed)
        buffer = EpisodeBuffer()
        for t in range(steps):
            action = int(rng.integers(n))
            after, reward, terminated, truncated, _ = env.step(action)
            buffer.add(observation[-1], action, reward, terminated,
                       truncated or t == steps - 1)
            observation = after
            if terminated or truncated:
                break
        writer.write_episode(buffer, recorder=recorder, seed=seed)
    env.close()
    return path


def quiet_create(collector, dataset_id: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return collector.create_dataset(dataset_id, algorithm_name="random",
                                        author="tests", author_email="tests@localhost",
                                        code_permalink="none", description="test data")


def collect_raw(dataset_id: str, episodes: list[tuple[int, list[int], int]], *,
                full_action_space: bool = True, jpeg: bool = False, frameskip: int = 1,
                hold: int = 4):
    """A raw-frame dataset recorded with DataCollector around gymnasium's ALE Pong.

    Each episode is (seed, minimal-set actions each held `hold` emulator frames, extra
    frames of one more action before the episode is cut by the next reset)."""
    env = gym.make("ALE/Pong-v5", frameskip=frameskip, repeat_action_probability=0.25,
                   full_action_space=full_action_space)
    names = env.unwrapped.get_action_meanings()
    collector = minari.DataCollector(env, jpeg_encoding=jpeg)
    for seed, actions, extra in episodes:
        collector.reset(seed=seed)
        for action in actions:
            index = names.index(MINIMAL[action])
            for _ in range(hold):
                collector.step(index)
        for _ in range(extra):
            collector.step(names.index("LEFT"))
    dataset = quiet_create(collector, dataset_id)
    collector.close()
    return dataset


# -- our file -> Minari -> our file ---------------------------------------------------------


def test_round_trip_keeps_frames_actions_returns_and_metadata(tmp_path: Path) -> None:
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE",))
    demo = record_demo(tmp_path / "demos.h5", spec,
                       [(7, "scripted", 150), (8, "human", 110), (9, "policy", 60)])
    with DemoFile(demo) as original:
        returns = [e.episode_return for e in original.episodes]
        assert any(r != 0 for r in returns)  # rewards that can go wrong

    result = CliRunner().invoke(cli, ["demos", "export-minari", str(demo),
                                      "--dataset-id", "oak/pong-demos-v0"])
    assert result.exit_code == 0, result.output

    dataset = minari.load_dataset("oak/pong-demos-v0")
    assert dataset.total_episodes == 3
    ours = dataset.storage.metadata[METADATA_KEY]
    assert EnvSpec.from_dict(ours["env_spec"]) == spec
    assert ours["recorders"] == ["scripted", "human", "policy"]
    with DemoFile(demo) as original:
        for i, episode in enumerate(dataset.iterate_episodes()):
            frames = original.read(i, "frames")
            assert np.array_equal(episode.observations[:-1], frames)
            assert np.array_equal(episode.observations[-1], frames[-1])
            assert np.array_equal(episode.actions, original.read(i, "actions"))
            assert np.array_equal(episode.rewards, original.read(i, "rewards"))
            assert np.array_equal(episode.terminations, original.read(i, "terminations"))
            assert np.array_equal(episode.truncations, original.read(i, "truncations"))

    # The recovered env is our game with our preprocessing: same frames for the same seed.
    recovered = dataset.recover_environment()
    ours_env = make_env(spec)
    frame, _ = recovered.reset(seed=11)
    stack, _ = ours_env.reset(seed=11)
    assert np.array_equal(frame, stack[-1])
    for action in [2, 3, 3, 0, 2, 5, 4, 1] * 10:
        frame, reward, *_ = recovered.step(action)
        stack, reward_ours, *_ = ours_env.step(action)
        assert np.array_equal(frame, stack[-1]) and reward == reward_ours
    recovered.close()
    ours_env.close()

    back = tmp_path / "back.h5"
    result = CliRunner().invoke(cli, ["demos", "import-minari", "oak/pong-demos-v0",
                                      "--out", str(back)])
    assert result.exit_code == 0, result.output
    assert "preprocessed frames taken as they are" in result.output
    with DemoFile(demo) as original, DemoFile(back) as copy:
        assert copy.spec == original.spec
        assert copy.action_meanings == original.action_meanings
        assert [e.recorder for e in copy.episodes] == ["scripted", "human", "policy"]
        assert [e.seed for e in copy.episodes] == [7, 8, 9]
        assert [e.episode_return for e in copy.episodes] == returns
        for i in range(3):
            for key in ("frames", "actions", "rewards", "terminations", "truncations"):
                assert np.array_equal(copy.read(i, key), original.read(i, key)), key


def test_fire_serving_travels_with_the_exported_env_and_back(tmp_path: Path) -> None:
    """A fire_reset game's exported env serves as ours does, so a player who never presses
    FIRE meets the same frames and loses the same lives; import reads the serving back,
    from our metadata and, without it, from the env's wrappers."""
    spec = EnvSpec(game="breakout", fire_reset=True)
    demo = record_demo(tmp_path / "demos.h5", spec, [(5, "scripted", 60)])
    export_minari(demo, "oak/breakout-fire-v0")
    dataset = minari.load_dataset("oak/breakout-fire-v0")
    recovered, ours = dataset.recover_environment(), make_env(spec)
    frame, info = recovered.reset(seed=4)
    stack, _ = ours.reset(seed=4)
    never_fire = [a for a in range(len(action_meanings("breakout")))
                  if action_meanings("breakout")[a] != "FIRE"]
    for t in range(400):
        action = never_fire[(t // 5) % len(never_fire)]
        frame, reward, *_, info = recovered.step(action)
        stack, reward_ours, *_, info_ours = ours.step(action)
        assert np.array_equal(frame, stack[-1]) and reward == reward_ours
        assert info["lives"] == info_ours["lives"]
    assert info["lives"] < 5  # served balls fell: a never-FIRE player waits at 5 unserved
    recovered.close()
    ours.close()

    back = import_minari("oak/breakout-fire-v0", tmp_path / "back.h5")
    with DemoFile(back.path) as copy:
        assert copy.spec.fire_reset

    env = gym.make(gym_env_spec(spec))  # the same env, recorded without our metadata
    collector = minari.DataCollector(env, jpeg_encoding=False)
    collector.reset(seed=2)
    for t in range(30):
        collector.step(never_fire[t % len(never_fire)])
    quiet_create(collector, "tests/breakout-served-v0")
    collector.close()
    derived = import_minari("tests/breakout-served-v0", tmp_path / "derived.h5")
    with DemoFile(derived.path) as copy:
        assert copy.spec.fire_reset and copy.spec.game == "breakout"


def test_export_refuses_an_existing_dataset_and_leaves_it(tmp_path: Path,
                                                          minari_root: Path) -> None:
    demo = record_demo(tmp_path / "d.h5", EnvSpec(game="pong"), [(1, "scripted", 20)])
    export_minari(demo, "oak/one-v0")
    before = sorted(p.name for p in (minari_root / "oak").rglob("*"))
    result = CliRunner().invoke(cli, ["demos", "export-minari", str(demo),
                                      "--dataset-id", "oak/one-v0"])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "already exists" in lines[0]
    assert sorted(p.name for p in (minari_root / "oak").rglob("*")) == before
    assert not [p for p in minari_root.iterdir() if p.name.startswith(".")]


# -- a dataset recorded with DataCollector --------------------------------------------------


def test_grayscale_from_rgb_is_the_emulators() -> None:
    env = ale_py.AtariEnv(game="breakout", frameskip=1, repeat_action_probability=0.0)
    env.reset(seed=0)
    for action in [1] * 10 + [2, 3] * 40:
        rgb, *_ = env.step(action)
        assert np.array_equal(ale_grayscale(rgb), env.ale.getScreenGrayscale())
    env.close()


def test_raw_frames_from_data_collector_import_exactly_and_train_bc(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    plan = [(21, rng.integers(len(MINIMAL), size=75).tolist(), 2),
            (22, rng.integers(len(MINIMAL), size=35).tolist(), 0)]
    collect_raw("tests/raw-pong-v0", plan)
    assert minari_game("tests/raw-pong-v0") == "pong"

    out = tmp_path / "imported.h5"
    result = CliRunner().invoke(cli, ["demos", "import-minari", "tests/raw-pong-v0",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "raw RGB frames preprocessed" in result.output

    with DemoFile(out) as demo:
        # Full-set actions came in; every one has a minimal-set meaning, so that is ours.
        assert not demo.spec.full_action_space and demo.action_meanings == list(MINIMAL)
        assert demo.spec.frame_skip == 4 and demo.spec.repeat_action_probability == 0.25
        assert [e.seed for e in demo.episodes] == [21, 22]
        assert [e.recorder for e in demo.episodes] == ["policy", "policy"]
        assert demo.episodes[0].episode_return != 0  # a point was scored: sums can go wrong
        for i, (seed, actions, extra) in enumerate(plan):
            expected = [*actions, MINIMAL.index("LEFT")] if extra else actions
            assert demo.read(i, "actions").tolist() == expected
            assert demo.episodes[i].truncated and demo.read(i, "truncations").sum() == 1
            # Our own env, same seed and actions, no NOOP start: the very same frames.
            env = make_env(EnvSpec(game="pong", noop_max=0))
            stack, _ = env.reset(seed=seed)
            frames, rewards = demo.read(i, "frames"), demo.read(i, "rewards")
            for t, action in enumerate(expected):
                assert np.array_equal(frames[t], stack[-1]), (i, t)
                stack, reward, *_ = env.step(action)
                if t < len(actions):
                    assert rewards[t] == reward
            env.close()

    bc = train_bc_on(out, tmp_path / "run")
    assert bc.is_file()


def test_preprocessed_stacked_frames_take_the_newest(tmp_path: Path) -> None:
    env = gym.make("ALE/Breakout-v5", frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, noop_max=0, frame_skip=3, screen_size=64)
    env = gym.wrappers.FrameStackObservation(env, 4, padding_type="zero")
    collector = minari.DataCollector(env, jpeg_encoding=False)
    seen = []
    stack, _ = collector.reset(seed=4)
    for action in [1, 2, 3, 0] * 15:
        seen.append(stack[-1].copy())
        stack, *_ = collector.step(action)
    quiet_create(collector, "tests/stacked-v0")
    result = import_minari("tests/stacked-v0", tmp_path / "s.h5")
    assert result.source == "preprocessed"
    with DemoFile(tmp_path / "s.h5") as demo:
        assert (demo.spec.frame_skip, demo.spec.screen_size, demo.spec.noop_max) == (3, 64, 0)
        assert np.array_equal(demo.read(0, "frames"), np.stack(seen))
        assert demo.read(0, "actions").tolist() == [1, 2, 3, 0] * 15


# -- bootstrap bc minari:ID ---------------------------------------------------------------


def test_resolve_demo_paths_imports_once_and_again_when_the_dataset_changes(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    dataset = collect_raw("tests/resolve-v0",
                          [(5, rng.integers(len(MINIMAL), size=20).tolist(), 0)])
    run_dir = tmp_path / "run"
    paths = resolve_demo_paths(["plain.h5", "minari:tests/resolve-v0"], run_dir)
    assert paths[0] == "plain.h5"
    imported = Path(paths[1])
    assert imported.parent == run_dir and imported.name.startswith("minari-")
    stamp = imported.stat().st_mtime_ns
    assert resolve_demo_paths(["minari:tests/resolve-v0"], run_dir) == (str(imported),)
    assert imported.stat().st_mtime_ns == stamp  # reused, not imported again

    # One more episode in the dataset: the import is stale and is redone.
    env = gym.make("ALE/Pong-v5", frameskip=1, full_action_space=True)
    collector = minari.DataCollector(env, jpeg_encoding=False)
    collector.reset(seed=6)
    for _ in range(40):
        collector.step(0)
    collector.add_to_dataset(dataset)
    resolve_demo_paths(["minari:tests/resolve-v0"], run_dir)
    with DemoFile(imported) as demo:
        assert len(demo.episodes) == 2

    with pytest.raises(DemoFileError, match="no local Minari dataset tests/missing-v0"):
        resolve_demo_paths(["minari:tests/missing-v0"], run_dir)


# -- refusals -----------------------------------------------------------------------------


def _from_buffers(dataset_id: str, env: gym.Env, steps: int = 3) -> None:
    """A tiny dataset of `env` (its own observations and random actions)."""
    from minari.data_collector.episode_buffer import EpisodeBuffer as MinariEpisode

    observation, _ = env.reset(seed=0)
    observations, actions = [observation], []
    for _ in range(steps):
        action = env.action_space.sample()
        observation, *_ = env.step(action)
        observations.append(observation)
        actions.append(action)
    episode = MinariEpisode(observations=np.stack(observations), actions=np.stack(actions),
                            rewards=np.zeros(steps), terminations=np.zeros(steps, bool),
                            truncations=np.eye(1, steps, steps - 1, dtype=bool)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        minari.create_dataset_from_buffers(dataset_id, [episode], env=env,
                                           jpeg_encoding=False)


def _changing_actions(dataset_id: str) -> None:
    collect_raw(dataset_id, [(1, [2, 3, 2, 3], 0)], hold=3)


def _unmappable_action(dataset_id: str) -> None:
    env = gym.make("ALE/Pong-v5", frameskip=1, full_action_space=True)
    collector = minari.DataCollector(env, jpeg_encoding=False)
    collector.reset(seed=0)
    for _ in range(8):
        collector.step(FULL.index("DOWN"))  # Pong's minimal set has no DOWN
    quiet_create(collector, dataset_id)


REFUSALS = {
    "unknown env": (lambda i: _from_buffers(i, gym.make("CartPole-v1")), [],
                    "is not an ALE game"),
    "continuous actions": (lambda i: _from_buffers(i, gym.make(
        "ALE/Pong-v5", frameskip=1, continuous=True)), [], "not discrete actions"),
    "RAM observations": (lambda i: _from_buffers(i, gym.make(
        "ALE/Pong-v5", frameskip=1, obs_type="ram")), [], "not image frames"),
    "frame-skipped raw frames": (lambda i: collect_raw(i, [(1, [0, 1], 0)], frameskip=4,
                                                       hold=1), [],
                                 "max-pool of our preprocessing cannot be rebuilt"),
    "JPEG frames": (lambda i: collect_raw(i, [(1, [0, 1], 0)], jpeg=True), [],
                    "JPEG-encoded (lossy)"),
    "odd frame shape": (lambda i: _from_buffers(i, gym.wrappers.ResizeObservation(
        gym.make("ALE/Pong-v5", frameskip=1), (84, 84))), [], "ResizeObservation"),
    "action changes inside a step": (_changing_actions, [],
                                     "changes action inside step 0"),
    "action missing from the chosen set": (_unmappable_action, ["--minimal-action-space"],
                                           "action DOWN in episode 0 has no counterpart"),
    "missing dataset": (lambda i: None, [], "there is no local Minari dataset"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_are_one_line_and_write_nothing(case: str, tmp_path: Path) -> None:
    make, options, phrase = REFUSALS[case]
    dataset_id = "tests/" + case.replace(" ", "-").replace("--", "-").lower() + "-v0"
    make(dataset_id)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = CliRunner().invoke(cli, ["demos", "import-minari", dataset_id,
                                      "--out", str(out_dir / "d.h5"), *options])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert phrase in lines[0]
    assert os.listdir(out_dir) == []


def test_frame_skip_one_imports_what_frame_skip_four_refuses(tmp_path: Path) -> None:
    _changing_actions("tests/changing-v0")
    result = import_minari("tests/changing-v0", tmp_path / "d.h5", frame_skip=1)
    with DemoFile(result.path) as demo:
        assert demo.spec.frame_skip == 1
        assert demo.read(0, "actions").tolist() == [MINIMAL.index("RIGHT")] * 3 + \
            [MINIMAL.index("LEFT")] * 3 + [MINIMAL.index("RIGHT")] * 3 + \
            [MINIMAL.index("LEFT")] * 3
        source = json.loads(demo.attrs["minari_source"])
        assert source["dataset_id"] == "tests/changing-v0"


def test_bootstrap_bc_takes_a_minari_dataset_id(tmp_path: Path) -> None:
    """`oakemu bootstrap bc minari:ID` imports the dataset into the run directory and clones
    it; the clone's lineage names the imported file."""
    demo = record_demo(tmp_path / "demos.h5", EnvSpec(game="pong"),
                       [(3, "scripted", 80), (4, "scripted", 80)])
    exported = CliRunner().invoke(cli, ["demos", "export-minari", str(demo),
                                        "--dataset-id", "oak/bc-input-v0"])
    assert exported.exit_code == 0, exported.output
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(cli, [
        "bootstrap", "bc", "minari:oak/bc-input-v0", "--run-dir", str(run_dir), "--epochs",
        "1", "--batch-size", "32", "--architecture", "tiny", "--val-fraction", "0.5",
        "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output
    imported = run_dir / "minari-oak__bc-input-v0.h5"
    with DemoFile(imported) as copy, DemoFile(demo) as original:
        assert [e.length for e in copy.episodes] == [e.length for e in original.episodes]
        assert np.array_equal(copy.read(0, "actions"), original.read(0, "actions"))
    clone = load_checkpoint(run_dir / "bc.pt")
    assert lineage_inputs(clone, "bc") == [str(imported.resolve())]
