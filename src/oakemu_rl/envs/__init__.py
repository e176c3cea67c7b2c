"""Emulator backends behind one factory: `make_env` to play, `make_vector_env` to train."""

from .ale import FrameStack, action_mask, action_meanings, make_env, make_vector_env
from .spec import (
    EnvSpec,
    actions_agree,
    available_games,
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
