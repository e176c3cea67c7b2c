"""Stage configs: one way to check them, read their field docs, and fill them from TOML.

A stage's config is a frozen dataclass of what changes its result, one docstring per
field. The same class validates an `oakemu` command's options, a pipeline TOML section and
a Python caller's arguments: `check_options` for types and ranges, `from_table` for a TOML
table, `field_docs` for help texts and docs/cli.md.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import math
import textwrap
import types
import typing
from typing import Any

from .errors import ConfigError

Check = tuple[str, bool, str]
"""(field name, whether its value is allowed, the rule in words, e.g. "≥ 1")."""


def flag(name: str) -> str:
    """The command-line option of a config field: `batch_size` → `--batch-size`."""
    return "--" + name.replace("_", "-")


def check_options(config: Any, checks: list[Check], *, stage: str | None = None,
                  section: str | None = None, error: type[Exception] = ConfigError) -> None:
    """Refuse a config whose field has the wrong type, a non-finite number or a failed
    range check, in one line. A stage config names the value as its key and its option
    (`bc option lr=inf is out of range: --lr must be a finite number`); a pipeline section
    as `section.key` (`demos.episodes=0 is out of range: it must be ≥ 1`)."""
    def refuse(name: str, rule: str) -> Exception:
        value = getattr(config, name)
        if stage is not None:
            return error(f"{stage} option {name}={value!r} is out of range: "
                         f"{flag(name)} must be {rule}")
        return error(f"{section}.{name}={value!r} is out of range: it must be {rule}")

    hints = typing.get_type_hints(type(config))
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        try:
            coerce(item.name, hints[item.name], value)
        except ConfigError as problem:
            raise error(f"{stage or section} option {problem}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise refuse(item.name, "a finite number")
    for name, ok, rule in checks:
        if not ok:
            raise refuse(name, rule)


def check_choice(stage: str, name: str, value: str, choices: tuple[str, ...] | list[str]
                 ) -> None:
    """Refuse a string option that is not one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{stage} option {name} must be one of {tuple(choices)}, "
                          f"got {value!r}")


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_PLURALS = {int: "integers", float: "numbers", str: "strings"}


def coerce(where: str, annotation: Any, value: Any) -> Any:
    """Check `value` against a field's annotation; return it converted (a TOML list to a
    tuple, an int to a float). ConfigError names `where` and what was expected."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for choice in inner:  # the first alternative that takes the value
            try:
                return coerce(where, choice, value)
            except ConfigError:
                if len(inner) == 1:
                    raise
        kinds = " or ".join(_KINDS.get(a) or "a list of " + _PLURALS.get(
            (typing.get_args(a) or (None,))[0], "values") for a in inner)
        raise ConfigError(f"{where} must be {kinds}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list")
        return tuple(coerce(f"{where}[{i}]", args[0], v) for i, v in enumerate(value))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(annotation, type) and isinstance(value, annotation):
        return value
    raise ConfigError(f"{where} has a type this file cannot set")


def from_table(cls: type, table: Any, where: str, moved: dict[str, str] | None = None) -> Any:
    """An instance of config class `cls` from a TOML table: unknown keys and wrong types
    are errors naming `where.key`; `moved` maps a key that lives elsewhere now to the line
    that says where."""
    return cls(**table_values(cls, table, where, moved))


def table_values(cls: type, table: Any, where: str, moved: dict[str, str] | None = None
                 ) -> dict[str, Any]:
    """A TOML table's values checked and converted for config class `cls`, without building
    it: what `from_table` passes to `cls`, for a caller that changes an existing config."""
    if not isinstance(table, dict):
        raise ConfigError(f"[{where}] must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {}
    for key, value in table.items():
        if moved and key in moved:
            raise ConfigError(f"{where}.{key} has moved: {moved[key]}")
        if key not in names:
            raise ConfigError(f"unknown key {where}.{key} (known: {', '.join(sorted(names))})")
        values[key] = coerce(f"{where}.{key}", hints[key], value)
    return values


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, as one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, after in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs
