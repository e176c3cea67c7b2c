"""Every command on the Game Boy: `pipelines/gb-quick.toml` end to end on CATCH (the
project's own cartridge, built from source), then the single commands on its outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from oakemu_rl.checkpoint import load_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.demos import validate_demo_file
from oakemu_rl.envs import EnvSpec

PRESET = Path(__file__).resolve().parents[1] / "pipelines" / "gb-quick.toml"


def oakemu(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gb")
    result = oakemu("pipeline", "run", str(PRESET), "--run-dir", str(root / "run"),
                    "--no-progress")
    assert result.exit_code == 0, result.output
    return root / "run"


def test_the_preset_runs_every_stage_on_the_game_boy(run_dir: Path) -> None:
    for name in ("demos.h5", "bc.pt", "calibrated.pt", "ppo.pt", "test.json", "report.md"):
        assert (run_dir / name).exists(), name
    spec = EnvSpec.from_dict(load_checkpoint(run_dir / "ppo.pt").env_spec)
    assert spec.backend == "pyboy" and spec.game == "catch" and spec.rom_title == "OAKCATCH"
    assert len(spec.rom_sha256) == 64 and json.loads(spec.game_config)["game"]["name"] == "catch"
    scores = json.loads((run_dir / "test.json").read_text())
    demonstrator = scores["demonstrator"]
    assert demonstrator["episodes"] >= 10
    assert demonstrator["mean"] > 10  # the scripted player catches nearly every ball
    assert set(scores) >= {"bc", "ppo"}
    assert "GB/catch" in (run_dir / "report.md").read_text()


def test_demo_file_commands_on_game_boy_demos(run_dir: Path, tmp_path: Path) -> None:
    demos = run_dir / "demos.h5"
    with validate_demo_file(demos) as demo:
        assert demo.spec.backend == "pyboy"
        assert demo.action_meanings == ["NOOP", "LEFT", "RIGHT"]
    info = oakemu("demos", "info", str(demos))
    assert info.exit_code == 0 and "GB/catch" in info.output
    merged = tmp_path / "merged.h5"
    result = oakemu("demos", "merge", str(merged), str(demos), str(demos))
    assert result.exit_code == 0, result.output
    with validate_demo_file(merged) as demo:
        assert len(demo.episodes) == 8


def test_stage_commands_test_and_export_on_the_game_boy(run_dir: Path, tmp_path: Path) -> None:
    bc = tmp_path / "bc"
    result = oakemu("bootstrap", "bc", str(run_dir / "demos.h5"), "--epochs", "1",
                    "--architecture", "tiny", "--run-dir", str(bc), "--no-progress")
    assert result.exit_code == 0, result.output
    result = oakemu("test", str(run_dir / "ppo.pt"), "--episodes", "2", "--max-steps", "50",
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["checkpoint"]["episodes"] == 2
    onnx = tmp_path / "catch.onnx"
    result = oakemu("export", "onnx", str(run_dir / "ppo.pt"), "--out", str(onnx))
    assert result.exit_code == 0, result.output
    result = oakemu("test", "--onnx", str(onnx), "--episodes", "1", "--max-steps", "40")
    assert result.exit_code == 0, result.output
    assert "GB/catch" in result.output
