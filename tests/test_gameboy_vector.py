"""The Game Boy vector env on the real emulator: the same games as gymnasium's SyncVectorEnv
over single GameBoyEnvs (seeds, both autoreset modes, final observations, lives), in this
process and in worker processes, and workers that close, die and outlive no parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyboy")

from oakemu_rl.envs import EnvSpec
from oakemu_rl.envs.gameboy import GameBoyEnv
from oakemu_rl.envs.pool import PoolVectorEnv
from oakemu_rl.errors import EnvError

SRC = Path(__file__).resolve().parents[1] / "src"


def short_catch(max_steps: int = 12) -> EnvSpec:
    """CATCH with games cut after `max_steps` steps, so that episodes end in a short test."""
    config = json.loads(EnvSpec(game="catch").game_config)
    config["game"]["max_steps"] = max_steps
    return EnvSpec(game="catch", game_config=json.dumps(config))


def reference(spec: EnvSpec, num_envs: int, same_step_reset: bool):
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    mode = AutoresetMode.SAME_STEP if same_step_reset else AutoresetMode.NEXT_STEP
    return SyncVectorEnv([lambda: GameBoyEnv(spec) for _ in range(num_envs)],
                         autoreset_mode=mode)


@pytest.mark.parametrize(("same_step_reset", "workers"),
                         [(True, 2), (False, 2), (True, 0), (False, 3)])
def test_same_games_as_single_envs(same_step_reset: bool, workers: int) -> None:
    spec, n, steps = short_catch(), 3, 30
    ours = PoolVectorEnv(spec, n, same_step_reset=same_step_reset,
                            processes=workers > 0, workers=workers or None)
    theirs = reference(spec, n, same_step_reset)
    try:
        obs, info = ours.reset(seed=7)
        ref_obs, ref_info = theirs.reset(seed=7)
        np.testing.assert_array_equal(obs, ref_obs)
        np.testing.assert_array_equal(info["lives"], ref_info["lives"])
        rng = np.random.default_rng(0)
        finals = 0
        for _ in range(steps):
            actions = rng.integers(0, 3, n)
            obs, reward, terminated, truncated, info = ours.step(actions)
            ref = theirs.step(actions)
            np.testing.assert_array_equal(obs, ref[0])
            np.testing.assert_array_equal(reward, ref[1])
            np.testing.assert_array_equal(terminated, ref[2])
            np.testing.assert_array_equal(truncated, ref[3])
            assert reward.dtype == np.float64 and terminated.dtype == truncated.dtype == bool
            assert info["lives"].dtype == np.int64
            np.testing.assert_array_equal(info["lives"], ref[4]["lives"])
            assert ("final_obs" in info) == ("final_obs" in ref[4])
            if "final_obs" in info:
                finals += 1
                for i in range(n):
                    expected = ref[4]["final_obs"][i] if ref[4]["_final_obs"][i] else 0
                    np.testing.assert_array_equal(info["final_obs"][i], expected)
        assert finals > 0 or not same_step_reset  # games ended within the test
        assert (truncated | terminated).any() or steps > 12
    finally:
        ours.close()
        theirs.close()


def test_env_i_plays_seed_plus_i_and_a_reset_repeats_the_game() -> None:
    spec = short_catch(40)
    venv = PoolVectorEnv(spec, 2, workers=2)
    single = GameBoyEnv(spec)
    try:
        first, _ = venv.reset(seed=5)
        expected, _ = single.reset(seed=6)
        np.testing.assert_array_equal(first[1], expected)
        actions = np.array([1, 2])
        played = [venv.step(actions)[0] for _ in range(10)]
        again, _ = venv.reset(seed=5)
        np.testing.assert_array_equal(again, first)
        replay = [venv.step(actions)[0] for _ in range(10)]
        np.testing.assert_array_equal(np.stack(played), np.stack(replay))
    finally:
        venv.close()
        single.close()


@pytest.mark.parametrize(("same_step_reset", "workers"), [(True, 2), (False, 0)])
def test_labels_are_the_scripts_actions_on_each_returned_observation(
        same_step_reset: bool, workers: int) -> None:
    """Replayed env by env, a scripted player reading each single env's RAM gives the
    labels the vector env returned beside every observation, across episode ends."""
    from oakemu_rl.agents.scripted_catch import CatchDemonstrator

    spec, n, steps = short_catch(), 2, 30
    venv = PoolVectorEnv(spec, n, same_step_reset=same_step_reset,
                            processes=workers > 0, workers=workers or None,
                            labeller="planner")
    singles = [GameBoyEnv(spec) for _ in range(n)]
    script = CatchDemonstrator(spec)
    try:
        _, info = venv.reset(seed=3)
        expected = [script.decide(single.memory) for single, _ in
                    ((s, s.reset(seed=3 + i)) for i, s in enumerate(singles))]
        np.testing.assert_array_equal(info["labels"], expected)
        rng = np.random.default_rng(1)
        ended = np.zeros(n, dtype=bool)
        seen = set()
        for _ in range(steps):
            actions = rng.integers(0, 3, n)
            _, _, terminated, truncated, info = venv.step(actions)
            for i, single in enumerate(singles):
                if not same_step_reset and ended[i]:
                    single.reset()
                else:
                    _, _, term, trunc, _ = single.step(actions[i])
                    if same_step_reset and (term or trunc):
                        single.reset()
                expected[i] = script.decide(single.memory)
            ended = terminated | truncated
            np.testing.assert_array_equal(info["labels"], expected)
            seen.update(int(label) for label in info["labels"])
        assert len(seen) >= 2  # the labels follow the ball, not one constant
    finally:
        venv.close()
        for single in singles:
            single.close()


def test_labels_need_a_scripted_style() -> None:
    with pytest.raises(EnvError, match="no style 'dreamer'"):
        PoolVectorEnv(short_catch(), 2, workers=2, labeller="dreamer")


def test_errors_close_and_dead_workers() -> None:
    venv = PoolVectorEnv(short_catch(), 2, workers=2)
    pids = [p.pid for p in venv.pool.processes]
    venv.reset(seed=0)
    with pytest.raises(EnvError, match="out of range"):
        venv.step(np.array([0, 9]))  # an env's own error comes through with its message
    with pytest.raises(EnvError, match="closed"):
        venv.step(np.array([0, 0]))
    assert not any(p.is_alive() for p in venv.pool.processes)

    venv = PoolVectorEnv(short_catch(), 2, workers=2)
    venv.reset(seed=0)
    os.kill(venv.pool.processes[1].pid, signal.SIGKILL)
    with pytest.raises(EnvError) as caught:
        venv.step(np.array([0, 0]))
    message = str(caught.value)
    assert "\n" not in message and "killed by signal 9" in message and "env 1" in message
    assert not any(p.is_alive() for p in venv.pool.processes)
    venv.close()  # closing again is harmless
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)


SCRIPT = """
import sys, time
from oakemu_rl.envs import EnvSpec
from oakemu_rl.envs.pool import PoolVectorEnv
venv = PoolVectorEnv(EnvSpec(game="catch"), 3, workers=2)
venv.reset(seed=0)
print(*[p.pid for p in venv.pool.processes], flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
def test_a_killed_parent_leaves_no_workers() -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                              env=env, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.05)
        assert not any(Path(f"/proc/{p}").exists() for p in pids)
    finally:
        parent.kill()
        parent.wait()
