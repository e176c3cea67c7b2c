"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations

import math
from typing import Any


class OakEmuError(Exception):
    """A problem with the user's input (a file, an option, the machine), not a bug."""


class CheckpointError(OakEmuError):
    """A checkpoint file that cannot be used."""


class DemoFileError(OakEmuError):
    """A demonstration file that cannot be used."""


class EnvError(OakEmuError):
    """An emulator or game that cannot be set up."""


class ConfigError(OakEmuError):
    """A configuration value or option that is not valid."""


def check_finite(value: Any, what: str, *, where: str, outcome: str) -> None:
    """Stop a stage whose loss or gradient norm (a number or a 0-d tensor) is nan or inf,
    in one line: `{what} became nan at {where}; {outcome}` (what was kept, what to try)."""
    number = float(value.detach() if hasattr(value, "detach") else value)
    if not math.isfinite(number):
        raise OakEmuError(f"{what} became {number} at {where}; {outcome}")
