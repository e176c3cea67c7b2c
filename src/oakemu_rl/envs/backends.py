"""One entry to every emulator: actions, masks, single envs and vector envs by backend."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from ..errors import EnvError
from .spec import EnvSpec


def action_meanings(spec: EnvSpec | str, full_action_space: bool = False) -> tuple[str, ...]:
    """The meanings of a game's actions in action-index order: of a spec (any backend), or
    of an Atari game named by its ROM id."""
    from .ale import ale_action_meanings

    if not isinstance(spec, EnvSpec):
        return ale_action_meanings(spec, full_action_space)
    if spec.backend == "pyboy":
        return spec.gameboy_config.meanings
    return ale_action_meanings(spec.game, spec.full_action_space)


def action_mask(spec: EnvSpec) -> np.ndarray:
    """Bool array over the spec's actions, True where allowed."""
    meanings = action_meanings(spec)
    unknown = sorted(set(spec.forbidden_actions) - set(meanings))
    if unknown:
        raise EnvError(
            f"cannot forbid {', '.join(unknown)}: {spec.game} has the actions "
            f"{', '.join(meanings)}"
        )
    if spec.fire_reset and "FIRE" not in meanings:
        raise EnvError(f"fire_reset presses FIRE, and {spec.game} has no FIRE action; "
                       "leave fire_reset off for this game")
    mask = np.array([m not in spec.forbidden_actions for m in meanings], dtype=bool)
    if not mask.any():
        raise EnvError(f"the action mask forbids every action of {spec.game}")
    return mask


def make_env(spec: EnvSpec, render_mode: str | None = None) -> gym.Env:
    """A single preprocessed env whose observations are (frame_stack, size, size) uint8.

    `env.unwrapped` is the emulator: Atari's has `.ale`, the Game Boy's `.memory(address)`;
    both `.render()` RGB frames.
    """
    action_mask(spec)  # refuse a bad mask before any emulator starts
    if spec.backend == "pyboy":
        from .gameboy import GameBoyEnv

        return GameBoyEnv(spec, render_mode)
    from .ale import make_ale_env

    return make_ale_env(spec, render_mode)


def played_action(env: gym.Env, action: int) -> int:
    """The action `env` (from `make_env`) plays when `action` is chosen next: FIRE where
    the env serves for the player (`spec.fire_reset`), else `action`. A scripted player
    that remembers its keys is told this one when another agent drives."""
    from .ale import FireReset

    return env.played(action) if isinstance(env, FireReset) else action


def make_vector_env(spec: EnvSpec, num_envs: int, *, same_step_reset: bool = False,
                    labeller: str | None = None) -> Any:
    """`num_envs` envs stepped together; observations (n, stack, size, size) uint8, and
    `info["lives"]`. Env i of `reset(seed=s)` plays seed s + i.

    By default a finished sub-env resets on the following `step` call (gymnasium's
    next-step mode). With `same_step_reset` it resets at once: the step that ends an
    episode returns the next episode's first observation and the last one in
    `info["final_obs"]`, which training needs to bootstrap truncated episodes.

    With `labeller` (a scripted player's style), `info["labels"]` of every reset and step
    holds the action that player would take on each returned observation. The script
    reads RAM, so it runs beside each emulator in the worker process that steps it: Game
    Boy games always step that way, and Atari games do then instead of in ale-py's C++
    vector env, which does not expose each emulator's RAM.
    """
    if num_envs < 1:
        raise EnvError(f"the number of envs must be at least 1, got {num_envs}")
    action_mask(spec)
    if spec.backend == "pyboy" or labeller is not None:
        from .pool import PoolVectorEnv

        return PoolVectorEnv(spec, num_envs, same_step_reset=same_step_reset,
                             labeller=labeller)
    from .ale import make_ale_vector_env

    return make_ale_vector_env(spec, num_envs, same_step_reset=same_step_reset)


def available_games() -> list[tuple[str, str]]:
    """(game, where it runs) for every game: Atari ROMs that ship with ale-py, then the
    Game Boy games with a shipped config and whether their ROM is here."""
    from . import roms
    from .gameconfig import load, shipped_games
    from .spec import available_games as atari_games

    games = [(game, "Atari") for game in atari_games()]
    titles = set(roms.stored_titles().values())
    for name, path in shipped_games().items():
        config = load(path)
        ready = config.title in titles
        games.append((name, "Game Boy" if ready else "Game Boy, needs --rom PATH"))
    return games
