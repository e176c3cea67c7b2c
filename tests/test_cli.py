"""The `oakemu` command itself: help, version, listing games, clear errors."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from oakemu_rl import __version__
from oakemu_rl.cli import cli


def test_help_lists_every_stage() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for command in ("record", "demos", "bootstrap", "finetune", "test", "export", "pipeline",
                    "info", "envs"):
        assert command in result.output


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_console_script_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "oakemu_rl", "--version"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_envs_lists_the_shipped_games() -> None:
    result = CliRunner().invoke(cli, ["envs"])
    games = result.output.split()
    assert result.exit_code == 0 and "pong" in games and "breakout" in games
    assert len(games) > 50


def test_unknown_game_is_one_clear_line() -> None:
    result = CliRunner().invoke(cli, ["record", "--demonstrator", "scripted", "--game", "pongg"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "Error: unknown game 'pongg'; run `oakemu envs` to list the games"
    ]


def test_forbidding_an_unknown_action_is_one_clear_line() -> None:
    result = CliRunner().invoke(cli, ["test", "--demonstrator", "scripted", "--forbid", "JUMP"])
    assert result.exit_code != 0
    assert "cannot forbid JUMP" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_every_stage_has_help() -> None:
    for args in (["record"], ["demos", "info"], ["bootstrap", "bc"], ["bootstrap", "calibrate"],
                 ["finetune", "ppo"], ["test"], ["export", "onnx"], ["pipeline", "run"]):
        result = CliRunner().invoke(cli, [*args, "--help"])
        assert result.exit_code == 0, args
        assert "Usage: " in result.output and "--help" in result.output
