"""The `oakemu` command itself: help, version, listing games, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
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


def test_fire_reset_on_a_game_without_fire_is_one_clear_line() -> None:
    result = CliRunner().invoke(cli, ["test", "--demonstrator", "scripted", "--game", "freeway",
                                      "--fire-reset"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "Error: fire_reset presses FIRE, and freeway has no FIRE action; leave fire_reset off "
        "for this game"]


def test_every_stage_has_help() -> None:
    for args in (["record"], ["demos", "info"], ["bootstrap", "bc"], ["bootstrap", "calibrate"],
                 ["finetune", "ppo"], ["test"], ["export", "onnx"], ["pipeline", "run"]):
        result = CliRunner().invoke(cli, [*args, "--help"])
        assert result.exit_code == 0, args
        assert "Usage: " in result.output and "--help" in result.output


ENV_OPTIONS = [
    (["--sticky", "0"], "--sticky"),
    (["--sticky", "0.25"], "--sticky"),  # typed, even at the default value
    (["--game", "breakout"], "--game"),
    (["--noop-max", "0"], "--noop-max"),
    (["--full-action-space"], "--full-action-space"),
    (["--forbid", "FIRE"], "--forbid"),
    (["--fire-reset"], "--fire-reset"),
]


@pytest.mark.parametrize(("option", "flag"), ENV_OPTIONS,
                         ids=[" ".join(option) for option, _ in ENV_OPTIONS])
def test_env_options_are_refused_beside_a_checkpoint(checkpoint_file, tmp_path, option,
                                                     flag) -> None:
    """A checkpoint plays the env spec it was trained on: an env option would be ignored."""
    checkpoint = checkpoint_file()
    video = tmp_path / "first.gif"
    for args in (["test", str(checkpoint), *option],
                 ["test", str(checkpoint), "--demonstrator", "scripted", "--video", str(video),
                  *option],
                 ["test", "--onnx", str(tmp_path / "policy.onnx"), *option]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code != 0, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.output, result.output
        # the flag the user typed, as `oakemu test --help` spells it
        assert lines[0].startswith(f"Error: {flag} does not apply to a checkpoint"), lines[0]
        assert not video.exists()  # refused before any game was played


def test_env_options_choose_the_scripted_demonstrators_game() -> None:
    result = CliRunner().invoke(cli, ["test", "--demonstrator", "scripted", "--sticky", "0",
                                      "--episodes", "1", "--max-steps", "20", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["scripted"]["lengths"] == [20]
    result = CliRunner().invoke(cli, ["test", "--demonstrator", "scripted", "--sticky", "0",
                                      "--episodes", "1", "--max-steps", "20"])
    assert result.exit_code == 0, result.output
    assert "ALE/Pong-v5, greedy, 1 episode(s), seed 0" in result.stdout.splitlines()
