"""A scripted player for CATCH, the project's own Game Boy game, that reads its RAM.

Each step it reads where the ball and the basket are and moves the basket towards the
column the ball falls in. The basket moves `player_step` pixels a frame while a direction
is held, so one agent step covers `player_step * frames_per_action` pixels; the player
stops when the basket's centre is within half a step of the ball's, and so never
overshoots back and forth.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..envs import EnvSpec, action_mask, action_meanings
from ..errors import EnvError


class CatchDemonstrator:
    """Plays CATCH from RAM (style "planner"); with `noise`, a random allowed action that
    often."""

    kind = "scripted"
    game = "catch"
    BALL_WIDTH = 8

    def __init__(self, spec: EnvSpec, *, seed: int = 0, noise: float = 0.0) -> None:
        from ..envs.gbgame import CONSTANTS, RAM

        if spec.game != self.game or spec.backend != "pyboy":
            raise EnvError(f"{type(self).__name__} plays catch, not {spec.game}")
        if not 0.0 <= float(noise) <= 1.0:
            raise EnvError(f"the demonstrator noise must be within 0..1, got {noise!r}")
        meanings = action_meanings(spec)
        mask = action_mask(spec)
        wanted = {name: meanings.index(name) for name in ("NOOP", "LEFT", "RIGHT")
                  if name in meanings and mask[meanings.index(name)]}
        if len(wanted) < 3:
            allowed = ", ".join(m for m, ok in zip(meanings, mask, strict=True) if ok)
            raise EnvError("the scripted catch player needs NOOP, LEFT and RIGHT allowed; "
                           f"the spec allows {allowed}")
        self.spec = spec
        self.seed = int(seed)
        self.noise = float(noise)
        self.allowed = np.flatnonzero(mask)
        self._actions = wanted
        self._ram = RAM
        self._half_width = CONSTANTS["player_width"] / 2
        self._reach = CONSTANTS["player_step"] * spec.gameboy_config.frames_per_action
        self.rng = np.random.default_rng(self.seed)

    def reset(self, env: Any, seed: int) -> None:
        self.rng = np.random.default_rng([self.seed % (1 << 64), int(seed) % (1 << 64)])

    def decide(self, memory: Any) -> int:
        """The action for the game state in `memory(address)`."""
        basket = memory(self._ram["player_x"]) + self._half_width
        ball = memory(self._ram["object_x"]) + self.BALL_WIDTH / 2
        gap = ball - basket
        if abs(gap) <= self._reach / 2:
            return self._actions["NOOP"]
        return self._actions["RIGHT" if gap > 0 else "LEFT"]

    def act(self, env: Any, observation: np.ndarray) -> int:
        action = self.decide(env.unwrapped.memory)
        if self.noise > 0.0 and self.rng.random() < self.noise:
            action = int(self.rng.choice(self.allowed))
        return action
