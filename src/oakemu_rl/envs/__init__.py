"""Emulator backends behind one factory: `make_env` to play, `make_vector_env` to train.

Atari runs on the Arcade Learning Environment (`ale`), the Game Boy on PyBoy (`gameboy`,
with game configs in `gameconfig` and ROMs in `roms`).
"""

from .ale import FrameStack
from .backends import action_mask, action_meanings, available_games, make_env, make_vector_env
from .spec import (
    EnvSpec,
    actions_agree,
    canonical_game,
    require_same_env,
)

__all__ = [
    "EnvSpec",
    "FrameStack",
    "action_mask",
    "action_meanings",
    "actions_agree",
    "available_games",
    "canonical_game",
    "make_env",
    "make_vector_env",
    "require_same_env",
]
