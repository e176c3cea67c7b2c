"""CATCH, a small Game Boy game written for this project, and the assembler that builds it.

`build_rom()` assembles `catch.asm` into a 32 KiB cartridge; `RAM` maps state names
(score, lives, game_over, player_x, object_x, object_y, ...) to WRAM addresses. Both live
in `build` and are loaded on first use, so `python -m oakemu_rl.envs.gbgame.build` runs
that module only once.
"""

from __future__ import annotations

import importlib
from typing import Any

from .asm import AsmError, Assembly, assemble

__all__ = ["CONSTANTS", "RAM", "AsmError", "Assembly", "assemble", "build_rom", "symbols"]

_FROM_BUILD = {"CONSTANTS", "RAM", "build_rom", "symbols"}


def __getattr__(name: str) -> Any:
    if name in _FROM_BUILD:
        return getattr(importlib.import_module(".build", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
