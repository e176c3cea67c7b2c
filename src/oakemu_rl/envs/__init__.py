"""Emulator backends behind one factory: `make_env` to play, `make_vector_env` to train."""

from .ale import FrameStack, action_mask, action_meanings, make_env, make_vector_env
from .spec import EnvSpec, available_games, canonical_game

__all__ = [
    "EnvSpec",
    "FrameStack",
    "action_mask",
    "action_meanings",
    "available_games",
    "canonical_game",
    "make_env",
    "make_vector_env",
]
