"""Playing whole games with an agent and keeping the scores: what the tester, PPO's
evaluation games and the pipeline's final test all do.

`play_games(agent, spec, config)` plays `config.episodes` games on the evaluation spec (raw
game rewards, a lost life does not end the game), episode i seeded with `seed + i`, so the
same agent and games always give the same scores. Every action is checked against the
spec's action mask.

A greedy policy agent (one whose `plays_batches` is true) plays up to `BATCH_GAMES` games
at once, one env each, and chooses all their actions in one forward pass (`act_batch`).
Each game is still its own env and seed; only the forward passes are shared. The gain is
small, as the emulator and the frame processing take much of a greedy step
(benchmarks/greedy_play.py --games; docs/results.md, "Greedy play speed").

With `config.workers` above 1, an agent that can travel to another process (`portable`)
plays its games in that many processes of one thread each, every game still its own env
and seed: the scores are those of one process, and the emulators, which hold one core
each, run side by side (benchmarks/greedy_play.py --workers).
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from ..configs import check_options
from ..envs import EnvSpec, action_mask, action_meanings, make_env
from ..errors import OakEmuError
from ..runtime import SEED_MAX
from .base import Agent


class AgentActionError(OakEmuError, ValueError):
    """An agent returned an action that is not a valid, allowed action index."""


@dataclass(frozen=True)
class EvalConfig:
    """Which games to play. (Not `TestConfig`: pytest would try to collect that name.)"""

    episodes: int = 10
    """Games to play (at least 10 tell two policies' means apart better than by luck)."""
    seed: int = 0
    """Episode i is played with seed `seed + i` (no-op starts and sticky actions)."""
    max_steps: int | None = None
    """Agent steps after which an episode is cut; None plays until the emulator ends it."""
    workers: int = 1
    """Processes that play the games, one thread each (1: this process plays them); the
    scores do not depend on it."""

    def __post_init__(self) -> None:
        check_options(self, self.checks(), stage="test")

    def checks(self) -> list[tuple[str, bool, str]]:
        return [("episodes", self.episodes >= 1, "≥ 1"),
                ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
                ("max_steps", self.max_steps is None or self.max_steps >= 1, "≥ 1"),
                ("workers", self.workers >= 1, "≥ 1")]

    @property
    def seeds(self) -> range:
        """The episodes' seeds: `seed` to `seed + episodes - 1`."""
        return range(self.seed, self.seed + self.episodes)


def _stat(values: list[float], fn: Any) -> float:
    return float(fn(np.asarray(values, dtype=np.float64))) if values else math.nan


@dataclass
class EvalResult:
    """Scores (sum of raw game rewards) and lengths (agent steps) of the episodes played.

    The statistics are over episodes; `std` is the population standard deviation (ddof=0)
    and `sem` the standard error of the mean (sample std, ddof=1, over √episodes). They are
    NaN for a result with no episodes (`sem` for one with fewer than two).
    """

    scores: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.lengths):
            raise ValueError(
                f"{len(self.scores)} scores but {len(self.lengths)} lengths; they must match"
            )

    @property
    def episodes(self) -> int:
        return len(self.scores)

    @property
    def mean(self) -> float:
        return _stat(self.scores, np.mean)

    @property
    def std(self) -> float:
        return _stat(self.scores, np.std)

    @property
    def sem(self) -> float:
        """Standard error of the mean score: std (ddof=1) / √n; NaN for n < 2."""
        if len(self.scores) < 2:
            return math.nan
        return float(np.std(np.asarray(self.scores, dtype=np.float64), ddof=1)
                     / math.sqrt(len(self.scores)))

    @property
    def min(self) -> float:
        return _stat(self.scores, np.min)

    def summary(self) -> str:
        """The mean with its standard error and number of games, e.g. `-3.20 ± 1.10 (10
        games)`: how every score is quoted."""
        return score_text(self.mean, self.sem, self.episodes)

    @property
    def max(self) -> float:
        return _stat(self.scores, np.max)

    @property
    def mean_length(self) -> float:
        return _stat(self.lengths, np.mean)

    @property
    def std_length(self) -> float:
        return _stat(self.lengths, np.std)

    @property
    def min_length(self) -> float:
        return _stat(self.lengths, np.min)

    @property
    def max_length(self) -> float:
        return _stat(self.lengths, np.max)

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready): the per-episode lists and their statistics."""
        return {
            "episodes": self.episodes,
            "scores": [float(s) for s in self.scores],
            "lengths": [int(n) for n in self.lengths],
            "mean": self.mean,
            "std": self.std,
            "sem": self.sem,
            "min": self.min,
            "max": self.max,
            "mean_length": self.mean_length,
            "std_length": self.std_length,
            "min_length": self.min_length,
            "max_length": self.max_length,
        }


def score_text(mean: float, sem: float | None, episodes: int) -> str:
    """A mean score as it is quoted everywhere: `mean ± SE (n games)`; with one game (or a
    record that kept no SE) the error is said to be missing rather than left out."""
    games = f"{episodes} game{'s' if episodes != 1 else ''}"
    if sem is None or math.isnan(sem):
        return f"{mean:+.2f} ({games}, no SE)"
    return f"{mean:+.2f} ± {sem:.2f} ({games})"


def checked_action(raw: Any, mask: np.ndarray, meanings: tuple[str, ...], agent: Any) -> int:
    kind = getattr(agent, "kind", type(agent).__name__)
    try:
        action = operator.index(raw)
    except TypeError:
        raise AgentActionError(
            f"the {kind} agent returned {raw!r}, which is not an action index"
        ) from None
    if not 0 <= action < len(mask):
        raise AgentActionError(
            f"the {kind} agent returned action {action}, but the game has actions "
            f"0..{len(mask) - 1}"
        )
    if not mask[action]:
        allowed = [m for m, ok in zip(meanings, mask, strict=True) if ok]
        raise AgentActionError(
            f"the {kind} agent chose the forbidden action {meanings[action]} ({action}); "
            f"the action mask allows only {', '.join(allowed)}"
        )
    return action


BATCH_GAMES = 8
"""Games a greedy policy agent plays at once (`play_games`)."""


def play_games(agent: Agent, spec: EnvSpec, config: EvalConfig | None = None, *,
               progress: bool = True,
               watch: Callable[[int, Any], None] | None = None) -> EvalResult:
    """Play `config.episodes` games with `agent` and return their scores and lengths, in
    the order of their seeds.

    The games use `spec.for_evaluation()`: raw rewards, whole games. An action the spec's
    mask forbids (or that is out of range) raises `AgentActionError`. `watch(episode, env)`,
    when given, is called after every reset and step (the tester films with it), and the
    games are then played one at a time in this process.
    """
    config = config or EvalConfig()
    spec = spec.for_evaluation()
    action_mask(spec)  # a bad mask is refused here, before any process starts
    scores: list[float] = [0.0] * config.episodes
    lengths: list[int] = [0] * config.episodes
    bar = tqdm(total=config.episodes, unit="episode", disable=not progress,
               desc=f"evaluating {spec.game}")

    def finished(episode: int, score: float, length: int) -> None:
        scores[episode], lengths[episode] = score, length
        bar.set_postfix(score=f"{score:+.0f}", steps=length)
        bar.update(1)

    workers = min(config.workers, config.episodes)
    try:
        if watch is None and workers > 1 and getattr(agent, "portable", False):
            _play_in_processes(agent, spec, config, workers, finished)
        else:
            _play_here(agent, spec, config, range(config.episodes), finished, watch)
    finally:
        bar.close()
    return EvalResult(scores=scores, lengths=lengths)


Finished = Callable[[int, float, int], None]
"""Told of each game as it ends: (episode, score, length)."""


def _play_here(agent: Any, spec: EnvSpec, config: EvalConfig, episodes: Sequence[int],
               finished: Finished, watch: Callable[[int, Any], None] | None = None) -> None:
    """Play `episodes` (indices into the config's seeds) in this process: together when
    the agent plays batches and nobody watches, else one after another."""
    mask = action_mask(spec)
    meanings = action_meanings(spec)
    if watch is None and len(episodes) > 1 and getattr(agent, "plays_batches", False):
        _play_together(agent, spec, config, episodes, mask, meanings, finished)
    else:
        _play_in_turn(agent, spec, config, episodes, mask, meanings, finished, watch)


def _play_together(agent: Any, spec: EnvSpec, config: EvalConfig, episodes: Sequence[int],
                   mask: np.ndarray, meanings: tuple[str, ...], finished: Finished) -> None:
    """The games `BATCH_GAMES` at a time, one env each, their actions chosen in one batch;
    a finished game's env starts the next game."""
    envs = [make_env(spec, render_mode="rgb_array")
            for _ in range(min(BATCH_GAMES, len(episodes)))]
    playing: dict[int, int] = {}  # env index -> episode
    observations: dict[int, np.ndarray] = {}
    scores: dict[int, float] = {}
    lengths: dict[int, int] = {}
    waiting = iter(episodes)

    def start(slot: int) -> None:
        episode = next(waiting, None)
        if episode is None:
            playing.pop(slot, None)
            return
        playing[slot] = episode
        scores[episode], lengths[episode] = 0.0, 0
        observations[slot], _ = envs[slot].reset(seed=config.seed + episode)
        agent.reset(envs[slot], config.seed + episode)

    try:
        for slot in range(len(envs)):
            start(slot)
        while playing:
            slots = sorted(playing)
            actions = agent.act_batch(np.stack([observations[slot] for slot in slots]))
            for slot, raw in zip(slots, actions, strict=True):
                episode = playing[slot]
                action = checked_action(raw, mask, meanings, agent)
                observations[slot], reward, terminated, truncated, _ = envs[slot].step(action)
                scores[episode] += float(reward)
                lengths[episode] += 1
                if terminated or truncated or lengths[episode] == config.max_steps:
                    finished(episode, scores[episode], lengths[episode])
                    start(slot)
    finally:
        for env in envs:
            env.close()


def _play_in_turn(agent: Agent, spec: EnvSpec, config: EvalConfig, episodes: Sequence[int],
                  mask: np.ndarray, meanings: tuple[str, ...], finished: Finished,
                  watch: Callable[[int, Any], None] | None) -> None:
    """The games one after another in one env."""
    env = make_env(spec, render_mode="rgb_array")
    try:
        for episode in episodes:
            seed = config.seed + episode
            observation, _ = env.reset(seed=seed)
            agent.reset(env, seed)
            if watch is not None:
                watch(episode, env)
            score, steps = 0.0, 0
            while config.max_steps is None or steps < config.max_steps:
                action = checked_action(agent.act(env, observation), mask, meanings, agent)
                observation, reward, terminated, truncated, _ = env.step(action)
                score += float(reward)
                steps += 1
                if watch is not None:
                    watch(episode, env)
                if terminated or truncated:
                    break
            finished(episode, score, steps)
    finally:
        env.close()


# -- games in several processes -------------------------------------------------------------


class GamesProcessError(OakEmuError):
    """A process playing games ended without finishing them (killed, out of memory)."""


def _play_in_processes(agent: Any, spec: EnvSpec, config: EvalConfig, workers: int,
                       finished: Finished) -> None:
    """Deal the games round-robin to `workers` processes (`run_in_processes`), each playing
    its share with a copy of `agent` on one thread."""
    run_in_processes(f"{__name__}:_play_here", (agent, spec, config),
                     [range(worker, config.episodes, workers) for worker in range(workers)],
                     finished)


def run_in_processes(target: str, args: tuple[Any, ...], shares: Sequence[range],
                     heard: Callable[..., None]) -> None:
    """Run `target(*args, share, report)` ("module:function") in one new Python process
    (`games_worker`) per share, each on one thread, and call `heard(*message)` here for
    each `report(*message)` made there, as it comes. An error in a process is raised here
    as it was raised there. The processes end with the call, however it ends; each also
    ends at once when this process is gone (its stdin, which this process holds open,
    reaches end of file).

    New interpreters rather than forks: a forked copy of a process whose torch or
    onnxruntime threads are running can hang, and unlike multiprocessing's spawn they do
    not re-run the caller's main script."""
    blob = pickle.dumps(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    messages: queue.Queue = queue.Queue()
    processes: list[subprocess.Popen] = []
    try:
        for _ in shares:  # all start before any job is written: imports overlap
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "oakemu_rl.agents.games_worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
        for worker, (process, share) in enumerate(zip(processes, shares, strict=True)):
            job = pickle.dumps((sys.path, target, blob, share))
            threading.Thread(target=_relay, args=(worker, process, job, messages),
                             daemon=True).start()
        done = 0
        while done < len(processes):
            kind, worker, *rest = messages.get()
            if kind == "game":
                heard(*rest)
            elif kind == "error":
                raise rest[0]
            elif kind == "end":
                done += 1
                if not rest[0]:  # the output ended before the process said it was done
                    process = processes[worker]
                    if process.poll() is None:
                        process.kill()
                    raise GamesProcessError(
                        f"a process playing games ended before finishing them (exit code "
                        f"{process.wait()}: killed, or out of memory?); no scores were kept")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


def _relay(worker: int, process: subprocess.Popen, job: bytes, messages: queue.Queue) -> None:
    """Give one process its job, then pass its messages on, then ("end", worker, whether it
    said "done")."""
    said_done = False
    try:
        process.stdin.write(job)
        process.stdin.flush()  # the pipe stays open: its end tells the process to stop
        while not said_done:
            message = pickle.load(process.stdout)
            said_done = message[0] == "done"
            if not said_done:
                messages.put(message)
    except Exception:  # a closed pipe, end of file or a cut-off message: the process is gone
        pass
    messages.put(("end", worker, said_done))
