"""Recording: play episodes with an agent (a person, a script, a policy) into a demo file,
for `oakemu record` and for the bc stage's relabelling rounds.

Each finished episode is committed to the file before the next one starts, so stopping
(Ctrl-C, closing the window, a kill) never costs more than the episode in progress. With
`RecordConfig.workers` the games play in that many processes and reach the file in seed
order, each once every game before it has: the file is the one a single process writes.

With a `driver` (`oakemu record --relabel CHECKPOINT`), the driver's actions play and the
agent only labels: every frame is stored with the action the agent would have taken there.
Cloning a policy on its own states labelled this way (one DAgger round) corrects the
mistakes a clone makes once it drifts from the states the demonstrator visits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..demos.writer import DemoWriter, EpisodeBuffer
from ..envs import EnvSpec, action_mask, action_meanings, make_env
from ..envs.backends import played_action
from .base import Agent, DiscardEpisode, NoisyAgent, StopRecording
from .play import checked_action, run_in_processes
from .policy import load_policy_agent
from .scripted import make_demonstrator


@dataclass(frozen=True)
class RecordConfig:
    """What `oakemu record` does."""

    out: Path
    """Demo file to create or append to."""
    spec: EnvSpec = field(default_factory=EnvSpec)
    """Game and preprocessing; training-only switches are turned off for demos."""
    episodes: int = 1
    """Episodes to commit."""
    seed: int = 0
    """Episode i is played with seed `seed + i`."""
    max_steps: int | None = None
    """Agent steps after which an episode is cut (marked truncated) and committed."""
    progress: bool = True
    """Show a tqdm bar (the keyboard recorder shows its own window instead)."""
    workers: int = 1
    """Processes that play the games side by side, one thread each, when the agents can
    travel to another process (scripted players, policies on the CPU); the file is the
    same as with one."""


@dataclass
class RecordResult:
    path: Path
    episodes: list[dict[str, Any]] = field(default_factory=list)
    discarded: int = 0
    stopped: bool = False


RELABELLED = "relabelled"
"""Recorder kind of episodes a driver played and an agent labelled."""


def record(config: RecordConfig, agent: Agent, driver: Agent | None = None) -> RecordResult:
    """Play `config.episodes` episodes with `agent` and commit each to `config.out`; with a
    `driver`, the driver plays and `agent`'s choices are stored as the actions. With
    `config.workers` above 1 and agents that can travel to another process, the games play
    in that many processes (`_record_in_processes`); the file is the same."""
    if config.episodes < 1:
        raise ValueError("episodes must be at least 1")
    spec = config.spec.for_evaluation()
    writer = DemoWriter(config.out, spec)
    result = RecordResult(path=Path(config.out))
    bar = tqdm(total=config.episodes, unit="episode", disable=not config.progress,
               desc=f"recording {spec.game}")
    kind = agent.kind if driver is None else RELABELLED

    def commit(episodes: list[tuple[int, EpisodeBuffer]]) -> None:
        """Commit finished episodes (game number, steps), in game order, in one write."""
        indices = writer.write_episodes([(buffer, kind, config.seed + game)
                                         for game, buffer in episodes])
        for index, (game, buffer) in zip(indices, episodes, strict=True):
            result.episodes.append({"index": index, "seed": config.seed + game,
                                    "return": buffer.episode_return, "length": len(buffer)})
            bar.set_postfix(ret=f"{buffer.episode_return:+.0f}", steps=len(buffer))
            bar.update(1)

    workers = min(config.workers, config.episodes)
    try:
        if workers > 1 and all(getattr(a, "portable", False)
                               for a in (agent, driver) if a is not None):
            _record_in_processes(config, spec, agent, driver, workers, commit)
        else:
            _record_here(config, spec, agent, driver, writer, result, commit)
    finally:
        bar.close()
    return result


def _record_here(config: RecordConfig, spec: EnvSpec, agent: Agent, driver: Agent | None,
                 writer: DemoWriter, result: RecordResult,
                 commit: Callable[[list[tuple[int, EpisodeBuffer]]], None]) -> None:
    """The games one after another in this process, each committed as it ends. A discarded
    game is played again on the same seed; a stop ends the recording."""
    env = make_env(spec, render_mode="rgb_array")
    try:
        game = 0
        while game < config.episodes:
            try:
                buffer = play_episode(env, agent, driver, writer.action_mask,
                                      writer.action_meanings, config.seed + game,
                                      config.max_steps)
            except DiscardEpisode:
                result.discarded += 1
                continue
            except StopRecording:
                result.stopped = True
                break
            commit([(game, buffer)])
            game += 1
    finally:
        env.close()


def play_episode(env: Any, agent: Agent, driver: Agent | None, mask: np.ndarray,
                 meanings: Sequence[str], seed: int, max_steps: int | None) -> EpisodeBuffer:
    """One game on `seed`: `agent` plays, or labels while `driver` plays; returns its steps,
    each with the label. Raises `DiscardEpisode` or `StopRecording` when the agent does."""
    observe = getattr(agent, "observe", None)
    taken = getattr(agent, "was_taken", None)
    buffer = EpisodeBuffer()
    observation, _ = env.reset(seed=seed)
    agent.reset(env, seed)
    if driver is not None:
        driver.reset(env, seed)
    while True:
        action = label = checked_action(agent.act(env, observation), mask, meanings, agent)
        if driver is not None:
            action = checked_action(driver.act(env, observation), mask, meanings, driver)
            if taken is not None:
                taken(played_action(env, action))
        next_observation, reward, terminated, truncated, info = env.step(action)
        if max_steps is not None and len(buffer) + 1 >= max_steps:
            truncated = True
        buffer.add(observation[-1], label, float(reward), terminated, truncated)
        if observe is not None:
            observe(float(reward), bool(terminated), bool(truncated), info)
        observation = next_observation
        if terminated or truncated:
            return buffer


def _record_in_processes(config: RecordConfig, spec: EnvSpec, agent: Agent,
                         driver: Agent | None, workers: int,
                         commit: Callable[[list[tuple[int, EpisodeBuffer]]], None]) -> None:
    """Deal the games round-robin to `workers` processes (`play.run_in_processes`), each
    playing its share with copies of the agents on one thread and sending each game's
    steps back as it ends. Games are committed here in game order, as soon as every game
    before them has arrived, so the file is the one a single process writes, and a stop
    loses only games that had not yet reached the file."""
    waiting: dict[int, EpisodeBuffer] = {}
    next_game = 0

    def heard(game: int, steps: dict[str, np.ndarray]) -> None:
        nonlocal next_game
        waiting[game] = EpisodeBuffer(
            frames=list(steps["frames"]), actions=steps["actions"].tolist(),
            rewards=steps["rewards"].tolist(), terminations=steps["terminations"].tolist(),
            truncations=steps["truncations"].tolist())
        ready = []
        while next_game in waiting:
            ready.append((next_game, waiting.pop(next_game)))
            next_game += 1
        if ready:
            commit(ready)

    run_in_processes(f"{__name__}:_record_share", (agent, driver, spec, config.seed,
                                                   config.max_steps),
                     [range(w, config.episodes, workers) for w in range(workers)], heard)


def _record_share(agent: Agent, driver: Agent | None, spec: EnvSpec, seed: int,
                  max_steps: int | None, games: Sequence[int],
                  report: Callable[..., None]) -> None:
    """A process's share of `_record_in_processes`: play `games` (numbers from the first
    seed) and report each as (game, its steps as arrays)."""
    mask, meanings = action_mask(spec), action_meanings(spec)
    env = make_env(spec, render_mode="rgb_array")
    try:
        for game in games:
            buffer = play_episode(env, agent, driver, mask, meanings, seed + game, max_steps)
            report(game, {"frames": np.stack(buffer.frames),
                          "actions": np.asarray(buffer.actions, dtype=np.int64),
                          "rewards": np.asarray(buffer.rewards, dtype=np.float64),
                          "terminations": np.asarray(buffer.terminations, dtype=bool),
                          "truncations": np.asarray(buffer.truncations, dtype=bool)})
    finally:
        env.close()


def relabelling_agents(checkpoint: str | Path, *, style: str, seed: int = 0,
                       noise: float = 0.0, device: str = "cpu") -> tuple[Agent, Agent, EnvSpec]:
    """(labeller, driver, spec) for `record(config, labeller, driver)`: the checkpoint's
    greedy policy drives on its own env spec, the scripted player in `style` labels.
    `noise` perturbs what the driver plays (random allowed actions with that chance),
    never the labels: a label is always the demonstrator's own choice."""
    driver, spec = load_policy_agent(checkpoint, device=device)
    if noise > 0:
        driver = NoisyAgent(driver, action_mask(spec), noise, seed=seed)
    return make_demonstrator(spec, seed=seed, style=style), driver, spec


def recording_agents(spec: EnvSpec, *, demonstrator: str, policy: str | Path | None = None,
                     relabel: str | Path | None = None, style: str = "planner",
                     noise: float = 0.0, fps: float | None = None, seed: int = 0,
                     device: str = "auto") -> tuple[Agent, Agent | None, EnvSpec]:
    """(agent, driver, spec) for `oakemu record`: a person at the keyboard, the scripted
    player, a checkpoint's policy (`policy`, on its own spec), or relabelling (`relabel`:
    the checkpoint drives, the scripted player labels)."""
    from ..errors import OakEmuError

    if relabel is not None:
        if demonstrator != "scripted" or policy is not None:
            raise OakEmuError("--relabel needs --demonstrator scripted (the script labels "
                              "the frames the checkpoint's policy plays), without --policy")
        return relabelling_agents(relabel, style=style, seed=seed, noise=noise, device=device)
    if policy is not None:
        agent, policy_spec = load_policy_agent(policy, device=device)
        return agent, None, policy_spec
    if demonstrator == "scripted":
        return make_demonstrator(spec, seed=seed, noise=noise, style=style), None, spec
    from .keyboard import KeyboardAgent, check_display

    check_display()
    return KeyboardAgent(spec, fps=fps), None, spec
