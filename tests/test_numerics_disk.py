"""Diverged training and a failing disk: a clear one-line error, the last good file kept.

- NaN/inf in a loss or a gradient stops bc, calibrate and ppo with a message that names
  what is kept; the injected faults go through the real code paths (the loss function or
  the value head is wrapped with monkeypatch, the stage itself is the CLI's).
- A read-only run directory. The tests run as root, for whom chmod 0o555 does not stop a
  write, so root mounts a tmpfs and remounts it read-only (EROFS stops root too); another
  user gets chmod 0o555. Where neither is possible the test is skipped and says why.
- A full disk: a tmpfs just big enough for the first checkpoint (or the first episodes),
  so a later atomic write hits ENOSPC mid-run; and, on any Linux machine, the atomic-write
  path writing into /dev/full (which fails every write with ENOSPC).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import math
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from builders import record_scripted, write_checkpoint
from click.testing import CliRunner

from oakemu_rl import fsutil
from oakemu_rl.checkpoint import load_checkpoint, save_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.demos import validate_demo_file
from oakemu_rl.envs import EnvSpec
from oakemu_rl.errors import OakEmuError
from oakemu_rl.model import ARCHITECTURES, PPOModel

SPEC = EnvSpec(game="pong")


# -- helpers --------------------------------------------------------------------------------


def tiny_checkpoint(path: Path, stage: str = "bc") -> Path:
    return write_checkpoint(path, SPEC, stage=stage, config=ARCHITECTURES["tiny"],
                            steps={"epochs": 1})


def record_demos(path: Path, episodes: int, max_steps: int = 24) -> Path:
    return record_scripted(path, SPEC, episodes=episodes, max_steps=max_steps)


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("numerics-demos")
    return {1: record_demos(folder / "one.h5", 1, 40), 3: record_demos(folder / "three.h5", 3)}


def run(args: list[str]):
    result = CliRunner().invoke(cli, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    return result


def failed_with(args: list[str], *phrases: str) -> str:
    """Run the command; it must fail with one 'Error: ' line (the last on stderr) holding
    `phrases`."""
    result = run(args)
    assert result.exit_code != 0, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], \
        result.output
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    return errors[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*.tmp-*")]


def bc_args(demo: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["bootstrap", "bc", str(demo), "--architecture", "tiny", "--run-dir", str(run_dir),
            "--batch-size", "16", "--patience", "0", "--device", "cpu", "--no-progress", *extra]


def calibrate_args(run_dir: Path, *extra: str) -> list[str]:
    return ["bootstrap", "calibrate", "--run-dir", str(run_dir), "--num-envs", "2",
            "--holdout-envs", "1", "--num-steps", "8", "--iterations", "2",
            "--target-explained-variance", "1", "--device", "cpu", "--no-progress", *extra]


def ppo_args(run_dir: Path, *extra: str) -> list[str]:
    return ["finetune", "ppo", "--run-dir", str(run_dir), "--total-steps", "64",
            "--num-envs", "2", "--num-steps", "8", "--num-minibatches", "2",
            "--update-epochs", "1", "--warmup-updates", "0", "--warmup-ramp-updates", "0",
            "--eval-episodes", "0", "--checkpoint-every", "1", "--device", "cpu",
            "--no-progress", *extra]


def nan_gradient(value: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """`value` unchanged, but its gradient becomes NaN: d sqrt(u)/du at u = 0 is inf, and
    0 × inf is NaN."""
    return value + 0.0 * torch.sqrt(base - base.detach()).sum()


# -- NaN / inf in training ---------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["loss", "gradient"])
def test_bc_stops_on_nan_and_keeps_the_best_epoch(fault, demos, tmp_path, monkeypatch) -> None:
    import oakemu_rl.bootstrap.bc as bc_module

    run_dir = tmp_path / "run"
    saved = run_dir / "bc.pt"
    real = bc_module.bc_loss

    def faulty(logits, actions, mask, **kwargs):
        loss = real(logits, actions, mask, **kwargs)
        if not (saved.exists() and logits.requires_grad):  # epoch 1 trains and is saved
            return loss
        return loss * math.nan if fault == "loss" else nan_gradient(loss, logits)

    monkeypatch.setattr(bc_module, "bc_loss", faulty)
    what = "the BC loss became nan" if fault == "loss" else "a BC gradient became nan"
    failed_with(bc_args(demos[3], run_dir, "--epochs", "3"),
                f"{what} at epoch 2", f"epoch 1, the best so far, is kept in {saved}")
    kept = load_checkpoint(saved)
    assert kept.steps["bc/epochs"] == 1
    assert not temp_files(run_dir)


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path) -> None:
    good = tiny_checkpoint(tmp_path / "bc.pt")
    before = digest(good)
    checkpoint = load_checkpoint(good)
    checkpoint.state_dict["policy_head.weight"][0, 0] = math.inf
    with pytest.raises(OakEmuError, match="not finite"):
        save_checkpoint(good, checkpoint)
    assert digest(good) == before and not temp_files(tmp_path)


@pytest.mark.parametrize("fault", ["loss", "gradient"])
def test_calibrate_stops_on_nan_and_overwrites_nothing(fault, tmp_path, monkeypatch) -> None:
    import oakemu_rl.bootstrap.calibrate as calibrate_module

    run_dir = tmp_path / "run"
    bc = tiny_checkpoint(run_dir / "bc.pt")
    previous = tiny_checkpoint(run_dir / "calibrated.pt", stage="calibrate")
    before = {bc: digest(bc), previous: digest(previous)}
    if fault == "loss":
        real = calibrate_module.value_targets
        monkeypatch.setattr(calibrate_module, "value_targets",
                            lambda rollout, config: real(rollout, config) * math.nan)
        phrase = "the value loss became nan at iteration 1"
    else:
        real_value = PPOModel.get_value

        def value(self, x, *, detach_features=False):
            out = real_value(self, x, detach_features=detach_features)
            return nan_gradient(out, out) if detach_features and out.requires_grad else out

        monkeypatch.setattr(PPOModel, "get_value", value)
        phrase = "a value-head gradient became nan at iteration 1"
    failed_with(calibrate_args(run_dir), phrase, "nothing was overwritten")
    assert {p: digest(p) for p in before} == before
    assert not temp_files(run_dir)


@pytest.mark.parametrize("fault", ["loss", "gradient"])
def test_ppo_stops_on_nan_keeps_ppo_last_and_resumes(fault, tmp_path, monkeypatch) -> None:
    import oakemu_rl.rl.losses as losses_module  # ppo_loss calls value_loss and policy_loss

    run_dir = tmp_path / "run"
    tiny_checkpoint(run_dir / "calibrated.pt", stage="calibrate")
    last = run_dir / "ppo_last.pt"
    real_value_loss, real_policy_loss = losses_module.value_loss, losses_module.policy_loss

    def faulty_value_loss(*args, **kwargs):
        loss = real_value_loss(*args, **kwargs)
        return loss * math.nan if last.exists() else loss  # update 1 trains and is saved

    def faulty_policy_loss(advantages, ratio, clip_coef):
        loss = real_policy_loss(advantages, ratio, clip_coef)
        return nan_gradient(loss, ratio) if last.exists() else loss

    if fault == "loss":
        monkeypatch.setattr(losses_module, "value_loss", faulty_value_loss)
        phrase = "the PPO loss became nan at update 2"
    else:
        monkeypatch.setattr(losses_module, "policy_loss", faulty_policy_loss)
        phrase = "a PPO gradient became nan at update 2"
    failed_with(ppo_args(run_dir), phrase, f"the last good checkpoint is {last}", "--resume")
    kept = load_checkpoint(last)
    assert kept.steps["ppo/updates"] == 1 and kept.steps["ppo/global_step"] == 16
    assert not (run_dir / "ppo.pt").exists() and not temp_files(run_dir)

    monkeypatch.undo()  # the fault is gone: the run continues from the kept checkpoint
    result = run(ppo_args(run_dir, "--resume"))
    assert result.exit_code == 0, result.output
    assert load_checkpoint(run_dir / "ppo.pt").steps["ppo/global_step"] == 64


def test_ppo_says_when_nothing_was_saved_yet(tmp_path, monkeypatch) -> None:
    import oakemu_rl.rl.losses as losses_module

    run_dir = tmp_path / "run"
    tiny_checkpoint(run_dir / "calibrated.pt", stage="calibrate")
    monkeypatch.setattr(losses_module, "value_loss", lambda *a, **k: torch.tensor(math.inf))
    failed_with(ppo_args(run_dir), "the PPO loss became", "at update 1",
                "no checkpoint was written by this run")
    assert not (run_dir / "ppo_last.pt").exists()


# -- read-only and full disks ----------------------------------------------------------------


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


def _can_mount() -> str | None:
    """None when this process may mount a tmpfs, else why not."""
    if os.geteuid() != 0:
        return "not root, so no tmpfs can be mounted"
    if shutil.which("mount") is None:
        return "no mount command"
    probe = Path(f"/tmp/oakemu-mount-probe-{uuid.uuid4().hex}")
    probe.mkdir()
    try:
        result = _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe))
        if result.returncode != 0:
            return f"mount -t tmpfs failed: {result.stderr.strip() or result.returncode}"
        subprocess.run(["umount", str(probe)], check=False)
        return None
    finally:
        probe.rmdir()


MOUNT_PROBLEM = _can_mount()


@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` for the block."""
    if MOUNT_PROBLEM is not None:
        print(f"skipped: {MOUNT_PROBLEM}")
        pytest.skip(MOUNT_PROBLEM)
    path.mkdir(parents=True, exist_ok=True)
    result = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    assert result.returncode == 0, result.stderr
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only(path: Path, populate=lambda folder: None):
    """`path` as a directory nobody can write to, after `populate(path)` filled it."""
    if os.geteuid() != 0:  # chmod is enough for anyone but root
        path.mkdir(parents=True, exist_ok=True)
        populate(path)
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with tmpfs(path, 8 << 20):
        populate(path)
        result = _mount("-o", "remount,ro", str(path))
        assert result.returncode == 0, result.stderr
        yield path


def listing(folder: Path) -> dict[str, str]:
    return {str(p): digest(p) for p in folder.rglob("*") if p.is_file()}


def test_a_read_only_run_directory_is_a_clear_error(demos, tmp_path) -> None:
    def populate(folder: Path) -> None:
        tiny_checkpoint(folder / "bc.pt")
        tiny_checkpoint(folder / "calibrated.pt", stage="calibrate")
        shutil.copyfile(demos[1], folder / "demos.h5")

    with read_only(tmp_path / "ro", populate) as ro:
        before = listing(ro)
        failed_with(bc_args(demos[1], ro, "--epochs", "1"), f"run directory {ro}",
                    "not writable")
        failed_with(calibrate_args(ro), f"cannot write metrics to {ro}")
        failed_with(ppo_args(ro), f"cannot write metrics to {ro}")
        failed_with(["record", "--demonstrator", "scripted", "--episodes", "1", "--max-steps",
                     "3", "--out", str(ro / "demos.h5")], f"cannot write {ro / 'demos.h5'}")
        failed_with(["export", "onnx", str(ro / "bc.pt"), "--out", str(ro / "x.onnx"),
                     "--verify-frames", "1"], f"cannot write {ro / 'x.onnx'}")
        assert listing(ro) == before  # nothing changed, nothing half-written
        assert len(validate_demo_file(ro / "demos.h5").episodes) == 1


def test_a_full_disk_keeps_the_previous_checkpoint(demos, tmp_path) -> None:
    """bc saves every epoch (one episode: no validation split); the second save needs room
    for the new file beside the old one, which the tmpfs does not have."""
    size = (tmp_path / "probe.pt")
    tiny_checkpoint(size)
    room = int(size.stat().st_size * 1.6) // 4096 * 4096
    with tmpfs(tmp_path / "full", room) as run_dir:
        failed_with(bc_args(demos[1], run_dir, "--epochs", "4"),
                    f"cannot write {run_dir / 'bc.pt'}", "No space left on device")
        assert load_checkpoint(run_dir / "bc.pt").steps["bc/epochs"] == 1
        assert not temp_files(run_dir)


def test_a_full_disk_mid_ppo_keeps_ppo_last_and_resumes(tmp_path) -> None:
    probe = tmp_path / "probe"
    tiny_checkpoint(probe / "calibrated.pt", stage="calibrate")
    assert run(ppo_args(probe, "--total-steps", "16")).exit_code == 0
    need = (probe / "calibrated.pt").stat().st_size + (probe / "ppo_last.pt").stat().st_size
    room = int(need * 1.5) // 4096 * 4096
    with tmpfs(tmp_path / "full", room) as run_dir:
        shutil.copyfile(probe / "calibrated.pt", run_dir / "calibrated.pt")
        failed_with(ppo_args(run_dir), f"cannot write {run_dir / 'ppo_last.pt'}",
                    "No space left on device")
        kept = load_checkpoint(run_dir / "ppo_last.pt")
        assert kept.steps["ppo/updates"] == 1 and not temp_files(run_dir)
        assert _mount("-o", f"remount,size={8 << 20}", str(run_dir)).returncode == 0
        result = run(ppo_args(run_dir, "--resume"))  # room again: training continues
        assert result.exit_code == 0, result.output
        assert load_checkpoint(run_dir / "ppo.pt").steps["ppo/global_step"] == 64


def test_a_full_disk_while_recording_keeps_every_committed_episode(tmp_path) -> None:
    with tmpfs(tmp_path / "full", 160 << 10) as folder:
        out = folder / "demos.h5"
        result = run(["record", "--demonstrator", "scripted", "--episodes", "200",
                      "--max-steps", "60", "--noise", "0.5", "--out", str(out)])
        assert result.exit_code != 0, result.output
        line = result.output.strip().splitlines()[-1]
        assert line.startswith(f"Error: cannot write {out}") and "No space left" in line, line
        kept = len(validate_demo_file(out).episodes)
        assert 0 < kept < 200
        assert not temp_files(folder)


def test_the_atomic_write_path_on_dev_full(tmp_path, monkeypatch) -> None:
    """Every temporary file written through fsutil goes to /dev/full (ENOSPC on write):
    the error is clear and the previous file is intact. Runs without root or mounts."""
    if not os.path.exists("/dev/full"):
        print("skipped: this machine has no /dev/full")
        pytest.skip("no /dev/full on this machine")
    good = tiny_checkpoint(tmp_path / "bc.pt")
    before = digest(good)
    real_open = builtins.open

    def full_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wa+") and ".tmp-" in Path(file).name:
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(fsutil, "open", full_open, raising=False)
    with pytest.raises(OakEmuError, match="No space left on device") as info:
        save_checkpoint(good, load_checkpoint(good))
    assert str(good) in str(info.value)
    with pytest.raises(OakEmuError, match="No space left on device"):
        fsutil.atomic_write_text(tmp_path / "note.txt", "x" * 100_000)
    assert digest(good) == before and not (tmp_path / "note.txt").exists()
    assert not temp_files(tmp_path)
