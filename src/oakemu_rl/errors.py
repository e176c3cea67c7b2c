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


def check_options(stage: str, config: object, checks: list[tuple[str, bool, str]]) -> None:
    """Refuse a stage config with a non-finite number or a failed range check, in one line
    that names the value both as the config key and as the command-line option."""
    import dataclasses
    import math

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    for item in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, item.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{stage} option {item.name}={value!r} is out of range: "
                              f"{flag(item.name)} must be a finite number")
    for name, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{stage} option {name}={getattr(config, name)!r} is out of range: "
                              f"{flag(name)} must be {rule}")
