"""Export a checkpoint's policy to ONNX, verified on real emulator frames, and play it back.

`export_onnx(checkpoint, out)` writes ONE self-contained .onnx file holding `get_logits`:
input "observation" is the stacked uint8 frame batch, shape (batch, *observation_shape)
with a dynamic batch dimension, and the uint8 → [0, 1] scaling happens inside the graph;
output "logits" has shape (batch, actions). The model's `metadata_props` carry what a
player needs (action meanings, action mask, env spec, observation shape) as JSON, under
the format marker `oakemu_rl_format = policy-logits-v1`.

The file is written beside `out` first, checked with onnxruntime against torch on real
frames of the checkpoint's game (batch 1 and the whole set), and only then renamed over
`out`: a failed or interrupted export never leaves a half-written or unverified file.

`load_onnx_agent(path)` gives a greedy `OnnxPolicyAgent` (the tester's Agent protocol)
and the env spec from the file's metadata. Nothing in the metadata is ever used as a path.

The exporter is torch's TorchScript-based one (`torch.onnx.export(..., dynamo=False)`):
the torch.export-based one needs the extra `onnxscript` package, and this small
convolutional graph exports identically with either.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import hashlib
import io
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import __version__
from .checkpoint import Checkpoint, checkpoint_spec, load_checkpoint
from .envs import EnvSpec, action_meanings, make_env
from .errors import ConfigError, EnvError, OakEmuError
from .fsutil import commit, temp_beside
from .model import PPOModel

FORMAT_KEY = "oakemu_rl_format"
FORMAT = "policy-logits-v1"
"""Value of the `oakemu_rl_format` metadata entry in every file `export_onnx` writes."""
INPUT_NAME = "observation"
OUTPUT_NAME = "logits"
BATCH_DIM = "batch"
EXPORTER = "torchscript"
"""`torch.onnx.export(..., dynamo=False)`; needs nothing beyond torch and onnx."""
DEFAULT_OPSET = 17
"""Old enough for any onnxruntime >= 1.13, new enough for every op the model uses."""
MIN_OPSET, MAX_OPSET = 9, 20
"""Opsets the TorchScript exporter writes (torch.onnx._constants)."""

_REQUIRED_METADATA = (
    FORMAT_KEY,
    "action_meanings",
    "action_mask",
    "env_spec",
    "observation_shape",
)


# -- threads and sessions -------------------------------------------------------------------


def default_threads() -> int:
    """onnxruntime intra-op threads: the CPUs this process may use, at most 4 (a batch-1
    policy gains nothing from more, and a small machine keeps a core for the emulator)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _session(model_bytes: bytes, threads: int | None = None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: no optimizer chatter on the terminal
    return ort.InferenceSession(model_bytes, sess_options=options,
                                providers=["CPUExecutionProvider"])


def masked_argmax(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Greedy actions over the allowed ones: argmax over the last axis where `mask` is True
    (ties go to the lowest index, as torch's argmax does)."""
    return np.where(mask, logits, -np.inf).argmax(axis=-1)


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


class _Logits(nn.Module):
    """`PPOModel.get_logits` as a module's forward, for the tracer."""

    def __init__(self, model: PPOModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.get_logits(x)


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


def _check_options(opset: int | None, verify_frames: int, tolerance: float, seed: int) -> int:
    opset = DEFAULT_OPSET if opset is None else opset
    if isinstance(opset, bool) or not isinstance(opset, int) \
            or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ConfigError(
            f"opset must be an integer from {MIN_OPSET} to {MAX_OPSET}, got {opset!r}"
        )
    if isinstance(verify_frames, bool) or not isinstance(verify_frames, int) \
            or verify_frames < 1:
        raise ConfigError(
            f"verify_frames must be a positive integer, got {verify_frames!r}"
        )
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
            or not math.isfinite(tolerance) or tolerance < 0:
        raise ConfigError(f"tolerance must be a finite number ≥ 0, got {tolerance!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    return opset


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _trace(model: PPOModel, target: str | io.BytesIO, opset: int = DEFAULT_OPSET) -> None:
    """Trace `get_logits` (uint8 frames in, logits out, dynamic batch) into `target`."""
    example = torch.zeros((2, *model.observation_shape), dtype=torch.uint8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        torch.onnx.export(
            _Logits(model).eval(),
            (example,),
            target,
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: BATCH_DIM}, OUTPUT_NAME: {0: BATCH_DIM}},
            opset_version=opset,
            do_constant_folding=True,
            export_params=True,
        )


def _write_onnx(model: PPOModel, tmp: Path, opset: int, metadata: dict[str, str]) -> None:
    """Trace `get_logits` into `tmp`, then add the metadata (one file, no external data)."""
    import onnx

    _trace(model, str(tmp), opset)
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
    session = _session(model_bytes)
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
    opset = _check_options(opset, verify_frames, tolerance, seed)
    if target.is_dir():
        raise ConfigError(f"cannot write the ONNX model to {target}: it is a directory")
    if source.exists() and target.exists() and os.path.samefile(source, target):
        raise ConfigError(f"refusing to export {source} over itself; choose another --out")
    loaded = load_checkpoint(source)
    spec = checkpoint_spec(loaded, source)
    mask = np.asarray(loaded.action_mask, dtype=bool)
    model = loaded.build_model("cpu").eval()
    metadata = _metadata(loaded, spec, _sha256(source))
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


# -- playing an exported model ---------------------------------------------------------------


def _bad(path: Path, why: str) -> OakEmuError:
    return OakEmuError(f"{path} {why}")


def _json_entry(meta: dict[str, str], key: str, path: Path) -> Any:
    try:
        return json.loads(meta[key])
    except (TypeError, ValueError):
        raise _bad(path, f"has a damaged '{key}' metadata entry (not valid JSON)") from None


class OnnxPolicyAgent:
    """Plays an exported model greedily: argmax of the logits over the allowed actions.

    Follows the tester's Agent protocol (`kind`, `reset`, `act`). Build it with
    `load_onnx_agent(path)` or `OnnxPolicyAgent(path)`; both refuse, with `OakEmuError`
    naming the file, anything that is not an ONNX model written by `export_onnx`.
    """

    kind = "policy"

    def __init__(self, path: str | Path, *, threads: int | None = None) -> None:
        import onnx
        from google.protobuf.message import DecodeError

        self.path = path = Path(path)
        if not path.exists():
            raise _bad(path, "does not exist")
        if path.is_dir():
            raise _bad(path, "is a directory, not an ONNX model file")
        try:
            data = path.read_bytes()
        except OSError as error:
            raise OakEmuError(f"cannot read {path}: {error.strerror or error}") from None
        try:
            proto = onnx.load_model_from_string(data)
        except (DecodeError, ValueError, RuntimeError):
            raise _bad(path, "is not an ONNX model (corrupt, truncated or another kind of "
                             "file)") from None
        if not proto.HasField("graph") or not proto.graph.node:
            raise _bad(path, "is not an ONNX model (corrupt, truncated or another kind of "
                             "file)")
        meta = {entry.key: entry.value for entry in proto.metadata_props}
        if meta.get(FORMAT_KEY) != FORMAT:
            found = meta.get(FORMAT_KEY)
            what = f"format {found!r}, not {FORMAT!r}" if found else "no OakEmu-RL metadata"
            raise _bad(path, f"is not an OakEmu-RL policy export ({what}); export one with "
                             "`oakemu export onnx`")
        missing = [key for key in _REQUIRED_METADATA if key not in meta]
        if missing:
            raise _bad(path, f"lacks the '{missing[0]}' metadata entry; re-export it")
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
            raise _bad(path, "refers to external weight files; OakEmu-RL exports are one "
                             "self-contained file")

        meanings = _json_entry(meta, "action_meanings", path)
        mask = _json_entry(meta, "action_mask", path)
        shape = _json_entry(meta, "observation_shape", path)
        if (
            not isinstance(meanings, list)
            or not isinstance(mask, list)
            or not meanings
            or len(meanings) != len(mask)
            or not all(isinstance(m, str) for m in meanings)
            or not all(isinstance(m, bool) for m in mask)
            or not any(mask)
        ):
            raise _bad(path, "has damaged metadata: its action meanings and mask disagree")
        if not isinstance(shape, list) or len(shape) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape
        ):
            raise _bad(path, f"has damaged metadata: bad observation shape {shape!r}")
        try:
            spec = EnvSpec.from_json(meta["env_spec"])
            game_meanings = list(action_meanings(spec.game, spec.full_action_space))
        except EnvError as error:
            raise _bad(path, f"has an unusable env spec in its metadata: {error}") from None
        if game_meanings != meanings:
            raise _bad(path, f"was made for the actions {', '.join(meanings)}, but "
                             f"{spec.game} has {', '.join(game_meanings)}")
        if tuple(shape) != spec.observation_shape:
            raise _bad(path, f"expects observations of shape {tuple(shape)}, but its env "
                             f"spec gives {spec.observation_shape}")

        try:
            session = _session(data, threads)
        except Exception as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise _bad(path, f"cannot be loaded by onnxruntime: {first_line[:200]}") from None
        inputs, outputs = session.get_inputs(), session.get_outputs()
        names = ([i.name for i in inputs], [o.name for o in outputs])
        if names != ([INPUT_NAME], [OUTPUT_NAME]) or inputs[0].type != "tensor(uint8)":
            raise _bad(path, f"does not have the graph of a policy export (one uint8 input "
                             f"'{INPUT_NAME}', one output '{OUTPUT_NAME}')")
        if [d for d in inputs[0].shape[1:]] != list(shape):
            raise _bad(path, f"takes inputs of shape {inputs[0].shape}, but its metadata "
                             f"says {shape}")
        if outputs[0].shape[1:] != [len(meanings)]:
            raise _bad(path, f"gives {outputs[0].shape[1:]} logits per frame, but its "
                             f"metadata lists {len(meanings)} actions")

        self.session = session
        self.spec = spec
        self.action_meanings = tuple(meanings)
        self.mask = np.asarray(mask, dtype=bool)
        self.observation_shape = tuple(shape)
        self.metadata = dict(meta)

    @classmethod
    def from_model(cls, model: PPOModel, action_mask: np.ndarray, *,
                   threads: int | None = None) -> OnnxPolicyAgent:
        """A greedy agent for a live model: `get_logits` is traced in memory (no file, no
        metadata) and run by onnxruntime. On CPU at batch 1 this plays faster than the
        torch model (benchmarks/greedy_play.py); the weights are the model's as they are
        now, so later training does not reach the agent."""
        buffer = io.BytesIO()
        _trace(copy.deepcopy(model).cpu().to(memory_format=torch.contiguous_format).eval(),
               buffer)
        agent = cls.__new__(cls)
        agent.path = None
        agent.session = _session(buffer.getvalue(), threads)
        agent.spec = None
        agent.action_meanings = ()
        agent.mask = np.asarray(action_mask, dtype=bool)
        agent.observation_shape = tuple(model.observation_shape)
        agent.metadata = {}
        return agent

    def logits(self, observations: np.ndarray) -> np.ndarray:
        """Raw logits, shape (batch, actions), for uint8 observations (batch, *shape)."""
        x = np.ascontiguousarray(observations)
        if x.dtype != np.uint8 or x.shape[1:] != self.observation_shape:
            raise ValueError(
                f"observations must be uint8 of shape (batch, {self.observation_shape}), "
                f"got {x.dtype} {x.shape}"
            )
        return self.session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]

    def reset(self, env: Any, seed: int) -> None:
        pass  # greedy play: no state, no randomness

    def act(self, env: Any, observation: np.ndarray) -> int:
        logits = self.logits(np.asarray(observation)[None])
        return int(masked_argmax(logits[0], self.mask))


def load_onnx_agent(
    path: str | Path, *, threads: int | None = None
) -> tuple[OnnxPolicyAgent, EnvSpec]:
    """A greedy `OnnxPolicyAgent` for an exported model, and the env spec it was made for."""
    agent = OnnxPolicyAgent(path, threads=threads)
    return agent, agent.spec
