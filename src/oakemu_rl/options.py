"""Command-line options from stage configs, and the options every stage shares.

A config field becomes an option of the same name (`batch_size` → `--batch-size`) with its
docstring as help and its default shown; its type follows the field's annotation, the
same annotation the pipeline's TOML sections are checked against (`configs.coerce`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any

import click

from .configs import field_docs, flag
from .runtime import SEED_MAX


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (FloatRange lets nan through)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        number = super().convert(value, param, ctx)
        if number is not None and not math.isfinite(number):
            self.fail(f"{number} is not a finite number.", param, ctx)
        return number


def _one_or_many(_ctx: Any, _param: Any, value: tuple) -> Any:
    """A repeatable option of a field typed `X | tuple[X, ...] | None`: none → None, one → X,
    several → a tuple."""
    if not value:
        return None
    return value[0] if len(value) == 1 else tuple(value)


def _option_for(field: dataclasses.Field, annotation: Any, help_text: str) -> Callable:
    """The click option of one config field."""
    name, default = field.name, field.default
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        return click.option(f"{flag(name)}/--no-{flag(name)[2:]}", name, default=default,
                            show_default=True, help=help_text)
    if typing.get_origin(annotation) is tuple:
        return click.option(flag(name), name, multiple=True, help=help_text,
                            callback=lambda _ctx, _param, value: tuple(value))
    tuples = [a for a in args if typing.get_origin(a) is tuple]
    if tuples:  # e.g. int | tuple[int, ...] | None
        inner = typing.get_args(tuples[0])[0]
        return click.option(flag(name), name, type=inner, multiple=True, callback=_one_or_many,
                            help=f"{help_text} (repeat for a list)")
    kind = annotation if annotation in (int, float, str) else \
        next((a for a in args if a in (int, float, str)), str)
    return click.option(flag(name), name, type=kind, default=default,
                        show_default=default is not None, help=help_text)


def config_options(config_cls: type) -> Callable:
    """Click options for every field of a stage's config dataclass."""
    docs = field_docs(config_cls)
    hints = typing.get_type_hints(config_cls)

    def decorate(func: Callable) -> Callable:
        for field in reversed(dataclasses.fields(config_cls)):
            func = _option_for(field, hints[field.name], docs.get(field.name, ""))(func)
        return func

    return decorate


def config_from(config_cls: type, options: dict[str, Any]) -> Any:
    """Build `config_cls` from the options that are its fields; remove them from `options`
    and leave the rest (places: files, run directory, device, progress)."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return config_cls(**{k: options.pop(k) for k in list(options) if k in names})


def config_args(config: Any) -> list[str]:
    """The command-line options that rebuild `config` (what `config_options` parses):
    the pipeline passes a stage's config to the ranks torchrun starts this way."""
    args: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(flag(field.name) if value else f"--no-{flag(field.name)[2:]}")
        elif isinstance(value, tuple):
            for item in value:
                args += [flag(field.name), str(item)]
        else:
            args += [flag(field.name), repr(value) if isinstance(value, float) else str(value)]
    return args


def place_options(*, run_dir: str | None = None, checkpoint: str | None = None,
                  resume: bool = False, device: bool = True) -> Callable:
    """Options that say where a stage reads and writes, not what it computes."""
    options = []
    if run_dir is not None:
        options.append(click.option("--run-dir", default=None, help=run_dir))
    if checkpoint is not None:
        options.append(click.option("--checkpoint", type=click.Path(path_type=str),
                                    default=None, help=checkpoint))
    if resume:
        options.append(click.option("--resume", is_flag=True, help=(
            "Continue the run directory's ppo_last.pt: same global step, optimizer state and "
            "schedules.")))
    if device:
        options.append(click.option("--device", default="auto", show_default=True,
                                    help="auto (CUDA when present), cpu or cuda."))
    options.append(click.option("--progress/--no-progress", default=True, show_default=True,
                                help="Show progress bars."))

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def seed_option() -> Callable:
    return click.option("--seed", type=click.IntRange(0, SEED_MAX), default=0,
                        show_default=True)
