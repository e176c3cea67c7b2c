"""Stage: export a checkpoint's policy to ONNX, verified on real emulator frames.

`export_onnx(checkpoint, out)` writes ONE self-contained .onnx file holding `get_logits`:
input "observation" is the stacked uint8 frame batch, shape (batch, *observation_shape)
with a dynamic batch dimension, and the uint8 → [0, 1] scaling happens inside the graph;
output "logits" has shape (batch, actions). The model's `metadata_props` carry what a
player needs (action meanings, action mask, env spec, observation shape) as JSON, under
the format marker `oakemu_rl_format = policy-logits-v1`.

The file is written beside `out` first, checked with onnxruntime against torch on real
frames of the checkpoint's game (batch 1 and the whole set), and only then renamed over
`out`: a failed or interrupted export never leaves a half-written or unverified file.

Playing a file back is the playing layer's job (`oakemu_rl.agents.onnx`); this module
only writes and verifies files.

The exporter is torch's TorchScript-based one (`torch.onnx.export(..., dynamo=False)`):
the torch.export-based one needs the extra `onnxscript` package, and this small
convolutional graph exports identically with either.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import __version__
from .agents.onnx import (
    DEFAULT_OPSET,
    FORMAT,
    FORMAT_KEY,
    INPUT_NAME,
    OUTPUT_NAME,
    masked_argmax,
    onnx_session,
    trace_logits,
)
from .checkpoint import Checkpoint, checkpoint_spec, load_checkpoint
from .configs import check_options
from .envs import EnvSpec, make_env
from .errors import ConfigError, OakEmuError
from .fsutil import commit, sha256_file, temp_beside
from .model import PPOModel
from .runtime import SEED_MAX

EXPORTER = "torchscript"
"""`torch.onnx.export(..., dynamo=False)`; needs nothing beyond torch and onnx."""
MIN_OPSET, MAX_OPSET = 9, 20
"""Opsets the TorchScript exporter writes (torch.onnx._constants)."""

# -- export --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportReport:
    """What `export_onnx` wrote and how it was verified."""

    path: Path
    bytes: int
    game: str
    frames: int
    """Real emulator observations both runtimes were run on."""
    batch_sizes: tuple[int, ...]
    """Batch sizes onnxruntime ran (each frame alone, then all at once)."""
    max_abs_diff: float
    """Largest |onnxruntime logit - torch logit| over every frame, batch size and action."""
    agreeing_frames: int
    """Frames on which the greedy (masked argmax) actions of both runtimes agree."""
    tolerance: float
    opset: int
    exporter: str
    ok: bool

    @property
    def actions_agree(self) -> float:
        """Fraction of frames on which the greedy actions agree."""
        return self.agreeing_frames / self.frames if self.frames else math.nan

    def summary(self) -> str:
        sign = "≤" if self.max_abs_diff <= self.tolerance else ">"
        return (
            f"verified onnxruntime against torch on {self.frames} real {self.game} frames: "
            f"max |Δlogit| {self.max_abs_diff:.1e} {sign} {self.tolerance:.0e}, "
            f"greedy actions agree on {self.agreeing_frames}/{self.frames}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "bytes": self.bytes,
            "game": self.game,
            "frames": self.frames,
            "batch_sizes": list(self.batch_sizes),
            "max_abs_diff": self.max_abs_diff,
            "actions_agree": self.actions_agree,
            "agreeing_frames": self.agreeing_frames,
            "tolerance": self.tolerance,
            "opset": self.opset,
            "exporter": self.exporter,
            "ok": self.ok,
        }


def _display_game(spec: EnvSpec) -> str:
    return "".join(part.capitalize() for part in spec.game.split("_"))


def collect_observations(
    spec: EnvSpec, count: int, *, seed: int = 0, mask: np.ndarray | None = None
) -> np.ndarray:
    """`count` stacked uint8 observations, shape (count, *observation_shape), from playing
    `spec` with seeded random (allowed) actions; a finished episode restarts with seed + 1."""
    rng = np.random.default_rng(seed)
    env = make_env(spec)
    try:
        allowed = np.flatnonzero(mask) if mask is not None else np.arange(env.action_space.n)
        episode_seed = seed
        observation, _ = env.reset(seed=episode_seed)
        frames = [observation]
        while len(frames) < count:
            observation, _, terminated, truncated, _ = env.step(int(rng.choice(allowed)))
            if terminated or truncated:
                episode_seed += 1
                observation, _ = env.reset(seed=episode_seed)
            frames.append(observation)
    finally:
        env.close()
    return np.ascontiguousarray(np.stack(frames[:count]), dtype=np.uint8)


@dataclass(frozen=True)
class _ExportOptions:
    """The export's settings, checked like every stage's options."""

    opset: int
    verify_frames: int
    tolerance: float
    seed: int

    def __post_init__(self) -> None:
        check_options(self, [
            ("opset", MIN_OPSET <= self.opset <= MAX_OPSET, f"from {MIN_OPSET} to {MAX_OPSET}"),
            ("verify_frames", self.verify_frames >= 1, "≥ 1"),
            ("tolerance", self.tolerance >= 0, "≥ 0"),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
        ], stage="export")


def _metadata(checkpoint: Checkpoint, spec: EnvSpec, digest: str) -> dict[str, str]:
    return {
        FORMAT_KEY: FORMAT,
        "action_meanings": json.dumps(list(checkpoint.action_meanings)),
        "action_mask": json.dumps([bool(v) for v in checkpoint.action_mask]),
        "env_spec": spec.to_json(),
        "observation_shape": json.dumps(list(checkpoint.observation_shape)),
        "stage": checkpoint.stage,
        "steps": json.dumps(checkpoint.steps, sort_keys=True),
        "model_config": json.dumps(checkpoint.model_config.to_dict(), sort_keys=True),
        "package_version": __version__,
        "checkpoint_package_version": checkpoint.package_version,
        "checkpoint_created_at": checkpoint.created_at,
        "checkpoint_sha256": digest,
        "exported_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "exporter": f"torch {torch.__version__} ({EXPORTER})",
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
    }


def _write_onnx(model: PPOModel, tmp: Path, opset: int, metadata: dict[str, str]) -> None:
    """Trace `get_logits` into `tmp`, then add the metadata (one file, no external data)."""
    import onnx

    trace_logits(model, str(tmp), opset)
    proto = onnx.load(str(tmp), load_external_data=False)
    proto.producer_name = "oakemu-rl"
    proto.producer_version = __version__
    proto.doc_string = (
        "OakEmu-RL policy: uint8 stacked frames (batch, *observation_shape) -> action logits "
        "(batch, actions); greedy play takes the argmax over the actions action_mask allows."
    )
    del proto.metadata_props[:]
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(proto)
    with open(tmp, "wb") as handle:
        handle.write(proto.SerializeToString())


def _verify(
    model_bytes: bytes,
    model: PPOModel,
    mask: np.ndarray,
    frames: np.ndarray,
) -> tuple[float, int, tuple[int, ...]]:
    """(max |Δlogit|, frames whose greedy actions agree in every run, batch sizes run)."""
    session = onnx_session(model_bytes)
    with torch.no_grad():
        reference = model.eval().get_logits(torch.from_numpy(frames)).numpy()
    runs = [np.concatenate([session.run([OUTPUT_NAME], {INPUT_NAME: frames[i:i + 1]})[0]
                            for i in range(len(frames))])]
    batch_sizes = [1]
    if len(frames) > 1:
        runs.append(session.run([OUTPUT_NAME], {INPUT_NAME: frames})[0])
        batch_sizes.append(len(frames))
    expected = masked_argmax(reference, mask)
    diff, agree = 0.0, np.ones(len(frames), dtype=bool)
    for logits in runs:
        if logits.shape != reference.shape or not np.isfinite(logits).all():
            return math.inf, 0, tuple(batch_sizes)
        diff = max(diff, float(np.abs(logits.astype(np.float64) - reference).max()))
        agree &= masked_argmax(logits, mask) == expected
    return diff, int(agree.sum()), tuple(batch_sizes)


def export_onnx(
    checkpoint: str | Path,
    out: str | Path,
    *,
    opset: int | None = None,
    verify_frames: int = 64,
    tolerance: float = 1e-4,
    seed: int = 0,
) -> ExportReport:
    """Write the checkpoint's policy logits to `out` as one verified .onnx file.

    Verification plays the checkpoint's env spec with seeded random allowed actions for
    `verify_frames` observations and runs onnxruntime (CPU) on each alone and on all at
    once: every logit must be within `tolerance` of torch's, and the greedy masked
    actions must agree on every frame. Otherwise `OakEmuError` is raised and `out` is left
    as it was. A bad checkpoint raises `CheckpointError`; bad options `ConfigError`.
    """
    source, target = Path(checkpoint), Path(out)
    opset = DEFAULT_OPSET if opset is None else opset
    _ExportOptions(opset, verify_frames, tolerance, seed)
    if target.is_dir():
        raise ConfigError(f"cannot write the ONNX model to {target}: it is a directory")
    if source.exists() and target.exists() and os.path.samefile(source, target):
        raise ConfigError(f"refusing to export {source} over itself; choose another --out")
    loaded = load_checkpoint(source)
    spec = checkpoint_spec(loaded, source)
    mask = np.asarray(loaded.action_mask, dtype=bool)
    model = loaded.build_model("cpu").eval()
    metadata = _metadata(loaded, spec, sha256_file(source))
    frames = collect_observations(spec, verify_frames, seed=seed, mask=mask)

    tmp = temp_beside(target, suffix=".onnx")
    try:
        try:
            _write_onnx(model, tmp, opset, metadata)
        except Exception as error:
            raise OakEmuError(
                f"torch could not export {source} to ONNX (opset {opset}): {error}"
            ) from None
        model_bytes = tmp.read_bytes()
        try:
            diff, agreeing, batch_sizes = _verify(model_bytes, model, mask, frames)
        except Exception as error:
            raise OakEmuError(
                f"onnxruntime could not run the ONNX export of {source}, so {target} was not "
                f"written: {error}"
            ) from None
        report = ExportReport(
            path=target,
            bytes=len(model_bytes),
            game=_display_game(spec),
            frames=len(frames),
            batch_sizes=batch_sizes,
            max_abs_diff=diff,
            agreeing_frames=agreeing,
            tolerance=float(tolerance),
            opset=opset,
            exporter=EXPORTER,
            ok=diff <= tolerance and agreeing == len(frames),
        )
        if not report.ok:
            raise OakEmuError(
                f"the ONNX export of {source} failed verification, so {target} was not "
                f"written: on {report.frames} real {report.game} frames max |Δlogit| is "
                f"{diff:.1e} (tolerance {tolerance:.0e}) and greedy actions agree on "
                f"{agreeing}/{report.frames}"
            )
        commit(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return report


