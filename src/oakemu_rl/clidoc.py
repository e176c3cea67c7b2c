"""docs/cli.md, the option reference, written from the `oakemu` commands themselves.

Stage options come from the config dataclasses' field docs (`options.config_options`), so
this page is their docs too. Regenerate after changing a command or a config field:

    .venv/bin/python -m oakemu_rl.clidoc > docs/cli.md

tests/test_cli_docs.py fails while the committed page differs from what this writes.
"""

from __future__ import annotations

import inspect

import click

from .cli import cli

HEADER = """# Command-line reference

Every `oakemu` command and option, generated from the code
(`.venv/bin/python -m oakemu_rl.clidoc > docs/cli.md`; a test fails when this page is
stale). A stage's options are the fields of its config: the same names, with `_` for `-`,
set a pipeline TOML's `[bc]`, `[calibrate]` and `[ppo]` tables. Every command also takes
`-h` / `--help`.
"""


def _commands(group: click.Group, prefix: str) -> list[tuple[str, click.Command]]:
    found = []
    for name in sorted(group.commands):
        command = group.commands[name]
        path = f"{prefix} {name}"
        if isinstance(command, click.Group):
            found += _commands(command, path)
        else:
            found.append((path, command))
    return found


def _option_row(param: click.Parameter, ctx: click.Context) -> str:
    record = param.get_help_record(ctx)
    if record is None:
        return ""
    names, text = record
    escaped = text.replace("|", "\\|")
    return f"| `{names}` | {escaped} |"


def render() -> str:
    """The whole page as markdown."""
    parts = [HEADER]
    root = click.Context(cli, info_name="oakemu")
    for path, command in _commands(cli, "oakemu"):
        ctx = click.Context(command, info_name=path, parent=root)
        usage = " ".join(command.collect_usage_pieces(ctx))
        parts += [f"## `{path}`", "", "```", f"{path} {usage}", "```", "",
                  inspect.cleandoc(command.help or "").replace("\b\n", ""), ""]
        # -h/--help is every command's; leaving it out keeps the page the same however
        # click set the help option up in this process.
        rows = [_option_row(p, ctx) for p in command.get_params(ctx)
                if isinstance(p, click.Option) and "--help" not in p.opts]
        rows = [r for r in rows if r]
        if rows:
            parts += ["| option | meaning |", "| --- | --- |", *rows, ""]
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
