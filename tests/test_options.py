"""Bad option values are refused at the edge: one line that names the option, no traceback.

Each case is a value a user can type by mistake (zero, negative, out of range, nan, inf,
an unknown name); every stage's options go through the same checks (click's ranges for
the hand-written options, `errors.check_options` for the stage configs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
from oakemu_rl.model import ARCHITECTURES, PPOModel
from oakemu_rl.runtime import SEED_MAX


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    spec = EnvSpec(game="pong")
    meanings = list(action_meanings(spec.game, spec.full_action_space))
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, len(meanings), ARCHITECTURES["tiny"])
    path = tmp_path_factory.mktemp("options") / "tiny.pt"
    save_checkpoint(path, Checkpoint.from_model(
        model, stage="bc", action_meanings=meanings,
        action_mask=[bool(v) for v in action_mask(spec)], env_spec=spec.to_dict()))
    return path


def error_line(args: list[str]) -> str:
    """Run `oakemu ARGS`; it must fail with exactly one 'Error: ' line and no traceback."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    assert result.output.strip().splitlines()[-1] == errors[0], result.output
    return errors[0]


def names(line: str, option: str) -> bool:
    """The error line names the option, as a flag or as its config key."""
    return option in line or option.lstrip("-").replace("-", "_") in line


CKPT = "{ckpt}"

CASES = [
    # command, the bad option and value, extra arguments
    (["record", "--demonstrator", "scripted"], ["--episodes", "0"], "--episodes"),
    (["record", "--demonstrator", "scripted"], ["--max-steps", "-1"], "--max-steps"),
    (["record", "--demonstrator", "scripted"], ["--noise", "2"], "--noise"),
    (["record", "--demonstrator", "scripted"], ["--noise", "nan"], "--noise"),
    (["record", "--demonstrator", "scripted"], ["--sticky", "nan"], "--sticky"),
    (["record", "--demonstrator", "scripted"], ["--noop-max", "-1"], "--noop-max"),
    (["record", "--demonstrator", "scripted"], ["--seed", "-1"], "--seed"),
    (["record", "--demonstrator", "scripted"], ["--seed", str(2**70)], "--seed"),
    (["record"], ["--fps", "0"], "--fps"),
    (["record"], ["--fps", "inf"], "--fps"),
    (["record", "--demonstrator", "scripted"], ["--game", "pongg"], "game"),
    (["record", "--demonstrator", "scripted"], ["--forbid", "JUMP"], "JUMP"),
    (["record", "--policy", CKPT, "--episodes", "1"], ["--device", "meta"], "--device"),
    (["test", CKPT], ["--episodes", "0"], "--episodes"),
    (["test", CKPT], ["--max-steps", "0"], "--max-steps"),
    (["test", CKPT], ["--seed", str(2**40)], "--seed"),
    (["test", CKPT], ["--device", "foo"], "--device"),
    (["test", CKPT], ["--device", "mps"], "--device"),
    (["test", CKPT], ["--device", "cuda:x"], "--device"),
    (["bootstrap", "bc", "demos.h5"], ["--batch-size", "0"], "--batch-size"),
    (["bootstrap", "bc", "demos.h5"], ["--epochs", "0"], "--epochs"),
    (["bootstrap", "bc", "demos.h5"], ["--epochs", "abc"], "--epochs"),
    (["bootstrap", "bc", "demos.h5"], ["--lr", "-1"], "--lr"),
    (["bootstrap", "bc", "demos.h5"], ["--lr", "inf"], "--lr"),
    (["bootstrap", "bc", "demos.h5"], ["--lr", "nan"], "--lr"),
    (["bootstrap", "bc", "demos.h5"], ["--weight-decay", "inf"], "--weight-decay"),
    (["bootstrap", "bc", "demos.h5"], ["--label-smoothing", "1"], "--label-smoothing"),
    (["bootstrap", "bc", "demos.h5"], ["--augment-shift", "100"], "--augment-shift"),
    (["bootstrap", "bc", "demos.h5"], ["--seed", "-1"], "--seed"),
    (["bootstrap", "bc", "demos.h5"], ["--architecture", "huge"], "--architecture"),
    (["bootstrap", "bc", "demos.h5"], ["--lr-schedule", "sawtooth"], "--lr-schedule"),
    (["bootstrap", "bc", "demos.h5"], ["--relabel-episodes", "-1"], "--relabel-episodes"),
    (["bootstrap", "bc", "demos.h5"], ["--relabel-rounds", "0"], "--relabel-rounds"),
    (["bootstrap", "bc", "demos.h5"], ["--relabel-epochs", "0"], "--relabel-epochs"),
    (["bootstrap", "bc", "demos.h5"], ["--relabel-epochs", "2", "--relabel-epochs", "3"],
     "--relabel-epochs"),
    (["bootstrap", "bc", "demos.h5"], ["--relabel-seed", "-1"], "--relabel-seed"),
    (["bootstrap", "calibrate"], ["--num-envs", "0"], "--num-envs"),
    (["bootstrap", "calibrate"], ["--holdout-envs", "8"], "--holdout-envs"),
    (["bootstrap", "calibrate"], ["--gamma", "2"], "--gamma"),
    (["bootstrap", "calibrate"], ["--demo-ratio", "inf"], "--demo-ratio"),
    (["bootstrap", "calibrate"], ["--target-explained-variance", "-inf"],
     "--target-explained-variance"),
    (["bootstrap", "calibrate"], ["--target", "mc2"], "--target"),
    (["bootstrap", "calibrate"], ["--seed", str(2**40)], "--seed"),
    (["finetune", "ppo"], ["--num-envs", "0"], "--num-envs"),
    (["finetune", "ppo"], ["--lr", "-1"], "--lr"),
    (["finetune", "ppo"], ["--total-steps", "0"], "--total-steps"),
    (["finetune", "ppo"], ["--num-minibatches", "0"], "--num-minibatches"),
    (["finetune", "ppo"], ["--checkpoint-every", "0"], "--checkpoint-every"),
    (["finetune", "ppo"], ["--kl-coef", "inf"], "--kl-coef"),
    (["finetune", "ppo"], ["--clip-coef", "nan"], "--clip-coef"),
    (["finetune", "ppo"], ["--target-kl", "0"], "--target-kl"),
    (["finetune", "ppo"], ["--seed", "-5"], "--seed"),
    (["export", "onnx", CKPT, "--out", "x.onnx"], ["--verify-frames", "0"], "--verify-frames"),
    (["export", "onnx", CKPT, "--out", "x.onnx"], ["--tolerance", "nan"], "--tolerance"),
    (["export", "onnx", CKPT, "--out", "x.onnx"], ["--tolerance", "-1"], "--tolerance"),
    (["export", "onnx", CKPT, "--out", "x.onnx"], ["--opset", "5"], "opset"),
]


@pytest.mark.parametrize(("command", "bad", "option"), CASES,
                         ids=[f"{' '.join(c[:2])} {' '.join(b)}" for c, b, _ in CASES])
def test_a_bad_value_is_one_line_naming_the_option(command, bad, option, checkpoint, tmp_path,
                                                   monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = [str(checkpoint) if a == CKPT else a for a in command] + bad
    line = error_line(args)
    assert names(line, option), line
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_stage_errors_give_the_rule_and_the_flag() -> None:
    line = error_line(["bootstrap", "bc", "demos.h5", "--batch-size", "0"])
    assert line == "Error: bc option batch_size=0 is out of range: --batch-size must be ≥ 1"
    line = error_line(["finetune", "ppo", "--lr", "inf"])
    assert line == "Error: ppo option lr=inf is out of range: --lr must be a finite number"
    line = error_line(["bootstrap", "bc", "demos.h5", "--relabel-epochs", "2",
                       "--relabel-epochs", "3"])
    assert line == ("Error: bc option relabel_epochs=(2, 3) is out of range: --relabel-epochs "
                    "must be one number, or a list of relabel_rounds = 1 numbers")


def test_the_edge_values_are_accepted(tmp_path: Path) -> None:
    """The largest seed and the smallest counts work end to end."""
    out = tmp_path / "d.h5"
    result = CliRunner().invoke(cli, [
        "record", "--demonstrator", "scripted", "--episodes", "1", "--max-steps", "1",
        "--seed", str(SEED_MAX), "--noise", "1", "--sticky", "0", "--noop-max", "0",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "wrote 1 episode(s)" in result.output


def test_pipeline_values_are_checked_before_any_work(tmp_path: Path) -> None:
    for section, line in (("[demos]\nepisodes = 0", "demos.episodes=0 is out of range"),
                          ("[evaluate]\nseed = -1", "evaluate.seed=-1 is out of range"),
                          ("[bc]\nlr = inf", "bc option lr=inf is out of range"),
                          ("[env]\nnoop_max = 100000", "noop_max=100000 is out of range")):
        path = tmp_path / "p.toml"
        path.write_text(f'name = "p"\n{section}\n')
        error = error_line(["pipeline", "run", str(path), "--run-dir", str(tmp_path / "run")])
        assert line in error, error
        assert not (tmp_path / "run").exists()
