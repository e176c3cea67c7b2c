"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations


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
