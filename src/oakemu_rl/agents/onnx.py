"""The onnxruntime engine: greedy play of a policy's logits on the CPU.

Two ways in: `OnnxPolicyAgent(path)` / `load_onnx_agent(path)` for a file written by
`oakemu export onnx` (its metadata names the actions, mask and env spec), and
`OnnxPolicyAgent.from_model(model, mask)` for a live model traced in memory. At batch 1 on
the CPU onnxruntime plays faster than eager torch (docs/results.md, "Greedy play speed").
Nothing in a file's metadata is ever used as a path.
"""

from __future__ import annotations

import copy
import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..envs import EnvSpec, action_meanings, actions_agree
from ..errors import EnvError, OakEmuError
from ..model import PPOModel
from ..runtime import usable_cpus

FORMAT_KEY = "oakemu_rl_format"


FORMAT = "policy-logits-v1"
"""Value of the `oakemu_rl_format` metadata entry in every file `export_onnx` writes."""


INPUT_NAME = "observation"


OUTPUT_NAME = "logits"


BATCH_DIM = "batch"


DEFAULT_OPSET = 17
"""Old enough for any onnxruntime >= 1.13, new enough for every op the model uses."""


_REQUIRED_METADATA = (
    FORMAT_KEY,
    "action_meanings",
    "action_mask",
    "env_spec",
    "observation_shape",
)


def default_threads() -> int:
    """onnxruntime intra-op threads: the CPUs this process may use, at most 4 (a batch-1
    policy gains nothing from more, and a small machine keeps a core for the emulator)."""
    return max(1, min(4, usable_cpus()))


def onnx_session(model_bytes: bytes, threads: int | None = None) -> Any:
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


def masked_softmax(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The policy's action probabilities: softmax over the last axis, zero where `mask` is
    False (computed in float64, so the probabilities sum to 1 closely enough to draw from)."""
    z = np.where(mask, np.asarray(logits, dtype=np.float64), -np.inf)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


class _Logits(nn.Module):
    """`PPOModel.get_logits` as a module's forward, for the tracer."""

    def __init__(self, model: PPOModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.get_logits(x)


def trace_logits(model: PPOModel, target: str | io.BytesIO, opset: int = DEFAULT_OPSET) -> None:
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


def _bad(path: Path, why: str) -> OakEmuError:
    return OakEmuError(f"{path} {why}")


def _json_entry(meta: dict[str, str], key: str, path: Path) -> Any:
    try:
        return json.loads(meta[key])
    except (TypeError, ValueError):
        raise _bad(path, f"has a damaged '{key}' metadata entry (not valid JSON)") from None


class OnnxPolicyAgent:
    """Plays an exported model greedily (argmax of the logits over the allowed actions) or,
    with `sample=True`, by drawing each action from the softmax over the allowed ones, from
    a generator seeded with each game's seed so that the same games replay the same actions.

    Follows the tester's Agent protocol (`kind`, `reset`, `act`). Build it with
    `load_onnx_agent(path)` or `OnnxPolicyAgent(path)`; both refuse, with `OakEmuError`
    naming the file, anything that is not an ONNX model written by `export_onnx`.
    """

    kind = "policy"

    def __init__(self, path: str | Path, *, threads: int | None = None,
                 sample: bool = False) -> None:
        self.path = path = Path(path)
        data, meta = _read_export(path)
        meanings, mask, shape, spec = _checked_metadata(meta, path)
        try:
            session = onnx_session(data, threads)
        except Exception as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise _bad(path, f"cannot be loaded by onnxruntime: {first_line[:200]}") from None
        _check_graph(session, shape, len(meanings), path)
        self._setup(data, session, mask, tuple(shape), spec=spec, meanings=tuple(meanings),
                    metadata=dict(meta), sample=sample)

    @classmethod
    def from_model(cls, model: PPOModel, action_mask: np.ndarray, *,
                   threads: int | None = None, sample: bool = False) -> OnnxPolicyAgent:
        """An agent for a live model (greedy, or drawing with `sample`): `get_logits` is
        traced in memory (no file, no metadata) and run by onnxruntime. On CPU at batch 1
        this plays faster than the torch model (benchmarks/greedy_play.py); the weights are
        the model's as they are now, so later training does not reach the agent."""
        buffer = io.BytesIO()
        plain = copy.deepcopy(model).cpu().to(memory_format=torch.contiguous_format).eval()
        trace_logits(plain, buffer)
        agent = cls.__new__(cls)
        agent.path = None
        agent._setup(buffer.getvalue(), onnx_session(buffer.getvalue(), threads), action_mask,
                     tuple(model.observation_shape), spec=None, meanings=(), metadata={},
                     sample=sample)
        return agent

    def _setup(self, model_bytes: bytes, session: Any, mask: Any, shape: tuple[int, ...], *,
               spec: EnvSpec | None, meanings: tuple[str, ...], metadata: dict[str, str],
               sample: bool) -> None:
        """Every attribute but `path`, in one place for both ways of building the agent."""
        self.model_bytes = model_bytes
        self.session = session
        self.spec = spec
        self.action_meanings = meanings
        self.mask = np.asarray(mask, dtype=bool)
        self.observation_shape = shape
        self.metadata = metadata
        self.sample = sample
        self.rng = np.random.default_rng(0)

    portable = True
    """`play_games` may play it in other processes: it travels as its model's bytes."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "session"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy in another process gets its own session, with that process's torch
        thread count (as `greedy_agent` gives the agents it builds)."""
        self.__dict__.update(state)
        self.session = onnx_session(self.model_bytes, torch.get_num_threads())

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
        self.rng = np.random.default_rng(seed)

    @property
    def plays_batches(self) -> bool:
        """Greedy play keeps no state between steps, so games can share forward passes."""
        return not self.sample

    def act_batch(self, observations: np.ndarray) -> np.ndarray:
        """Greedy actions for a batch of observations, one per game."""
        return masked_argmax(self.logits(observations), self.mask)

    def act(self, env: Any, observation: np.ndarray) -> int:
        if not self.sample:
            return int(self.act_batch(np.asarray(observation)[None])[0])
        logits = self.logits(np.asarray(observation)[None])[0]
        return int(self.rng.choice(logits.shape[-1], p=masked_softmax(logits, self.mask)))


def _read_export(path: Path) -> tuple[bytes, dict[str, str]]:
    """The file's bytes and metadata, refused unless it is a self-contained policy export."""
    import onnx
    from google.protobuf.message import DecodeError

    if not path.exists():
        raise _bad(path, "does not exist")
    if path.is_dir():
        raise _bad(path, "is a directory, not an ONNX model file")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise OakEmuError(f"cannot read {path}: {error.strerror or error}") from None
    not_onnx = "is not an ONNX model (corrupt, truncated or another kind of file)"
    try:
        proto = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError):
        raise _bad(path, not_onnx) from None
    if not proto.HasField("graph") or not proto.graph.node:
        raise _bad(path, not_onnx)
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
    return data, meta


def _checked_metadata(meta: dict[str, str], path: Path
                      ) -> tuple[list[str], list[bool], list[int], EnvSpec]:
    """Action meanings, mask, observation shape and env spec, consistent with each other."""
    meanings = _json_entry(meta, "action_meanings", path)
    mask = _json_entry(meta, "action_mask", path)
    shape = _json_entry(meta, "observation_shape", path)
    if not actions_agree(meanings, mask):
        raise _bad(path, "has damaged metadata: its action meanings and mask disagree")
    if not isinstance(shape, list) or len(shape) != 3 or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape
    ):
        raise _bad(path, f"has damaged metadata: bad observation shape {shape!r}")
    try:
        spec = EnvSpec.from_json(meta["env_spec"])
        game_meanings = list(action_meanings(spec))
    except EnvError as error:
        raise _bad(path, f"has an unusable env spec in its metadata: {error}") from None
    if game_meanings != meanings:
        raise _bad(path, f"was made for the actions {', '.join(meanings)}, but "
                         f"{spec.game} has {', '.join(game_meanings)}")
    if tuple(shape) != spec.observation_shape:
        raise _bad(path, f"expects observations of shape {tuple(shape)}, but its env "
                         f"spec gives {spec.observation_shape}")
    return meanings, mask, shape, spec


def _check_graph(session: Any, shape: list[int], actions: int, path: Path) -> None:
    """The graph takes uint8 frames of `shape` and gives `actions` logits per frame."""
    inputs, outputs = session.get_inputs(), session.get_outputs()
    names = ([i.name for i in inputs], [o.name for o in outputs])
    if names != ([INPUT_NAME], [OUTPUT_NAME]) or inputs[0].type != "tensor(uint8)":
        raise _bad(path, f"does not have the graph of a policy export (one uint8 input "
                         f"'{INPUT_NAME}', one output '{OUTPUT_NAME}')")
    if list(inputs[0].shape[1:]) != list(shape):
        raise _bad(path, f"takes inputs of shape {inputs[0].shape}, but its metadata "
                         f"says {shape}")
    if outputs[0].shape[1:] != [actions]:
        raise _bad(path, f"gives {outputs[0].shape[1:]} logits per frame, but its "
                         f"metadata lists {actions} actions")


def load_onnx_agent(
    path: str | Path, *, threads: int | None = None, sample: bool = False
) -> tuple[OnnxPolicyAgent, EnvSpec]:
    """A greedy (or, with `sample`, sampling) `OnnxPolicyAgent` for an exported model, and
    the env spec it was made for."""
    agent = OnnxPolicyAgent(path, threads=threads, sample=sample)
    return agent, agent.spec
