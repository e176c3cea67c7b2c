"""Single envs stepped together in a few worker processes over shared memory.

The Game Boy's emulator is single-threaded, so several of them need several processes;
Atari trains on ale-py's own C++ vector env, except where a scripted player must read
each emulator's RAM beside it (labelled rollouts), which that vector env does not expose.
`PoolVectorEnv` steps any backend's single envs (`backends.make_env`) this way.

Each worker process owns a contiguous slice of the envs and steps them one after another;
the observations, rewards, episode ends, lives and final observations go straight into one
anonymous shared mapping (made before the workers fork), and the pipes carry only a
byte per command and a byte per reply. Nothing is pickled on a step.

With as many workers as cores (the default), a 2-core machine runs two processes however
many envs there are, instead of one per env fighting over the cores.

`workers=0` steps the same slices in this process (no pipes, no processes): the
reference the worker path is tested against, and the fastest choice for one env.

With a `labeller` (a scripted player's style), every env also gets a scripted player that
labels each observation the env returns with the action the script would take there,
read from the emulator's RAM in the worker that steps it, and told which action the agent
took instead: PPO's BC loss can then cover the states the agent itself reaches
(`PPOConfig.label_rollouts`).

A worker that dies (killed, out of memory) makes the next call raise a one-line
`EnvError`. Workers are daemons, ignore SIGINT (the parent closes them), and exit as soon
as their pipe reaches end of file, so a parent killed by any signal leaves none behind.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import multiprocessing as mp
import pickle
import signal
import struct
import weakref
from multiprocessing.connection import Connection
from typing import Any

import gymnasium as gym
import numpy as np

from ..errors import EnvError
from ..runtime import usable_cpus
from .backends import action_meanings, make_env, played_action
from .spec import EnvSpec

_STEP, _RESET, _CLOSE = b"s", b"r", b"c"
_OK, _FAILED = b"k", b"e"
_NO_SEED = -1  # reset's seed field when no seed is given (seeds are never negative)

_POOLS: weakref.WeakSet = weakref.WeakSet()
"""Pools with workers in this process: a newly forked worker closes their parent ends, so
that only this process holds them and the workers see end of file when it dies."""


def default_workers(num_envs: int) -> int:
    """One worker per usable core, never more than envs."""
    return max(1, min(num_envs, usable_cpus()))


class _Buffers:
    """The arrays every process sees: one anonymous shared mapping, cut into arrays."""

    def __init__(self, num_envs: int, obs_shape: tuple[int, ...]) -> None:
        fields = [("obs", np.uint8, (num_envs, *obs_shape)),
                  ("final_obs", np.uint8, (num_envs, *obs_shape)),
                  ("actions", np.int64, (num_envs,)),
                  ("labels", np.int64, (num_envs,)),
                  ("rewards", np.float64, (num_envs,)),
                  ("lives", np.int64, (num_envs,)),
                  ("terminated", np.bool_, (num_envs,)),
                  ("truncated", np.bool_, (num_envs,)),
                  ("finished", np.bool_, (num_envs,))]
        offsets, size = [], 0
        for _, dtype, shape in fields:
            offsets.append(size)
            size += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 64) * 64
        self.memory = mmap.mmap(-1, max(size, 1))  # MAP_SHARED | MAP_ANONYMOUS
        for (name, dtype, shape), offset in zip(fields, offsets, strict=True):
            setattr(self, name, np.ndarray(shape, dtype, self.memory, offset))
    obs: np.ndarray
    final_obs: np.ndarray
    actions: np.ndarray
    labels: np.ndarray
    rewards: np.ndarray
    lives: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    finished: np.ndarray


class _Slice:
    """Envs `start`..`stop - 1` of the vector env, with gymnasium's autoreset semantics:
    next-step (a finished env resets on the following step, which returns the first
    observation with reward 0) or same-step (it resets at once; its last observation goes
    to `final_obs`)."""

    def __init__(self, spec: EnvSpec, start: int, stop: int, buffers: _Buffers,
                 same_step_reset: bool, labeller: str | None = None) -> None:
        self.start = start
        self.same_step_reset = same_step_reset
        self.buffers = buffers
        self.num_envs = len(buffers.obs)
        # The seed each env's scripted player starts its game with: env i's first game is
        # seed + i, as the env's, and each later one num_envs further on, so no two games
        # of a run share one.
        self.game_seeds = list(range(start, stop))
        self.envs: list[Any] = []
        self.labellers: list[Any] = []
        try:
            for _ in range(start, stop):
                self.envs.append(make_env(spec))
            if labeller is not None:
                from ..agents.scripted import make_demonstrator

                self.labellers = [make_demonstrator(spec, style=labeller)
                                  for _ in range(start, stop)]
        except BaseException:
            self.close()
            raise
        self.autoreset = np.zeros(stop - start, dtype=bool)

    def _taken(self, j: int, action: int) -> None:
        """Tell env j's scripted player which action this step plays (the agent's, or FIRE
        where the env serves): a player that remembers its own keys (the human style)
        must remember these, as relabelling tells it (`recording.play_episode`)."""
        if self.labellers:
            taken = getattr(self.labellers[j], "was_taken", None)
            if taken is not None:
                taken(played_action(self.envs[j], action))

    def _label(self, j: int, obs: np.ndarray, new_game: bool) -> None:
        """The scripted player's action for env j's observation `obs` (a new game's first
        one when `new_game`), into `labels`."""
        if self.labellers:
            labeller, env = self.labellers[j], self.envs[j]
            if new_game:
                labeller.reset(env, self.game_seeds[j])
            self.buffers.labels[self.start + j] = labeller.act(env, obs)

    def _new_game(self, j: int, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Start env j's next game (on `seed` where given) and its scripted player's seed."""
        self.game_seeds[j] = self.game_seeds[j] + self.num_envs if seed is None else seed
        return self.envs[j].reset(seed=seed)

    def reset(self, seed: int | None) -> None:
        b = self.buffers
        for j in range(len(self.envs)):
            i = self.start + j
            obs, info = self._new_game(j, None if seed is None else seed + i)
            b.obs[i] = obs
            b.lives[i] = info.get("lives", 0)
            self._label(j, obs, True)
        self.autoreset[:] = False

    def step(self) -> None:
        b = self.buffers
        for j, env in enumerate(self.envs):
            i = self.start + j
            finished = new_game = False
            if not self.same_step_reset and self.autoreset[j]:
                obs, info = self._new_game(j)
                reward, terminated, truncated = 0.0, False, False
                new_game = True
            else:
                self._taken(j, int(b.actions[i]))
                obs, reward, terminated, truncated, info = env.step(b.actions[i])
                if self.same_step_reset and (terminated or truncated):
                    b.final_obs[i] = obs
                    finished = new_game = True
                    obs, info = self._new_game(j)
            self._label(j, obs, new_game)
            b.obs[i] = obs
            b.rewards[i] = reward
            b.terminated[i] = terminated
            b.truncated[i] = truncated
            b.finished[i] = finished
            b.lives[i] = info.get("lives", 0)
            self.autoreset[j] = terminated or truncated

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []


def _worker(conn: Connection, spec: EnvSpec, start: int, stop: int, buffers: _Buffers,
            same_step_reset: bool, labeller: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which closes us
    for pool in list(_POOLS):  # this pool's earlier workers' ends too
        pool._close_parent_ends()
    try:
        import cv2

        cv2.setNumThreads(1)  # one core per worker: no helper threads on the resize
    except ImportError:
        pass
    envs = None
    try:
        envs = _Slice(spec, start, stop, buffers, same_step_reset, labeller)
        conn.send_bytes(_OK)
        while True:
            command = conn.recv_bytes()
            if command == _STEP:
                envs.step()
            elif command[:1] == _RESET:
                seed = struct.unpack("<q", command[1:])[0]
                envs.reset(None if seed == _NO_SEED else seed)
            else:
                break
            conn.send_bytes(_OK)
    except (EOFError, BrokenPipeError, OSError):
        pass  # the parent is gone or closed us: stop quietly
    except BaseException as error:  # hand any error to the parent, which raises it
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send_bytes(_FAILED + _pickle_error(error))
    finally:
        if envs is not None:
            envs.close()
        conn.close()


def _pickle_error(error: BaseException) -> bytes:
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(EnvError(f"{type(error).__name__}: {error}"))


class EnvPool:
    """`num_envs` single envs of `spec` in `workers` processes (0: in this process), stepped
    together; `step` and `reset` fill `buffers` (with `labeller`, `buffers.labels` too) and
    return nothing."""

    def __init__(self, spec: EnvSpec, num_envs: int, obs_shape: tuple[int, ...], *,
                 same_step_reset: bool, workers: int, labeller: str | None = None) -> None:
        if num_envs < 1:
            raise EnvError(f"the number of envs must be at least 1, got {num_envs}")
        if not 0 <= workers <= num_envs:
            raise EnvError(f"the number of worker processes must be 0..{num_envs} for "
                           f"{num_envs} envs, got {workers}")
        self.num_envs = num_envs
        self.buffers = _Buffers(num_envs, obs_shape)
        self.conns: list[Connection] = []
        self.processes: list[Any] = []
        self.slices: list[tuple[int, int]] = []
        self.local: _Slice | None = None
        self.closed = False
        self.failure: str | None = None
        if workers == 0:
            self.local = _Slice(spec, 0, num_envs, self.buffers, same_step_reset, labeller)
            return
        bounds = np.linspace(0, num_envs, workers + 1).round().astype(int)
        context = mp.get_context("fork")
        _POOLS.add(self)
        try:
            for start, stop in itertools.pairwise(bounds):
                parent, child = context.Pipe()
                self.conns.append(parent)  # before the fork: the worker closes it
                process = context.Process(
                    target=_worker, name=f"oakemu-env-{start}-{stop - 1}", daemon=True,
                    args=(child, spec, int(start), int(stop), self.buffers, same_step_reset,
                          labeller))
                process.start()
                child.close()  # only the worker holds it now: its death is end of file here
                self.processes.append(process)
                self.slices.append((int(start), int(stop)))
            self._gather()
        except BaseException:
            self.close()
            raise

    # -- commands ----------------------------------------------------------------------

    def _describe(self, k: int) -> str:
        start, stop = self.slices[k]
        envs = f"env {start}" if stop - start == 1 else f"envs {start}-{stop - 1}"
        return f"env worker process {self.processes[k].pid} ({envs})"

    def _died(self, k: int) -> EnvError:
        process = self.processes[k]
        process.join(timeout=1.0)
        code = process.exitcode
        how = ("is still running but closed its pipe" if code is None else
               f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        self.failure = f"{self._describe(k)} {how}"
        self.close()
        return EnvError(f"{self.failure}; the vector env is closed")

    def _gather(self) -> None:
        """Waits for every worker's reply; raises the first failure after closing."""
        error: BaseException | None = None
        for k, conn in enumerate(self.conns):
            try:
                reply = conn.recv_bytes()
            except (EOFError, OSError):
                raise self._died(k) from None
            if reply[:1] == _FAILED and error is None:
                error = pickle.loads(reply[1:])
        if error is not None:
            self.failure = f"an env raised {type(error).__name__}: {error}"
            self.close()
            raise error

    def _send(self, command: bytes) -> None:
        if self.closed:
            raise EnvError("the vector env is closed"
                           + (f" ({self.failure})" if self.failure else ""))
        for k, conn in enumerate(self.conns):
            try:
                conn.send_bytes(command)
            except (BrokenPipeError, OSError):
                raise self._died(k) from None

    def reset(self, seed: int | None) -> None:
        if self.local is not None:
            self._check_open()
            self.local.reset(seed)
            return
        self._send(_RESET + struct.pack("<q", _NO_SEED if seed is None else seed))
        self._gather()

    def step(self) -> None:
        if self.local is not None:
            self._check_open()
            self.local.step()
            return
        self._send(_STEP)
        self._gather()

    def _check_open(self) -> None:
        if self.closed:
            raise EnvError("the vector env is closed")

    # -- closing -----------------------------------------------------------------------

    def _close_parent_ends(self) -> None:
        for conn in self.conns:
            conn.close()

    def close(self, timeout: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        if self.local is not None:
            self.local.close()
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(_CLOSE)
        for process in self.processes:
            process.join(timeout=timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout=1.0)
        self._close_parent_ends()
        _POOLS.discard(self)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close(timeout=1.0)


class PoolVectorEnv:
    """`num_envs` single envs of `spec` stepped together, with the C++ Atari vector env's
    interface: arrays in, arrays out, `info["lives"]`, and with `same_step_reset` the next
    episode's first observation at once and the last one in `info["final_obs"]`.

    Several envs run in `workers` worker processes (default: one per core), each stepping
    its share of the envs, over shared memory (`EnvPool`); one env, or
    `processes=False`, runs in this process. A worker that dies raises `EnvError`.

    With `labeller` (a scripted player's style), `info["labels"]` holds, for every env, the
    action that player would take on the observation returned beside it.
    """

    def __init__(self, spec: EnvSpec, num_envs: int, *, same_step_reset: bool = False,
                 processes: bool | None = None, workers: int | None = None,
                 labeller: str | None = None) -> None:
        if num_envs < 1:
            raise EnvError(f"the number of envs must be at least 1, got {num_envs}")
        if labeller is not None:  # a game or style without a script: refused before any fork
            from ..agents.scripted import make_demonstrator

            make_demonstrator(spec, style=labeller)
        if processes is None:
            processes = num_envs > 1
        if not processes:
            workers = 0
        elif workers is None:
            workers = default_workers(num_envs)
        self.num_envs = num_envs
        self.same_step_reset = same_step_reset
        self.single_action_space = gym.spaces.Discrete(len(action_meanings(spec)))
        self.single_observation_space = gym.spaces.Box(0, 255, spec.observation_shape,
                                                       np.uint8)
        self.labelled = labeller is not None
        self.pool = EnvPool(spec, num_envs, spec.observation_shape,
                            same_step_reset=same_step_reset, workers=workers,
                            labeller=labeller)
        self._buffers = self.pool.buffers

    def _info(self) -> dict[str, Any]:
        b = self._buffers
        out: dict[str, Any] = {"lives": b.lives.copy()}
        if self.labelled:
            out["labels"] = b.labels.copy()
        if self.same_step_reset and b.finished.any():
            finals = np.zeros_like(b.obs)
            ids = np.flatnonzero(b.finished)
            finals[ids] = b.final_obs[ids]
            out["final_obs"] = finals  # lives stay the new games' (as on Atari)
        return out

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            seed = int(seed)
            if seed < 0:
                raise EnvError(f"the seed must not be negative, got {seed}")
        self.pool.reset(seed)
        self._buffers.finished[:] = False
        return self._buffers.obs.copy(), self._info()

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                 np.ndarray, dict[str, Any]]:
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,):
            raise EnvError(f"step needs one action per env ({self.num_envs}), got an array "
                           f"of shape {actions.shape}")
        self._buffers.actions[:] = actions
        self.pool.step()
        b = self._buffers
        return (b.obs.copy(), b.rewards.copy(), b.terminated.copy(), b.truncated.copy(),
                self._info())

    def close(self) -> None:
        self.pool.close()
