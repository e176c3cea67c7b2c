"""The one checkpoint format every stage reads and writes.

A checkpoint is a plain dict saved with `torch.save`: key `model` holds the state dict,
the other keys hold everything needed to rebuild and use the model without any other
file, and its lineage: the chain of stages that made it, each with its config, its steps
and the sha256 of the files it read. It is loaded with `torch.load(weights_only=True)`,
so a file can never run code, and written atomically, so a kill never leaves half a
checkpoint.
"""

from __future__ import annotations

import datetime as _dt
import io
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import __version__
from .envs.spec import actions_agree
from .errors import CheckpointError, EnvError
from .fsutil import atomic_write, sha256_file
from .model import PPOModel, PPOModelConfiguration

if TYPE_CHECKING:
    from .envs import EnvSpec

FORMAT = "oakemu-rl-checkpoint"
SCHEMA_VERSION = 2
"""2 added `lineage` and per-stage step names (`bc/updates`); version 1 files still load."""

STAGES = ("scratch", "bc", "calibrate", "ppo")


@dataclass
class Checkpoint:
    """A checkpoint in memory. `state_dict` is the model's; `extra` is stage state to resume
    (optimizer, RNG, counters), tensors and plain types only."""

    stage: str
    model_config: PPOModelConfiguration
    observation_shape: tuple[int, ...]
    action_meanings: list[str]
    action_mask: list[bool]
    env_spec: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    steps: dict[str, int] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    lineage: list[dict[str, Any]] = field(default_factory=list)
    """The stages that made this checkpoint, oldest first (see `lineage_entry`)."""
    package_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    created_at: str = ""

    @property
    def action_count(self) -> int:
        return len(self.action_meanings)

    @classmethod
    def from_model(
        cls,
        model: PPOModel,
        *,
        stage: str,
        action_meanings: list[str],
        action_mask: list[bool],
        env_spec: dict[str, Any],
        steps: dict[str, int] | None = None,
        config: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        parent: Checkpoint | None = None,
        inputs: list[str | Path] | tuple[str | Path, ...] = (),
    ) -> Checkpoint:
        """A checkpoint of `model` made by `stage` with `config`. `steps` are the stage's own
        counters (stored as `stage/name`, beside the parent's); the lineage is the parent's
        with this stage added, naming `inputs` (the files the stage read) by sha256."""
        state = plain_state_dict(model)
        own = {f"{stage}/{k}": int(v) for k, v in (steps or {}).items()}
        lineage = [*(parent.lineage if parent else []),
                   lineage_entry(stage, config or {}, own, inputs)]
        return cls(
            stage=stage,
            model_config=model.model_config,
            observation_shape=tuple(model.observation_shape),
            action_meanings=list(action_meanings),
            action_mask=[bool(v) for v in action_mask],
            env_spec=dict(env_spec),
            state_dict=state,
            steps={**(parent.steps if parent else {}), **own},
            config=dict(config or {}),
            extra=dict(extra or {}),
            lineage=lineage,
        )

    def build_model(self, device: torch.device | str = "cpu") -> PPOModel:
        """A `PPOModel` with this checkpoint's architecture and weights."""
        model = PPOModel(self.observation_shape, self.action_count, self.model_config)
        model.load_state_dict(self.state_dict)
        return model.to(device)

    def action_mask_tensor(self) -> torch.Tensor:
        return torch.tensor(self.action_mask, dtype=torch.bool)

    def to_payload(self) -> dict[str, Any]:
        payload = {
            "format": FORMAT,
            "schema_version": self.schema_version,
            "package_version": self.package_version,
            "created_at": self.created_at or _now(),
            "stage": self.stage,
            "model": self.state_dict,
            "model_config": self.model_config.to_dict(),
            "observation_shape": list(self.observation_shape),
            "action_count": self.action_count,
            "action_meanings": list(self.action_meanings),
            "action_mask": list(self.action_mask),
            "env_spec": self.env_spec,
            "steps": self.steps,
            "config": self.config,
            "extra": self.extra,
            "lineage": self.lineage,
        }
        _check_plain(payload, "checkpoint")
        return payload


def lineage_entry(stage: str, config: dict[str, Any], steps: dict[str, int],
                  inputs: list[str | Path] | tuple[str | Path, ...] = ()) -> dict[str, Any]:
    """One link of a lineage: the stage, its config, its steps, and each input file's
    resolved path and sha256 (so a later stage can find and check what an earlier read)."""
    return {
        "stage": stage,
        "config": config,
        "steps": steps,
        "inputs": [{"path": str(Path(p).resolve()), "sha256": sha256_file(p)} for p in inputs],
    }


def lineage_inputs(checkpoint: Checkpoint, stage: str) -> list[str]:
    """The input files of the latest `stage` in the checkpoint's lineage (e.g. the demo
    files bc.pt was trained on, found from calibrated.pt too); [] when there is none."""
    for entry in reversed(checkpoint.lineage):
        if entry.get("stage") == stage:
            return [item["path"] for item in entry.get("inputs", [])]
    return []


_V1_STEPS = {"epochs": "bc/epochs", "samples": "bc/samples",
             "calibrate_env_steps": "calibrate/env_steps",
             "calibrate_iterations": "calibrate/iterations", "global_step": "ppo/global_step"}


def _upgrade_v1(stage: str, steps: dict[str, int], config: dict[str, Any]
                ) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Per-stage step names and a one-link lineage for a schema-1 file. There `updates`
    meant BC's steps until PPO overwrote it with its own."""
    renamed = {}
    for key, value in steps.items():
        if key == "updates":
            renamed["ppo/updates" if stage == "ppo" else "bc/updates"] = value
        else:
            renamed[_V1_STEPS.get(key, key)] = value
    return renamed, [{"stage": stage, "config": config, "steps": renamed, "inputs": []}]


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the model's state in the default (NCHW) layout, whatever layout it
    trains in, so files never depend on the layout of the run that wrote them."""
    return {k: v.detach().cpu().clone(memory_format=torch.contiguous_format)
            for k, v in model.state_dict().items()}


def policy_differences(first: dict[str, torch.Tensor],
                       second: dict[str, torch.Tensor]) -> list[str]:
    """Names, sorted, of the tensors outside the value head that are not equal in the two
    state dicts (a name missing from one of them counts)."""
    return sorted(k for k in first.keys() | second.keys() if not k.startswith("value_head.")
                  and (k not in first or k not in second
                       or not torch.equal(first[k].cpu(), second[k].cpu())))


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Refuse to write anything `torch.load(weights_only=True)` would refuse to read."""
    if isinstance(value, (_PLAIN, torch.Tensor)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is not a str or int")
            _check_plain(item, f"{where}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(f"{where} holds a {type(value).__name__}; checkpoints take plain types only")


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> Path:
    """Write `checkpoint` to `path` atomically (temp file, fsync, rename)."""
    path = Path(path)
    payload = checkpoint.to_payload()
    for name, tensor in checkpoint.state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            # The loader refuses such a file: never replace a good one with it.
            raise CheckpointError(
                f"refusing to write {path}: the weights in {name} are not finite (training "
                "diverged); the file on disk is left as it was"
            )
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with atomic_write(path) as handle:
        handle.write(buffer.getbuffer())
    return path


def _require(payload: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    if key not in payload:
        raise CheckpointError(f"checkpoint {path} is damaged: it has no '{key}' entry")
    value = payload[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"checkpoint {path} is damaged: its '{key}' entry is malformed")
    return value


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read and validate a checkpoint; any problem raises `CheckpointError` naming the file."""
    path = Path(path)
    payload = _read_payload(path, map_location)
    schema = _check_header(payload, path)
    state = _require(payload, "model", dict, path)
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"checkpoint {path} is damaged: its weights are not tensors")
    try:
        model_config = PPOModelConfiguration.from_dict(
            _require(payload, "model_config", dict, path)
        )
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path} has an invalid model configuration: {error}") \
            from None
    obs_shape = _require(payload, "observation_shape", list, path)
    if len(obs_shape) != 3 or not all(isinstance(v, int) and v > 0 for v in obs_shape):
        raise CheckpointError(f"checkpoint {path} is damaged: bad observation shape {obs_shape}")
    meanings = _require(payload, "action_meanings", list, path)
    mask = _require(payload, "action_mask", list, path)
    if not actions_agree(meanings, mask) \
            or _require(payload, "action_count", int, path) != len(meanings):
        raise CheckpointError(
            f"checkpoint {path} is damaged: action count, meanings and mask disagree"
        )
    stage = _require(payload, "stage", str, path)
    steps, lineage = _steps_and_lineage(payload, schema, stage, path)
    checkpoint = Checkpoint(
        stage=stage,
        model_config=model_config,
        observation_shape=tuple(obs_shape),
        action_meanings=list(meanings),
        action_mask=list(mask),
        env_spec=_require(payload, "env_spec", dict, path),
        state_dict=state,
        steps=steps,
        config=_require(payload, "config", dict, path),
        extra=_require(payload, "extra", dict, path),
        lineage=lineage,
        package_version=_require(payload, "package_version", str, path),
        schema_version=schema,
        created_at=_require(payload, "created_at", str, path),
    )
    _check_weights_fit(checkpoint, path)
    return checkpoint


def _link_ok(link: Any) -> bool:
    """Whether one lineage entry has the shape `lineage_entry` writes."""
    return (isinstance(link, dict) and isinstance(link.get("stage"), str)
            and isinstance(link.get("config", {}), dict)
            and isinstance(link.get("steps", {}), dict)
            and all(isinstance(v, int) and not isinstance(v, bool)
                    for v in link.get("steps", {}).values())
            and isinstance(link.get("inputs", []), list)
            and all(isinstance(i, dict) and isinstance(i.get("path"), str)
                    and isinstance(i.get("sha256"), str) for i in link.get("inputs", [])))


def _read_payload(path: Path, map_location: str | torch.device) -> Any:
    """torch.load with `weights_only=True`, every failure turned into one clear line."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a checkpoint file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about foreign pickle protocols
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        # A pickle (or torch's zip of one) asking for more than plain data is refused as
        # such; a file of another kind (HDF5, text) only fails on its first "opcode".
        text = str(error).lower()
        if "weights only" in text and ("operand" not in text or _looks_pickled(path)):
            raise CheckpointError(
                f"refusing to load {path}: it holds Python objects beyond tensors and plain "
                "data, which could run code when unpickled"
            ) from None
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or foreign file)") \
            from None
    except PermissionError:
        raise CheckpointError(f"cannot read checkpoint {path}: permission denied") from None
    except Exception:  # torch raises many types for a file that is not its format
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or foreign file)") \
            from None


def _check_header(payload: Any, path: Path) -> int:
    """The format marker and a schema version this code reads; returns the version."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an OakEmu-RL checkpoint")
    schema = _require(payload, "schema_version", int, path)
    if schema > SCHEMA_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has schema version {schema}, newer than this OakEmu-RL "
            f"understands ({SCHEMA_VERSION}); upgrade oakemu-rl to read it"
        )
    if schema < 1:
        raise CheckpointError(f"checkpoint {path} is damaged: schema version {schema}")
    return schema


def _steps_and_lineage(payload: dict[str, Any], schema: int, stage: str, path: Path
                       ) -> tuple[dict[str, int], list[dict[str, Any]]]:
    steps = _require(payload, "steps", dict, path)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in steps.values()):
        raise CheckpointError(f"checkpoint {path} is damaged: its 'steps' entry is malformed")
    if schema == 1:
        return _upgrade_v1(stage, dict(steps), _require(payload, "config", dict, path))
    lineage = _require(payload, "lineage", list, path)
    if not all(_link_ok(e) for e in lineage):
        raise CheckpointError(f"checkpoint {path} is damaged: its 'lineage' is malformed")
    return dict(steps), lineage


def _looks_pickled(path: Path) -> bool:
    """True for a pickle (protocol 2+) or a zip archive, torch's two formats."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(2)
    except OSError:
        return False
    return head[:1] == b"\x80" or head == b"PK"


def _check_weights_fit(checkpoint: Checkpoint, path: Path) -> None:
    try:
        # On the meta device nothing is allocated: a file describing a huge model cannot
        # exhaust memory before its weights are compared with the description.
        with torch.device("meta"):
            model = PPOModel(checkpoint.observation_shape, checkpoint.action_count,
                             checkpoint.model_config)
    except (ValueError, RuntimeError, OverflowError, TypeError) as error:
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else "?"
        raise CheckpointError(f"checkpoint {path} describes a model that cannot be built: "
                              f"{first}") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(checkpoint.state_dict))
    unexpected = sorted(set(checkpoint.state_dict) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise CheckpointError(
            f"checkpoint {path}: its weights do not fit its model configuration ({what})"
        )
    for name, tensor in expected.items():
        stored = checkpoint.state_dict[name]
        if stored.shape != tensor.shape or stored.dtype != tensor.dtype:
            raise CheckpointError(
                f"checkpoint {path}: its weights do not fit its model configuration "
                f"({name} is {tuple(stored.shape)}, the configuration needs {tuple(tensor.shape)})"
            )
        if stored.is_floating_point() and not bool(torch.isfinite(stored).all()):
            raise CheckpointError(f"checkpoint {path} holds non-finite weights in {name}")


def checkpoint_spec(checkpoint: Checkpoint, path: str | Path) -> EnvSpec:
    """The checkpoint's env spec, refused if its game's actions or frames do not fit the model."""
    from .envs import EnvSpec, action_meanings

    try:
        spec = EnvSpec.from_dict(checkpoint.env_spec)
        meanings = list(action_meanings(spec))
    except EnvError as error:
        raise CheckpointError(f"checkpoint {path} has an unusable env spec: {error}") from None
    if meanings != list(checkpoint.action_meanings):
        raise CheckpointError(
            f"checkpoint {path} was made for the actions {', '.join(checkpoint.action_meanings)}"
            f", but {spec.game} has {', '.join(meanings)}"
        )
    if tuple(checkpoint.observation_shape) != spec.observation_shape:
        raise CheckpointError(
            f"checkpoint {path} expects observations of shape "
            f"{tuple(checkpoint.observation_shape)}, but its env spec gives "
            f"{spec.observation_shape}"
        )
    return spec


def load_model(path: str | Path, device: torch.device | str = "cpu") -> PPOModel:
    """Rebuild the `PPOModel` stored in `path` from that file alone."""
    return load_checkpoint(path).build_model(device)


def describe(checkpoint: Checkpoint) -> dict[str, Any]:
    """The metadata `oakemu info` prints."""
    params = sum(t.numel() for t in checkpoint.state_dict.values())
    pairs = zip(checkpoint.action_meanings, checkpoint.action_mask, strict=True)
    allowed = [m for m, ok in pairs if ok]
    return {
        "stage": checkpoint.stage,
        "steps": checkpoint.steps,
        "env": checkpoint.env_spec.get("env_id", "?"),
        "env_spec": checkpoint.env_spec,
        "observation_shape": list(checkpoint.observation_shape),
        "actions": checkpoint.action_count,
        "allowed_actions": allowed,
        "parameters": params,
        "parameter_megabytes": round(
            sum(t.numel() * t.element_size() for t in checkpoint.state_dict.values()) / 2**20, 2
        ),
        "model_config": checkpoint.model_config.to_dict(),
        "created_at": checkpoint.created_at,
        "package_version": checkpoint.package_version,
        "schema_version": checkpoint.schema_version,
        "lineage": [{"stage": e["stage"], "steps": e.get("steps", {}),
                     "inputs": e.get("inputs", [])} for e in checkpoint.lineage],
    }
