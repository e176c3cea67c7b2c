"""Demo files: recorded from the real emulator, written, read back, damaged, killed, merged.

Every file here is a real HDF5 file in pytest's tmp_path, written by the real recorder
playing the real emulator with a small seeded random agent; nothing is mocked. Checks
that could hang or crash the interpreter (HDF5 reading damaged files) run in a child
process with a time limit, so a bug shows up as a failure instead of a stuck test run.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.metadata
import json
import multiprocessing
import os
import pickle
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import oakemu_rl
from oakemu_rl.agents import DiscardEpisode, StopRecording
from oakemu_rl.agents.play import AgentActionError
from oakemu_rl.agents.recording import RecordConfig, record
from oakemu_rl.demos import (
    DemoFile,
    DemoWriter,
    EpisodeBuffer,
    merge_demo_files,
    schema,
    stack_frames,
    validate_demo_file,
)
from oakemu_rl.envs import EnvSpec, action_meanings
from oakemu_rl.errors import DemoFileError, OakEmuError

DATASETS = ("frames", "actions", "rewards", "terminations", "truncations")
SMALL_STEPS = 12


class RandomAgent:
    """Uniformly random over the allowed actions, reseeded per episode; logs what it saw."""

    kind = "scripted"

    def __init__(self, allowed: list[int] | None = None) -> None:
        self.allowed = allowed
        self.episodes: list[dict[str, Any]] = []

    def reset(self, env: Any, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.episodes.append({"seed": seed, "obs": [], "actions": [], "rewards": [],
                              "terminations": [], "truncations": []})

    def act(self, env: Any, observation: np.ndarray) -> int:
        choices = self.allowed if self.allowed is not None else range(env.action_space.n)
        action = int(self.rng.choice(list(choices)))
        log = self.episodes[-1]
        log["obs"].append(np.array(observation, copy=True))
        log["actions"].append(action)
        return action

    def observe(self, reward: float, terminated: bool, truncated: bool, info: Any) -> None:
        log = self.episodes[-1]
        log["rewards"].append(reward)
        log["terminations"].append(terminated)
        log["truncations"].append(truncated)


def record_random(out: Path, spec: EnvSpec | None = None, *, episodes: int = 2, seed: int = 0,
                  max_steps: int | None = SMALL_STEPS, agent: RandomAgent | None = None):
    agent = agent or RandomAgent()
    result = record(
        RecordConfig(out=out, spec=spec or EnvSpec(), episodes=episodes, seed=seed,
                     max_steps=max_steps, progress=False),
        agent,
    )
    return result, agent


def text(value: Any) -> str:
    """A text attribute as str, whether h5py stored it variable- or fixed-length."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def read_all(path: Path) -> list[dict[str, np.ndarray]]:
    with DemoFile(path) as demo:
        return [{key: demo.read(i, key) for key in DATASETS} for i in range(len(demo.episodes))]


def copy_to(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def assert_refused(path: Path, match: str = "") -> DemoFileError:
    """DemoFile and validate_demo_file both refuse `path` with a message naming it."""
    for opener in (DemoFile, validate_demo_file):
        with pytest.raises(DemoFileError) as info:
            opener(path).close()
        assert str(path) in str(info.value), info.value
        if match:
            assert re.search(match, str(info.value)), info.value
    return info.value


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    """Three breakout episodes with the default (sticky, noop) spec, and what was played.

    Random breakout loses its five lives in ~150-200 steps, so with max_steps=200 some
    episodes end by termination and maybe one by the step limit.
    """
    path = tmp_path_factory.mktemp("played") / "breakout.h5"
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    result, agent = record_random(path, EnvSpec(game="breakout"), episodes=3, seed=7,
                                  max_steps=200)
    after = dt.datetime.now(dt.UTC)
    return {"path": path, "log": agent.episodes, "result": result, "before": before,
            "after": after, "spec": EnvSpec(game="breakout")}


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory) -> Path:
    """Two 12-step pong episodes: the template that the damage tests copy and break."""
    path = tmp_path_factory.mktemp("small") / "pong.h5"
    record_random(path, episodes=2, seed=0)
    return path


# -- round trip ----------------------------------------------------------------------------


def test_every_value_is_what_was_played(played):
    path, log = played["path"], played["log"]
    assert len(log) == 3
    with h5py.File(path, "r") as f:
        data = f["data"]
        assert sorted(data) == ["demo_0", "demo_1", "demo_2"]
        for i, episode in enumerate(log):
            group = data[f"demo_{i}"]
            n = len(episode["actions"])
            assert 1 <= n <= 200
            frames = np.stack([obs[-1] for obs in episode["obs"]])
            expected = {
                "frames": (frames, np.uint8),
                "actions": (np.array(episode["actions"]), np.int64),
                "rewards": (np.array(episode["rewards"], dtype=np.float32), np.float32),
                "terminations": (np.array(episode["terminations"]), np.bool_),
                "truncations": (np.array(episode["truncations"]), np.bool_),
            }
            for key, (values, dtype) in expected.items():
                stored = group[key][()]
                assert stored.dtype == dtype, key
                assert stored.shape == ((n, 84, 84) if key == "frames" else (n,)), key
                np.testing.assert_array_equal(stored, values, err_msg=f"demo_{i}/{key}")
            # the frames are compressed in chunks of at most 64 frames
            assert group["frames"].compression == "gzip"
            assert group["frames"].chunks == (min(64, n), 84, 84)
            # exactly the last step ends the episode
            ends = expected["terminations"][0] | expected["truncations"][0]
            assert ends[-1] and not ends[:-1].any()
            assert text(group.attrs["recorder"]) == "scripted"
            assert int(group.attrs["seed"]) == 7 + i == episode["seed"]
            assert int(group.attrs["length"]) == n
            assert int(group.attrs["num_samples"]) == n
            assert float(group.attrs["return"]) == pytest.approx(sum(episode["rewards"]))
        assert int(data.attrs["episodes"]) == 3
        assert int(data.attrs["total"]) == sum(len(e["actions"]) for e in log)
    # a breakout step limit of 200 random steps: at least one real game over
    assert any(e["terminations"][-1] for e in log)


def test_file_attributes(played):
    spec: EnvSpec = played["spec"]
    with h5py.File(played["path"], "r") as f:
        attrs = dict(f.attrs)
    assert set(schema.FILE_ATTRS) <= set(attrs)
    assert text(attrs["format"]) == "oakemu-rl-demos"
    assert int(attrs["schema_version"]) == schema.SCHEMA_VERSION == 1
    assert EnvSpec.from_json(text(attrs["env_spec"])) == spec.for_evaluation()
    assert json.loads(text(attrs["env_spec"])) == spec.for_evaluation().to_dict()
    assert json.loads(text(attrs["action_meanings"])) == list(action_meanings("breakout"))
    assert json.loads(text(attrs["action_mask"])) == [True] * 4
    assert list(attrs["frame_shape"]) == [84, 84]
    assert text(attrs["package_version"]) == oakemu_rl.__version__
    assert text(attrs["ale_py_version"]) == importlib.metadata.version("ale-py")
    created = dt.datetime.fromisoformat(text(attrs["created_at"]))
    assert created.tzinfo is not None
    assert played["before"] <= created <= played["after"]


def test_demo_file_reads_what_was_played(played):
    log = played["log"]
    with DemoFile(played["path"]) as demo:
        assert demo.spec == played["spec"].for_evaluation()
        assert demo.schema_version == 1
        assert demo.action_meanings == list(action_meanings("breakout"))
        assert demo.action_mask.tolist() == [True] * 4
        assert demo.frame_shape == (84, 84)
        assert demo.split is None
        assert demo.attrs["format"] == "oakemu-rl-demos"
        assert [e.index for e in demo.episodes] == [0, 1, 2]
        assert [e.name for e in demo.episodes] == ["demo_0", "demo_1", "demo_2"]
        assert demo.num_steps == sum(len(e["actions"]) for e in log)
        for i, (info, episode) in enumerate(zip(demo.episodes, log, strict=True)):
            assert info.length == len(episode["actions"])
            assert info.seed == episode["seed"]
            assert info.recorder == "scripted"
            assert info.episode_return == pytest.approx(sum(episode["rewards"]))
            assert info.terminated == episode["terminations"][-1]
            assert info.truncated == episode["truncations"][-1]
            np.testing.assert_array_equal(demo.read(i, "actions"), episode["actions"])
            np.testing.assert_array_equal(demo.read(i, "actions", slice(2, 5)),
                                          episode["actions"][2:5])
    result = played["result"]
    assert [e["index"] for e in result.episodes] == [0, 1, 2]
    assert [e["seed"] for e in result.episodes] == [7, 8, 9]
    assert [e["length"] for e in result.episodes] == [len(e["actions"]) for e in log]
    assert result.discarded == 0
    assert result.stopped is False


def test_max_steps_cuts_and_marks_truncated(small_demo):
    with DemoFile(small_demo) as demo:
        assert [e.length for e in demo.episodes] == [SMALL_STEPS, SMALL_STEPS]
        for i, info in enumerate(demo.episodes):
            assert info.truncated and not info.terminated
            truncations = demo.read(i, "truncations")
            assert truncations[-1] and not truncations[:-1].any()
            assert not demo.read(i, "terminations").any()


# -- stacks ----------------------------------------------------------------------------------


def test_observation_is_the_env_stack_at_every_step(played):
    with DemoFile(played["path"]) as demo:
        for ep, episode in enumerate(played["log"]):
            for t, obs in enumerate(episode["obs"]):
                rebuilt = demo.observation(ep, t)
                assert rebuilt.shape == (4, 84, 84)
                assert rebuilt.dtype == np.uint8
                np.testing.assert_array_equal(rebuilt, obs, err_msg=f"episode {ep} step {t}")
            # the first three steps are zero-padded, never taken from the previous episode
            for t in range(3):
                rebuilt = demo.observation(ep, t)
                assert not rebuilt[: 3 - t].any(), f"episode {ep} step {t}"
                assert all(rebuilt[i].any() for i in range(3 - t, 4))
            if ep > 0:
                previous_last = demo.read(ep - 1, "frames")[-3:]
                assert previous_last.any()
                assert not demo.observation(ep, 0)[:3].any()


@pytest.mark.parametrize("t", [-1, -4, SMALL_STEPS, SMALL_STEPS + 3])
def test_observation_outside_the_episode_is_an_index_error(small_demo, t):
    """Today t=-1 silently returns an all-zero stack (a frame the episode never had) and
    t=length a numpy broadcasting ValueError; both should be an IndexError."""
    with DemoFile(small_demo) as demo:
        np.testing.assert_array_equal(demo.observation(0, SMALL_STEPS - 1)[-1],
                                      demo.read(0, "frames")[-1])
        with pytest.raises(IndexError):
            demo.observation(0, t)


def test_stack_frames_by_hand():
    frames = np.stack([np.full((2, 3), v, dtype=np.uint8) for v in (1, 2, 3, 4, 5)])

    def values(stack: np.ndarray) -> list[int]:
        assert stack.shape == (len(stack), 2, 3)
        assert all((frame == frame.flat[0]).all() for frame in stack)
        return [int(frame.flat[0]) for frame in stack]

    assert values(stack_frames(frames, 0, 4)) == [0, 0, 0, 1]
    assert values(stack_frames(frames, 1, 4)) == [0, 0, 1, 2]
    assert values(stack_frames(frames, 2, 4)) == [0, 1, 2, 3]
    assert values(stack_frames(frames, 3, 4)) == [1, 2, 3, 4]
    assert values(stack_frames(frames, 4, 4)) == [2, 3, 4, 5]
    assert values(stack_frames(frames, 4, 1)) == [5]
    assert values(stack_frames(frames, 0, 1)) == [1]
    assert values(stack_frames(frames, 1, 6)) == [0, 0, 0, 0, 1, 2]
    assert values(stack_frames(frames, 4, 5)) == [1, 2, 3, 4, 5]
    # the reader passes only the needed slice and a shifted t: same result
    for t in range(5):
        lo = max(0, t - 3)
        np.testing.assert_array_equal(stack_frames(frames[lo:t + 1], t - lo, 4),
                                      stack_frames(frames, t, 4))
    assert stack_frames(frames, 0, 4).dtype == np.uint8
    wide = frames.astype(np.int16) * 300
    assert stack_frames(wide, 2, 4).dtype == np.int16
    assert stack_frames(wide, 2, 4)[-1, 0, 0] == 900
    # the input is not modified and the output does not alias it
    out = stack_frames(frames, 4, 4)
    out[:] = 0
    assert frames[4, 0, 0] == 5


# -- appending --------------------------------------------------------------------------------


def test_append_continues_numbering(tmp_path):
    path = tmp_path / "pong.h5"
    first, _ = record_random(path, episodes=2, seed=0, max_steps=8)
    before = read_all(path)
    created_at = DemoFile(path).attrs["created_at"]
    second, second_agent = record_random(path, episodes=2, seed=100, max_steps=8)
    assert [e["index"] for e in first.episodes] == [0, 1]
    assert [e["index"] for e in second.episodes] == [2, 3]
    with validate_demo_file(path) as demo:
        assert [e.name for e in demo.episodes] == ["demo_0", "demo_1", "demo_2", "demo_3"]
        assert [e.seed for e in demo.episodes] == [0, 1, 100, 101]
        assert demo.attrs["created_at"] == created_at
        assert int(demo.handle["data"].attrs["episodes"]) == 4
        assert int(demo.handle["data"].attrs["total"]) == 32
        for i, old in enumerate(before):
            for key in DATASETS:
                np.testing.assert_array_equal(demo.read(i, key), old[key])
        for i, episode in enumerate(second_agent.episodes, start=2):
            np.testing.assert_array_equal(demo.read(i, "actions"), episode["actions"])
    # the writer itself continues too, and write_episodes numbers a batch in order
    writer = DemoWriter(path, EnvSpec())
    buffer = EpisodeBuffer()
    for t in range(3):
        buffer.add(np.full((84, 84), t, np.uint8), t, float(t), False, t == 2)
    assert writer.write_episodes([(buffer, "human", 5), (buffer, "policy", 6)]) == [4, 5]
    assert writer.write_episode(buffer, recorder="scripted", seed=7) == 6
    with validate_demo_file(path) as demo:
        assert [e.recorder for e in demo.episodes[4:]] == ["human", "policy", "scripted"]
        assert demo.episodes[5].episode_return == 3.0
        np.testing.assert_array_equal(demo.read(6, "frames")[:, 0, 0], [0, 1, 2])


def test_append_ignores_training_only_switches(tmp_path):
    path = tmp_path / "pong.h5"
    record_random(path, episodes=1, max_steps=4)
    result, _ = record_random(path, EnvSpec(reward_clipping=True, episodic_life=True),
                              episodes=1, seed=1, max_steps=4)
    assert result.episodes[0]["index"] == 1
    with DemoFile(path) as demo:
        assert demo.spec.reward_clipping is False
        assert demo.spec.episodic_life is False


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        (EnvSpec(game="breakout"), "game"),
        (EnvSpec(repeat_action_probability=0.0), "repeat_action_probability"),
        (EnvSpec(frame_skip=3), "frame_skip"),
        (EnvSpec(noop_max=0), "noop_max"),
        (EnvSpec(forbidden_actions=("FIRE",)), "forbidden_actions"),
        (EnvSpec(full_action_space=True), "full_action_space"),
    ],
    ids=["game", "sticky", "frame_skip", "noop_max", "forbidden", "full_action_space"],
)
def test_append_with_another_spec_is_refused(small_demo, tmp_path, spec, key):
    path = copy_to(small_demo, tmp_path / "pong.h5")
    original = path.read_bytes()
    with pytest.raises(DemoFileError) as info:
        DemoWriter(path, spec)
    assert str(path) in str(info.value)
    assert key in str(info.value)
    with pytest.raises(DemoFileError):
        record_random(path, spec, episodes=1)
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["pong.h5"], "no temporary file is left behind"


def test_writer_refuses_bad_episodes_and_leaves_the_file(small_demo, tmp_path):
    path = copy_to(small_demo, tmp_path / "pong.h5")
    original = path.read_bytes()
    writer = DemoWriter(path, EnvSpec())

    def buffer(frame_shape=(84, 84), action=0) -> EpisodeBuffer:
        b = EpisodeBuffer()
        b.add(np.zeros(frame_shape, np.uint8), action, 0.0, False, True)
        return b

    with pytest.raises(ValueError, match="empty"):
        writer.write_episode(EpisodeBuffer(), recorder="scripted", seed=0)
    with pytest.raises(ValueError, match="recorder"):
        writer.write_episode(buffer(), recorder="robot", seed=0)
    with pytest.raises(ValueError, match="frames"):
        writer.write_episode(buffer((64, 64)), recorder="scripted", seed=0)
    for action in (-1, 6):
        with pytest.raises(ValueError, match="out of range"):
            writer.write_episode(buffer(action=action), recorder="scripted", seed=0)
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["pong.h5"]


def test_episode_buffer():
    b = EpisodeBuffer()
    frame = np.ones((84, 84), np.uint8)
    b.add(frame, 2, 1.5, False, False)
    frame[:] = 9  # the buffer keeps a copy
    b.add(frame, 3, -1.0, True, False)
    assert len(b) == 2
    assert b.episode_return == 0.5
    assert b.frames[0].max() == 1
    assert b.actions == [2, 3]
    assert b.terminations == [False, True]
    b.clear()
    assert len(b) == 0
    assert b.frames == [] and b.rewards == [] and b.truncations == []


# -- the recorder --------------------------------------------------------------------------


def test_record_refuses_a_forbidden_action(tmp_path):
    path = tmp_path / "pong.h5"
    spec = EnvSpec(forbidden_actions=("FIRE",))
    with pytest.raises(AgentActionError, match="forbidden action FIRE"):
        record_random(path, spec, episodes=1, agent=RandomAgent(allowed=[1]))
    with DemoFile(path) as demo:
        assert demo.episodes == []
        assert demo.action_mask.tolist() == [True, False, True, True, True, True]
    result, agent = record_random(path, spec, episodes=1, agent=RandomAgent([0, 2, 3, 4, 5]))
    assert 1 not in agent.episodes[0]["actions"]
    assert result.episodes[0]["index"] == 0


def test_record_discard_and_stop(tmp_path):
    class Moody(RandomAgent):
        def __init__(self) -> None:
            super().__init__()
            self.resets = 0

        def reset(self, env, seed):
            super().reset(env, seed)
            self.resets += 1

        def act(self, env, observation):
            if self.resets == 2 and len(self.episodes[-1]["actions"]) == 3:
                raise DiscardEpisode
            if self.resets == 4 and len(self.episodes[-1]["actions"]) == 1:
                raise StopRecording
            return super().act(env, observation)

    path = tmp_path / "pong.h5"
    with pytest.raises(ValueError):
        record(RecordConfig(out=path, episodes=0), RandomAgent())
    agent = Moody()
    result = record(RecordConfig(out=path, episodes=5, seed=10, max_steps=5, progress=False),
                    agent)
    assert result.discarded == 1
    assert result.stopped is True
    # resets: seed 10 (kept), 11 (discarded), 11 again (kept), 12 (stopped)
    assert [e["seed"] for e in agent.episodes] == [10, 11, 11, 12]
    assert [e["seed"] for e in result.episodes] == [10, 11]
    with validate_demo_file(path) as demo:
        assert [e.seed for e in demo.episodes] == [10, 11]
        np.testing.assert_array_equal(demo.read(1, "actions"), agent.episodes[2]["actions"])


def test_relabelling_stores_the_labels_and_plays_the_driver(tmp_path):
    # The driver and the labeller pick from different seeded streams; the trajectory must be
    # the driver's alone (same frames as the driver recording by itself), the actions the
    # labeller's.
    driver, labeller = RandomAgent(), RandomAgent(allowed=[2, 3])
    config = RecordConfig(out=tmp_path / "relabelled.h5", episodes=2, seed=5, max_steps=40,
                          progress=False)
    result = record(config, labeller, driver)
    record(dataclasses.replace(config, out=tmp_path / "alone.h5"), RandomAgent())
    assert [e["seed"] for e in result.episodes] == [5, 6]
    with validate_demo_file(config.out) as demo, DemoFile(tmp_path / "alone.h5") as ref:
        assert [e.recorder for e in demo.episodes] == ["relabelled", "relabelled"]
        for i in range(2):
            np.testing.assert_array_equal(demo.read(i, "frames"), ref.read(i, "frames"))
            np.testing.assert_array_equal(demo.read(i, "rewards"), ref.read(i, "rewards"))
            np.testing.assert_array_equal(demo.read(i, "actions"), labeller.episodes[i]["actions"])
            assert not np.array_equal(demo.read(i, "actions"), driver.episodes[i]["actions"])
            np.testing.assert_array_equal(ref.read(i, "actions"), driver.episodes[i]["actions"])


def test_relabelling_refuses_a_forbidden_driver_action(tmp_path):
    spec = EnvSpec(forbidden_actions=("FIRE",))
    config = RecordConfig(out=tmp_path / "r.h5", spec=spec, episodes=1, max_steps=5,
                          progress=False)
    with pytest.raises(AgentActionError, match="forbidden action FIRE"):
        record(config, RandomAgent([0, 2]), RandomAgent(allowed=[1]))
    with DemoFile(config.out) as demo:
        assert demo.episodes == []


# -- damaged and foreign files --------------------------------------------------------------


def test_missing_file(tmp_path):
    assert_refused(tmp_path / "nope.h5", "does not exist")


def test_directory(tmp_path):
    (tmp_path / "dir.h5").mkdir()
    assert_refused(tmp_path / "dir.h5", "directory")


@pytest.mark.parametrize(
    ("name", "content"),
    [("empty.h5", b""), ("text.h5", b"frames,actions\n1,2\n" * 50),
     ("zeros.h5", bytes(4096)), ("png.h5", b"\x89PNG\r\n\x1a\n" + bytes(100))],
)
def test_not_hdf5(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    assert_refused(path, "not a readable HDF5 file")


def test_truncated_copies(small_demo, tmp_path):
    data = small_demo.read_bytes()
    cuts = sorted({1, 8, 96, 512, 2048, 4096, len(data) // 3, len(data) // 2,
                   len(data) - 4096, len(data) - 100, len(data) - 1})
    for cut in cuts:
        path = tmp_path / f"cut_{cut}.h5"
        path.write_bytes(data[:cut])
        assert_refused(path)


def test_flipped_frame_bytes_are_caught_by_validate(small_demo, tmp_path):
    path = copy_to(small_demo, tmp_path / "flipped.h5")
    with h5py.File(path, "r") as f:
        chunk = f["data/demo_1/frames"].id.get_chunk_info(0)
    raw = bytearray(path.read_bytes())
    middle = chunk.byte_offset + chunk.size // 2
    for i in range(middle, middle + 16):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    with DemoFile(path) as demo:  # opening checks metadata only
        assert len(demo.episodes) == 2
        with pytest.raises((OSError, RuntimeError, ValueError)):
            demo.read(1, "frames")
    with pytest.raises(DemoFileError, match="damaged") as info:
        validate_demo_file(path)
    assert str(path) in str(info.value)


def test_foreign_hdf5_file(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((3, 8, 8), np.uint8))
        f.create_group("labels").create_dataset("y", data=[1, 2, 3])
        f.attrs["creator"] = "someone else"
    assert_refused(path, "not an OakEmu-RL demo file")


def _del(path: str):
    def change(f: h5py.File) -> None:
        del f[path]
    return change


def _set_attr(where: str, key: str, value: Any):
    def change(f: h5py.File) -> None:
        f[where].attrs[key] = value
    return change


def _del_attr(where: str, key: str):
    def change(f: h5py.File) -> None:
        del f[where].attrs[key]
    return change


def _replace(path: str, make):
    def change(f: h5py.File) -> None:
        old = f[path][()]
        del f[path]
        f.create_dataset(path, data=make(old))
    return change


def _actions_to(value: int):
    def change(f: h5py.File) -> None:
        f["data/demo_0/actions"][0] = value
    return change


def _spec_with(**changes: Any) -> str:
    data = EnvSpec().to_dict()
    data.update(changes)
    return json.dumps(data)


def _empty_episode(f: h5py.File) -> None:
    for key in DATASETS:
        old = f[f"data/demo_1/{key}"][()]
        del f[f"data/demo_1/{key}"]
        f.create_dataset(f"data/demo_1/{key}", data=old[:0])
    f["data/demo_1"].attrs["length"] = 0
    f["data"].attrs["total"] = SMALL_STEPS


def _split(train: list[bytes], valid: list[bytes] | None):
    def change(f: h5py.File) -> None:
        group = f.create_group("mask")
        group.create_dataset("train", data=np.array(train))
        if valid is not None:
            group.create_dataset("valid", data=np.array(valid))
    return change


MUTATIONS = {
    "missing actions": (_del("data/demo_0/actions"), r"lacks the dataset data/demo_0/actions"),
    "missing frames": (_del("data/demo_1/frames"), r"lacks the dataset data/demo_1/frames"),
    "missing data group": (_del("data"), r"no 'data' group"),
    "actions float32": (_replace("data/demo_0/actions", lambda a: a.astype(np.float32)),
                        r"demo_0/actions of dtype float32, expected int64"),
    "rewards float64": (_replace("data/demo_1/rewards", lambda a: a.astype(np.float64)),
                        r"dtype float64"),
    "terminations uint8": (_replace("data/demo_0/terminations", lambda a: a.astype(np.uint8)),
                           r"dtype uint8"),
    "frames 64x64": (_replace("data/demo_0/frames", lambda a: np.zeros((len(a), 64, 64),
                                                                        np.uint8)),
                     r"frames of shape \(12, 64, 64\), expected \(steps, 84, 84\)"),
    "frames flat": (_replace("data/demo_0/frames", lambda a: a.reshape(len(a), -1)),
                    r"shape"),
    "actions 2-d": (_replace("data/demo_0/actions", lambda a: a.reshape(-1, 1)),
                    r"actions of shape \(12, 1\), expected \(steps\)"),
    "short rewards": (_replace("data/demo_0/rewards", lambda a: a[:-1]),
                      r"different lengths"),
    "empty episode": (_empty_episode, r"empty episode data/demo_1"),
    "newer schema": (_set_attr("/", "schema_version", schema.SCHEMA_VERSION + 1),
                     r"schema version 2, newer.*upgrade"),
    "schema 0": (_set_attr("/", "schema_version", 0), r"invalid schema version"),
    "schema as text": (_set_attr("/", "schema_version", "1"), r"malformed schema_version"),
    "schema as float": (_set_attr("/", "schema_version", 1.0), r"malformed schema_version"),
    "no format": (_del_attr("/", "format"), r"not an OakEmu-RL demo file"),
    "other format": (_set_attr("/", "format", "robomimic"), r"not an OakEmu-RL demo file"),
    "format not text": (_set_attr("/", "format", 7), r""),
    "no created_at": (_del_attr("/", "created_at"), r"lacks the file attribute 'created_at'"),
    "no env_spec": (_del_attr("/", "env_spec"), r"lacks the file attribute 'env_spec'"),
    "env_spec not json": (_set_attr("/", "env_spec", "{game: pong"), r"unusable env_spec"),
    "env_spec unknown key": (_set_attr("/", "env_spec", _spec_with(colour=True)),
                             r"unusable env_spec.*colour"),
    "env_spec unknown game": (_set_attr("/", "env_spec", _spec_with(game="zelda")),
                              r"unusable env_spec.*zelda"),
    "meanings not json": (_set_attr("/", "action_meanings", "NOOP, FIRE"), r""),
    "mask too short": (_set_attr("/", "action_mask", json.dumps([True] * 5)), r"disagree"),
    "mask all false": (_set_attr("/", "action_mask", json.dumps([False] * 6)), r"disagree"),
    "mask of ints": (_set_attr("/", "action_mask", json.dumps([1] * 6)), r"disagree"),
    "no meanings": (_set_attr("/", "action_meanings", "[]"), r"disagree"),
    "frame_shape": (_set_attr("/", "frame_shape", np.array([64, 64])),
                    r"says frames are \(64, 64\)"),
    "unexpected entry": (lambda f: f["data"].create_group("extra"),
                         r"unexpected entry data/extra"),
    "unexpected dataset": (lambda f: f["data"].create_dataset("demo_9", data=[1]),
                           r"unexpected entry data/demo_9"),
    "no seed": (_del_attr("data/demo_1", "seed"), r"lacks the attribute 'seed' on data/demo_1"),
    "wrong length": (_set_attr("data/demo_0", "length", 11), r"length attribute disagrees"),
    "unknown recorder": (_set_attr("data/demo_0", "recorder", "robot"),
                         r"unknown recorder kind 'robot'"),
    "action too big": (_actions_to(6), r"out-of-range actions in data/demo_0"),
    "negative action": (_actions_to(-1), r"out-of-range actions"),
    "wrong total": (_set_attr("data", "total", 5), r"data/total"),
    "split without valid": (_split([b"demo_0"], None), r"mask/valid"),
    "split naming a missing episode": (_split([b"demo_0"], [b"demo_7"]),
                                       r"mask/valid naming a missing episode demo_7"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_layout_damage(small_demo, tmp_path, name):
    change, match = MUTATIONS[name]
    path = copy_to(small_demo, tmp_path / "damaged.h5")
    with h5py.File(path, "a") as f:
        change(f)
    assert_refused(path, match)


def test_a_stored_split_is_read(small_demo, tmp_path):
    path = copy_to(small_demo, tmp_path / "split.h5")
    with h5py.File(path, "a") as f:
        _split([b"demo_0"], [b"demo_1"])(f)
    with validate_demo_file(path) as demo:
        assert demo.split == {"train": ["demo_0"], "valid": ["demo_1"]}
        assert demo.summary()["split"] == {"train": 1, "valid": 1}


def test_demo_file_errors_are_user_errors():
    assert issubclass(DemoFileError, OakEmuError)


# Reading a damaged HDF5 file can hang or crash inside libhdf5, where no Python `except`
# reaches; so these checks run in a child process that reports each file's outcome.
_WORKER = r"""
import json, sys
from oakemu_rl.demos import validate_demo_file
from oakemu_rl.errors import DemoFileError
print("ready", flush=True)
for line in sys.stdin:
    path = line.rstrip("\n")
    try:
        validate_demo_file(path).close()
        result = {"outcome": "ok"}
    except DemoFileError as error:
        result = {"outcome": "DemoFileError", "message": str(error)}
    except BaseException as error:
        result = {"outcome": type(error).__name__, "message": str(error)[:300]}
    print(json.dumps(result), flush=True)
"""


def validate_in_child(paths: list[Path], timeout: float) -> list[dict[str, str]]:
    """validate_demo_file on each path in a child process; a hang or crash is an outcome."""
    results: list[dict[str, str]] = []
    pending = list(paths)
    while pending:
        child = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "ready\n"
            while pending:
                path = pending.pop(0)
                child.stdin.write(f"{path}\n")
                child.stdin.flush()
                ready, _, _ = select.select([child.stdout], [], [], timeout)
                if not ready:
                    results.append({"outcome": f"hang (no answer in {timeout:.0f} s)"})
                    break
                line = child.stdout.readline()
                if not line:
                    child.wait()
                    results.append({"outcome": f"crash (exit status {child.returncode})"})
                    break
                results.append(json.loads(line))
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdin.close()
            child.stdout.close()
    return results


def test_random_damage_only_ever_raises_demo_file_error(small_demo, tmp_path):
    data = small_demo.read_bytes()
    rng = np.random.default_rng(20240601)
    paths, kinds = [], []
    for i in range(50):
        raw = bytearray(data)
        if i % 2 == 0:
            raw = raw[: int(rng.integers(0, len(raw)))]
            kinds.append("truncated")
        else:
            for _ in range(int(rng.integers(1, 9))):
                raw[int(rng.integers(0, len(raw)))] ^= int(rng.integers(1, 256))
            kinds.append("flipped")
        path = tmp_path / f"mutant_{i}.h5"
        path.write_bytes(bytes(raw))
        paths.append(path)
    results = validate_in_child(paths, timeout=10)
    problems = []
    for path, kind, result in zip(paths, kinds, results, strict=True):
        outcome = result["outcome"]
        if outcome == "DemoFileError":
            if str(path) not in result["message"]:
                problems.append(f"{path.name}: message does not name the file: {result}")
        elif outcome == "ok" and kind == "flipped":
            pass  # a flip in raw, uncompressed data (a reward, a flag) cannot be detected
        else:
            problems.append(f"{path.name} ({kind}): {result}")
    assert not problems, "\n".join(problems)
    assert sum(r["outcome"] == "DemoFileError" for r in results) >= 25


def test_damaged_string_attribute_does_not_hang(small_demo, tmp_path):
    """A corrupt size field of a variable-length string attribute (HDF5 global heap)
    sends libhdf5 into an endless loop when the reader reads the attribute. The writer
    stores every text attribute that way (h5py's default for `str`) in the oldest,
    checksum-free HDF5 format, so one bad byte in the header makes `oakemu` hang
    instead of reporting a DemoFileError."""
    data = small_demo.read_bytes()
    text = oakemu_rl.__version__.encode()
    at = data.find(text, 1024)
    assert at > 0
    raw = bytearray(data)
    raw[at - 8] ^= 0xC3  # the byte 8 before the value: for a global-heap object, its size
    path = tmp_path / "bad_attribute.h5"
    path.write_bytes(bytes(raw))
    [result] = validate_in_child([path], timeout=5)
    assert result["outcome"] == "DemoFileError", result
    assert str(path) in result["message"]


# -- SIGKILL while recording -----------------------------------------------------------------

_RECORDER = r"""
import sys
from pathlib import Path
import numpy as np
from oakemu_rl.agents.recording import RecordConfig, record
from oakemu_rl.envs import EnvSpec

class RandomAgent:
    kind = "scripted"

    def reset(self, env, seed):
        self.rng = np.random.default_rng(seed)
        self.steps = 0
        print("episode", seed, flush=True)

    def act(self, env, observation):
        self.steps += 1
        if self.steps == 60:  # the episode is committed right after this step
            print("last", flush=True)
        return int(self.rng.integers(env.action_space.n))

out, seed = Path(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
record(RecordConfig(out=out, spec=EnvSpec(), episodes=100_000, seed=seed, max_steps=60,
                    progress=False), RandomAgent())
"""


def _lines(child: subprocess.Popen) -> tuple[queue.Queue, threading.Thread]:
    """The child's stdout lines, read by a thread ("" once it closes)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line)
        lines.put("")

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return lines, thread


def _read_line(lines: queue.Queue, deadline: float) -> str:
    try:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise AssertionError("the recorder printed nothing in time") from None
    assert line, "the recorder exited early"
    return line


def test_sigkill_never_damages_the_file(tmp_path):
    path = tmp_path / "demo.h5"
    rng = np.random.default_rng(7)
    counts = [0]
    seeds: set[int] = set()
    # (committed episodes to wait for, wait for the last step?, delay): one kill while the
    # file is created, three in the ~5 ms an episode takes to commit, one mid-episode
    plans = [(-1, False, 0.0)]
    plans += [(int(rng.integers(0, 3)), True, float(rng.uniform(0.0, 0.006))) for _ in range(3)]
    plans += [(int(rng.integers(0, 3)), False, float(rng.uniform(0.0, 0.1)))]
    for run, (wait_episodes, wait_last, delay) in enumerate(plans):
        base_seed = 1000 * (run + 1)
        child = subprocess.Popen([sys.executable, "-c", _RECORDER, str(path), str(base_seed)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        lines, pump = _lines(child)
        try:
            deadline = time.monotonic() + 60
            assert _read_line(lines, deadline) == "ready\n"
            started = 0  # episode k starts once k are committed
            while started < wait_episodes + 1:
                started += _read_line(lines, deadline).startswith("episode")
            if wait_last:
                assert _read_line(lines, deadline) == "last\n"
            time.sleep(delay)
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=10) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            pump.join(timeout=10)
            assert child.stdout is not None
            child.stdout.close()
        leftovers = sorted(os.listdir(tmp_path))
        assert all(n == "demo.h5" or n.startswith(".demo.h5.tmp-") for n in leftovers), leftovers
        assert [p.name for p in tmp_path.glob("*.h5")] == (["demo.h5"] if path.exists() else [])
        if not path.exists():
            assert run == 0, "once created, the file never disappears"
            counts.append(0)
            continue
        with validate_demo_file(path) as demo:
            n = len(demo.episodes)
            assert [e.index for e in demo.episodes] == list(range(n))
            for i, info in enumerate(demo.episodes):
                assert info.length == 60, "every committed episode is complete"
                assert info.truncated and not info.terminated
                truncations = demo.read(i, "truncations")
                assert truncations[-1] and not truncations[:-1].any()
                assert not demo.read(i, "terminations").any()
                assert demo.read(i, "frames").shape == (60, 84, 84)
            run_seeds = [e.seed for e in demo.episodes if e.seed >= base_seed]
            assert run_seeds == list(range(base_seed, base_seed + len(run_seeds)))
            assert {e.seed for e in demo.episodes if e.seed < base_seed} == seeds
            seeds |= set(run_seeds)
        assert n >= counts[-1] + max(wait_episodes, 0), (n, counts, wait_episodes)
        counts.append(n)
    assert counts == sorted(counts)
    assert counts[-1] >= sum(max(plan[0], 0) for plan in plans)
    # the file is still appendable after all that, and numbering continues
    result, _ = record_random(path, episodes=1, seed=1, max_steps=5)
    assert result.episodes[0]["index"] == counts[-1]
    with validate_demo_file(path) as demo:
        assert len(demo.episodes) == counts[-1] + 1


# -- merging ---------------------------------------------------------------------------------


def test_merge(small_demo, tmp_path):
    a = copy_to(small_demo, tmp_path / "a.h5")
    b = tmp_path / "b.h5"
    record_random(b, episodes=1, seed=50, max_steps=5)
    out = tmp_path / "merged.h5"
    assert merge_demo_files(out, [a, b]) == 3
    expected = read_all(a) + read_all(b)
    with validate_demo_file(out) as merged:
        assert merged.spec == EnvSpec()
        assert [e.name for e in merged.episodes] == ["demo_0", "demo_1", "demo_2"]
        assert [e.seed for e in merged.episodes] == [0, 1, 50]
        assert [e.length for e in merged.episodes] == [SMALL_STEPS, SMALL_STEPS, 5]
        assert [e.recorder for e in merged.episodes] == ["scripted"] * 3
        for i, episode in enumerate(expected):
            for key in DATASETS:
                values = merged.read(i, key)
                assert values.dtype == episode[key].dtype
                np.testing.assert_array_equal(values, episode[key], err_msg=f"{i}/{key}")
        with DemoFile(a) as source:
            assert merged.episodes[0].episode_return == source.episodes[0].episode_return
    # merging into an existing file with the same spec appends
    assert merge_demo_files(out, [b]) == 1
    with DemoFile(out) as merged:
        assert [e.seed for e in merged.episodes] == [0, 1, 50, 50]


def test_merge_refuses_mismatched_specs(small_demo, tmp_path):
    a = copy_to(small_demo, tmp_path / "a.h5")
    c = tmp_path / "c.h5"
    record_random(c, EnvSpec(repeat_action_probability=0.0), episodes=1, max_steps=3)
    out = tmp_path / "merged.h5"
    with pytest.raises(DemoFileError, match="repeat_action_probability") as info:
        merge_demo_files(out, [a, c])
    assert str(c) in str(info.value)
    assert not out.exists()


def test_merge_refuses_an_output_that_is_an_input(small_demo, tmp_path):
    a = copy_to(small_demo, tmp_path / "a.h5")
    b = copy_to(small_demo, tmp_path / "b.h5")
    original = a.read_bytes()
    for out in (a, tmp_path / "." / "a.h5", tmp_path / "sub" / ".." / "a.h5"):
        if "sub" in out.parts:
            (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(DemoFileError, match="also an input"):
            merge_demo_files(out, [b, a])
    assert a.read_bytes() == original
    with pytest.raises(DemoFileError):
        merge_demo_files(tmp_path / "out.h5", [])
    with pytest.raises(DemoFileError, match="does not exist"):
        merge_demo_files(tmp_path / "out.h5", [a, tmp_path / "missing.h5"])
    assert not (tmp_path / "out.h5").exists()


# -- pickling and worker processes -------------------------------------------------------------


def _observation_in_pool_worker(demo: DemoFile, episode: int, t: int):
    handle_before = demo._handle
    obs = demo.observation(episode, t)
    return os.getpid(), handle_before is None, demo._pid == os.getpid(), obs


def _observation_in_forked_child(demo: DemoFile, queue) -> None:
    inherited = demo._handle is not None and demo._pid != os.getpid()
    obs = demo.observation(0, 5)
    queue.put((inherited, demo._pid == os.getpid(), obs))
    demo.close()


def test_demo_file_pickles_and_reopens_lazily(played):
    demo = DemoFile(played["path"])
    try:
        expected = demo.observation(0, 5)
        assert demo._handle is not None
        clone = pickle.loads(pickle.dumps(demo))
        assert clone._handle is None
        assert clone.episodes == demo.episodes
        assert clone.spec == demo.spec
        np.testing.assert_array_equal(clone.observation(0, 5), expected)
        assert clone._handle is not None and clone._handle is not demo._handle
        clone.close()

        ctx = multiprocessing.get_context("fork")
        # a DataLoader-style worker gets a pickled copy: no handle until first use
        with ctx.Pool(1) as pool:
            pid, was_none, owns, obs = pool.apply(_observation_in_pool_worker, (demo, 0, 5))
        assert pid != os.getpid()
        assert was_none and owns
        np.testing.assert_array_equal(obs, expected)
        # a forked child that inherits the object (and the parent's open handle) reopens
        queue = ctx.Queue()
        child = ctx.Process(target=_observation_in_forked_child, args=(demo, queue))
        child.start()
        inherited, owns, obs = queue.get(timeout=30)
        child.join(timeout=30)
        assert child.exitcode == 0
        assert inherited and owns
        np.testing.assert_array_equal(obs, expected)
        # the parent's handle still works after the children are gone
        np.testing.assert_array_equal(demo.observation(0, 5), expected)
        np.testing.assert_array_equal(played["log"][0]["obs"][5], expected)
    finally:
        demo.close()
    assert demo._handle is None


# -- summary -------------------------------------------------------------------------------


def test_summary(played):
    log = played["log"]
    returns = np.array([sum(e["rewards"]) for e in log])
    with DemoFile(played["path"]) as demo:
        summary = demo.summary()
    steps = sum(len(e["actions"]) for e in log)
    assert summary["path"] == str(played["path"])
    assert summary["schema_version"] == 1
    assert summary["env_spec"] == played["spec"].for_evaluation().to_dict()
    assert summary["episodes"] == 3
    assert summary["steps"] == steps
    assert summary["returns"]["mean"] == pytest.approx(returns.mean())
    assert summary["returns"]["std"] == pytest.approx(returns.std())
    assert summary["returns"]["min"] == pytest.approx(returns.min())
    assert summary["returns"]["max"] == pytest.approx(returns.max())
    assert summary["recorders"] == ["scripted"]
    histogram = summary["action_histogram"]
    assert list(histogram) == list(action_meanings("breakout"))
    assert sum(histogram.values()) == steps
    played_counts = np.bincount(np.concatenate([e["actions"] for e in log]), minlength=4)
    assert list(histogram.values()) == played_counts.tolist()
    assert summary["action_mask"] == dict.fromkeys(action_meanings("breakout"), True)
    assert summary["bytes"] == played["path"].stat().st_size
    assert summary["bytes_per_frame"] == pytest.approx(summary["bytes"] / steps, abs=0.1)
    assert summary["split"] is None
    json.dumps(summary)  # plain data, printable as JSON


def test_summary_of_a_file_without_episodes(tmp_path):
    path = tmp_path / "empty.h5"
    DemoWriter(path, EnvSpec())
    with validate_demo_file(path) as demo:
        summary = demo.summary()
    assert summary["episodes"] == 0
    assert summary["steps"] == 0
    assert summary["returns"] == {"mean": None, "std": None, "min": None, "max": None}
    assert summary["action_histogram"] == dict.fromkeys(action_meanings("pong"), 0)
    assert summary["bytes_per_frame"] is None
