"""Recording: play episodes with an agent (a person, a script, a policy) into a demo file,
for `oakemu record` and for the bc stage's relabelling rounds.

Each finished episode is committed to the file before the next one starts, so stopping
(Ctrl-C, closing the window, a kill) never costs more than the episode in progress.

With a `driver` (`oakemu record --relabel CHECKPOINT`), the driver's actions play and the
agent only labels: every frame is stored with the action the agent would have taken there.
Cloning a policy on its own states labelled this way (one DAgger round) corrects the
mistakes a clone makes once it drifts from the states the demonstrator visits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..demos.writer import DemoWriter, EpisodeBuffer
from ..envs import EnvSpec, action_mask, make_env
from .base import Agent, DiscardEpisode, NoisyAgent, StopRecording
from .play import checked_action
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
    `driver`, the driver plays and `agent`'s choices are stored as the actions."""
    if config.episodes < 1:
        raise ValueError("episodes must be at least 1")
    spec = config.spec.for_evaluation()
    writer = DemoWriter(config.out, spec)
    mask = writer.action_mask
    result = RecordResult(path=Path(config.out))
    env = make_env(spec, render_mode="rgb_array")
    bar = tqdm(total=config.episodes, unit="episode", disable=not config.progress,
               desc=f"recording {spec.game}")
    observe = getattr(agent, "observe", None)
    taken = getattr(agent, "was_taken", None)
    kind = agent.kind if driver is None else RELABELLED
    try:
        episode = 0
        while episode < config.episodes:
            seed = config.seed + episode
            buffer = EpisodeBuffer()
            observation, _ = env.reset(seed=seed)
            agent.reset(env, seed)
            if driver is not None:
                driver.reset(env, seed)
            try:
                while True:
                    action = label = checked_action(agent.act(env, observation), mask,
                                                    writer.action_meanings, agent)
                    if driver is not None:
                        action = checked_action(driver.act(env, observation), mask,
                                                writer.action_meanings, driver)
                    if driver is not None and taken is not None:
                        taken(action)
                    next_observation, reward, terminated, truncated, info = env.step(action)
                    if config.max_steps is not None and len(buffer) + 1 >= config.max_steps:
                        truncated = True
                    buffer.add(observation[-1], label, float(reward), terminated, truncated)
                    if observe is not None:
                        observe(float(reward), bool(terminated), bool(truncated), info)
                    observation = next_observation
                    if terminated or truncated:
                        break
            except DiscardEpisode:
                result.discarded += 1
                continue
            except StopRecording:
                result.stopped = True
                break
            index = writer.write_episode(buffer, recorder=kind, seed=seed)
            result.episodes.append(
                {"index": index, "seed": seed, "return": buffer.episode_return,
                 "length": len(buffer)}
            )
            episode += 1
            bar.set_postfix(ret=f"{buffer.episode_return:+.0f}", steps=len(buffer))
            bar.update(1)
    finally:
        bar.close()
        env.close()
    return result


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
