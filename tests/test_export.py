"""ONNX export on the real emulator and real onnxruntime: parity, metadata, play, failures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from builders import write_checkpoint

from oakemu_rl import __version__
from oakemu_rl import export as export_module
from oakemu_rl.agents import load_policy_agent
from oakemu_rl.agents.onnx import FORMAT, OnnxPolicyAgent, default_threads, load_onnx_agent
from oakemu_rl.checkpoint import load_checkpoint
from oakemu_rl.envs import EnvSpec, action_meanings
from oakemu_rl.errors import CheckpointError, ConfigError, OakEmuError
from oakemu_rl.export import ExportReport, collect_observations, export_onnx
from oakemu_rl.model import PPOModel, PPOModelConfiguration
from oakemu_rl.tester import EvalConfig, evaluate

FIRE = 1  # Pong's minimal actions: NOOP, FIRE, RIGHT, LEFT, RIGHTFIRE, LEFTFIRE

# A small trunk for speed; the Nature-CNN default (what ships) has its own parity test.
SMALL = PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(32,))


def _reactive(model: PPOModel, spec: EnvSpec) -> PPOModel:
    """Make a fresh model's greedy action depend on the frame, as a trained one's does.

    Pong frames differ in a few pixels, so an untrained net gives every frame the same
    argmax. Scaling the policy head so the logits' frame-to-frame spread is about 0.25, and
    centring its bias on the mean logits of some real frames, turns those few pixels into
    different actions.
    """
    x = torch.from_numpy(collect_observations(spec, 32, seed=99))
    with torch.no_grad():
        logits = model.get_logits(x)
        head = model.policy_head
        scale = 0.25 / float(logits.std(0).mean().clamp_min(1e-8))
        head.weight.mul_(scale)
        head.bias.mul_(scale)
        head.bias.sub_(model.get_logits(x).mean(0))
    return model


def _save(path: Path, spec: EnvSpec, config: PPOModelConfiguration = SMALL,
          model: PPOModel | None = None) -> Path:
    meanings = list(action_meanings(spec.game, spec.full_action_space))
    if model is None:
        torch.manual_seed(0)
        model = _reactive(PPOModel(spec.observation_shape, len(meanings), config), spec)
    return write_checkpoint(path, spec, model=model, steps={"epochs": 123})


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


class Recording:
    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.kind = agent.kind
        self.actions: list[int] = []

    def reset(self, env: Any, seed: int) -> None:
        self.agent.reset(env, seed)

    def act(self, env: Any, observation: np.ndarray) -> int:
        action = self.agent.act(env, observation)
        self.actions.append(int(action))
        return action


@pytest.fixture(scope="module")
def pong_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ExportReport]:
    folder = tmp_path_factory.mktemp("pong")
    checkpoint = _save(folder / "agent.pt", EnvSpec(game="pong"))
    out = folder / "agent.onnx"
    return checkpoint, out, export_onnx(checkpoint, out)


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    return collect_observations(EnvSpec(game="pong"), 64, seed=5)


# -- export and parity ---------------------------------------------------------------------


def test_export_writes_a_verified_file_and_reports_it(
    pong_export: tuple[Path, Path, ExportReport],
) -> None:
    _, out, report = pong_export
    assert out.is_file()
    assert _leftovers(out.parent) == []
    assert report.ok
    assert report.path == out
    assert report.bytes == out.stat().st_size
    assert report.frames == 64
    assert report.batch_sizes == (1, 64)
    assert 0 <= report.max_abs_diff <= report.tolerance == 1e-4
    assert report.agreeing_frames == 64 and report.actions_agree == 1.0
    assert report.opset == 17 and report.exporter == "torchscript"
    summary = report.summary()
    assert summary.startswith("verified onnxruntime against torch on 64 real Pong frames: ")
    assert "≤ 1e-04" in summary and summary.endswith("greedy actions agree on 64/64")
    assert report.to_dict()["actions_agree"] == 1.0
    # Nothing else was written beside it: one self-contained file.
    assert sorted(p.name for p in out.parent.iterdir()) == ["agent.onnx", "agent.pt"]


def test_metadata_carries_meanings_mask_spec(pong_export: tuple[Path, Path, ExportReport]) -> None:
    checkpoint_path, out, _ = pong_export
    checkpoint = load_checkpoint(checkpoint_path)
    proto = onnx.load(str(out))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["oakemu_rl_format"] == FORMAT == "policy-logits-v1"
    assert json.loads(meta["action_meanings"]) == checkpoint.action_meanings
    assert json.loads(meta["action_mask"]) == checkpoint.action_mask
    assert EnvSpec.from_json(meta["env_spec"]) == EnvSpec.from_dict(checkpoint.env_spec)
    assert json.loads(meta["observation_shape"]) == [4, 84, 84]
    assert meta["stage"] == "bc"
    assert json.loads(meta["steps"]) == {"bc/epochs": 123}
    assert meta["package_version"] == __version__
    assert PPOModelConfiguration.from_dict(json.loads(meta["model_config"])) == SMALL
    assert len(meta["checkpoint_sha256"]) == 64
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    onnx.checker.check_model(proto)


def test_graph_takes_uint8_with_a_dynamic_batch(
    pong_export: tuple[Path, Path, ExportReport], frames: np.ndarray
) -> None:
    checkpoint_path, out, _ = pong_export
    graph = onnx.load(str(out)).graph
    assert [i.name for i in graph.input] == ["observation"]
    tensor = graph.input[0].type.tensor_type
    assert tensor.elem_type == onnx.TensorProto.UINT8
    batch, *rest = tensor.shape.dim
    assert batch.dim_param and not batch.HasField("dim_value")
    assert [d.dim_value for d in rest] == [4, 84, 84]
    assert [o.name for o in graph.output] == ["logits"]
    out_batch, actions = graph.output[0].type.tensor_type.shape.dim
    assert out_batch.dim_param == batch.dim_param and actions.dim_value == 6
    # The uint8 -> float scaling is inside the graph.
    assert any(
        n.op_type == "Cast"
        and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in n.attribute)
        for n in graph.node
    )

    agent, _ = load_onnx_agent(out)
    model = load_checkpoint(checkpoint_path).build_model().eval()
    for size in (1, 7, 64):
        batch_frames = frames[:size]
        logits = agent.logits(batch_frames)
        assert logits.shape == (size, 6) and logits.dtype == np.float32
        with torch.no_grad():
            expected = model.get_logits(torch.from_numpy(batch_frames)).numpy()
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
        assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_default_nature_cnn_exports_with_parity(tmp_path: Path) -> None:
    checkpoint = _save(tmp_path / "nature.pt", EnvSpec(game="pong"), PPOModelConfiguration())
    out = tmp_path / "nature.onnx"
    report = export_onnx(checkpoint, out, verify_frames=32, seed=3)
    assert report.ok and report.frames == 32 and report.agreeing_frames == 32
    assert report.max_abs_diff <= 1e-4
    assert 6_000_000 < report.bytes == out.stat().st_size < 8_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nature.onnx", "nature.pt"]


# -- playing the export -------------------------------------------------------------------


def test_onnx_agent_plays_like_the_torch_agent(
    pong_export: tuple[Path, Path, ExportReport],
) -> None:
    checkpoint_path, out, _ = pong_export
    onnx_agent, spec = load_onnx_agent(out)
    assert isinstance(onnx_agent, OnnxPolicyAgent) and onnx_agent.kind == "policy"
    assert spec == EnvSpec(game="pong")
    torch_agent, torch_spec = load_policy_agent(checkpoint_path, device="cpu")
    assert torch_spec == spec

    config = EvalConfig(episodes=1, max_steps=50, seed=11)
    played_onnx, played_torch = Recording(onnx_agent), Recording(torch_agent)
    result_onnx = evaluate(played_onnx, spec, config, progress=False)
    result_torch = evaluate(played_torch, spec, config, progress=False)
    assert len(played_onnx.actions) == 50
    assert played_onnx.actions == played_torch.actions
    assert len(set(played_onnx.actions)) >= 2  # the comparison is not of a constant policy
    assert result_onnx.scores == result_torch.scores
    assert result_onnx.lengths == result_torch.lengths == [50]


def test_session_threads_suit_a_small_machine(
    pong_export: tuple[Path, Path, ExportReport],
) -> None:
    agent, _ = load_onnx_agent(pong_export[1])
    threads = agent.session.get_session_options().intra_op_num_threads
    assert 1 <= threads <= 4 and threads == default_threads()
    assert load_onnx_agent(pong_export[1], threads=1)[0].session \
        .get_session_options().intra_op_num_threads == 1


def test_the_mask_is_respected(tmp_path: Path) -> None:
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE",))
    torch.manual_seed(1)
    model = PPOModel(spec.observation_shape, 6, SMALL)
    with torch.no_grad():
        model.policy_head.bias[FIRE] = 100.0  # FIRE wins every unmasked argmax
    checkpoint = _save(tmp_path / "masked.pt", spec, model=model)
    out = tmp_path / "masked.onnx"
    export_onnx(checkpoint, out, verify_frames=16)

    agent, loaded_spec = load_onnx_agent(out)
    assert agent.mask.tolist() == [True, False, True, True, True, True]
    assert loaded_spec.forbidden_actions == ("FIRE",)
    recording = Recording(agent)
    evaluate(recording, loaded_spec, EvalConfig(episodes=1, max_steps=40), progress=False)
    assert len(recording.actions) == 40 and FIRE not in recording.actions
    observations = collect_observations(spec, 8, seed=2)
    assert (agent.logits(observations).argmax(-1) == FIRE).all()  # the bias is in the graph


# -- bad inputs -----------------------------------------------------------------------------


def test_a_corrupt_checkpoint_is_refused(tmp_path: Path) -> None:
    good = _save(tmp_path / "good.pt", EnvSpec(game="pong"))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[:2000])
    out = tmp_path / "bad.onnx"
    with pytest.raises(CheckpointError, match=r"bad\.pt"):
        export_onnx(bad, out)
    with pytest.raises(CheckpointError, match="does not exist"):
        export_onnx(tmp_path / "missing.pt", out)
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["text", "truncated", "no-metadata", "foreign-format",
                                  "damaged-json", "missing", "directory"])
def test_unusable_onnx_files_are_refused(
    kind: str, tmp_path: Path, pong_export: tuple[Path, Path, ExportReport]
) -> None:
    good = pong_export[1]
    path = tmp_path / f"{kind}.onnx"
    if kind == "text":
        path.write_text("this is not a model\n")
    elif kind == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "directory":
        path.mkdir()
    elif kind != "missing":
        proto = onnx.load(str(good))
        meta = {p.key: p.value for p in proto.metadata_props}
        del proto.metadata_props[:]
        if kind == "foreign-format":
            meta["oakemu_rl_format"] = "something-else"
        elif kind == "damaged-json":
            meta["action_mask"] = "[true, false"
        if kind != "no-metadata":
            onnx.helper.set_model_props(proto, meta)
        onnx.save(proto, str(path))
    with pytest.raises(OakEmuError) as caught:
        load_onnx_agent(path)
    message = str(caught.value)
    assert str(path) in message
    assert "\n" not in message and "Traceback" not in message


def test_a_model_that_is_not_a_policy_export_is_refused(tmp_path: Path) -> None:
    # A valid ONNX graph carrying our metadata, but not our graph: wrong input dtype.
    good = tmp_path / "good.onnx"
    export_onnx(_save(tmp_path / "good.pt", EnvSpec(game="pong")), good, verify_frames=4)
    meta = {p.key: p.value for p in onnx.load(str(good)).metadata_props}
    node = onnx.helper.make_node("Identity", ["observation"], ["logits"])
    graph = onnx.helper.make_graph(
        [node], "g",
        [onnx.helper.make_tensor_value_info("observation", onnx.TensorProto.FLOAT, [1, 6])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 6])],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.helper.set_model_props(proto, meta)
    path = tmp_path / "impostor.onnx"
    onnx.save(proto, str(path))
    with pytest.raises(OakEmuError, match=r"impostor\.onnx does not have the graph"):
        load_onnx_agent(path)


def test_failed_verification_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    checkpoint = _save(tmp_path / "agent.pt", EnvSpec(game="pong"))
    out = tmp_path / "agent.onnx"
    out.write_bytes(b"the previous export")
    real_export = torch.onnx.export

    def buggy_export(module: Any, *args: Any, **kwargs: Any) -> Any:
        # An exporter bug: the graph gets a different bias from the model torch runs.
        bias = module.model.policy_head.bias
        saved = bias.detach().clone()
        with torch.no_grad():
            bias[0] += 50.0
        try:
            return real_export(module, *args, **kwargs)
        finally:
            with torch.no_grad():
                bias.copy_(saved)

    monkeypatch.setattr(torch.onnx, "export", buggy_export)
    with pytest.raises(OakEmuError, match="failed verification") as caught:
        export_onnx(checkpoint, out, verify_frames=8)
    assert "agent.onnx was not written" in str(caught.value)
    assert out.read_bytes() == b"the previous export"
    assert _leftovers(tmp_path) == []


def test_an_interrupted_export_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    checkpoint = _save(tmp_path / "agent.pt", EnvSpec(game="pong"))
    out = tmp_path / "agent.onnx"

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "_verify", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(checkpoint, out, verify_frames=4)
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("options", "phrase"),
    [
        ({"tolerance": -1}, "tolerance"),
        ({"tolerance": float("nan")}, "tolerance"),
        ({"verify_frames": 0}, "verify_frames"),
        ({"opset": 3}, "opset"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_options_are_refused_before_writing(
    options: dict[str, Any], phrase: str, tmp_path: Path
) -> None:
    checkpoint = _save(tmp_path / "agent.pt", EnvSpec(game="pong"))
    with pytest.raises(ConfigError, match=phrase):
        export_onnx(checkpoint, tmp_path / "agent.onnx", **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.pt"]


def test_export_refuses_to_overwrite_its_checkpoint_or_a_directory(tmp_path: Path) -> None:
    checkpoint = _save(tmp_path / "agent.pt", EnvSpec(game="pong"))
    before = checkpoint.read_bytes()
    with pytest.raises(ConfigError, match="over itself"):
        export_onnx(checkpoint, checkpoint)
    with pytest.raises(ConfigError, match="directory"):
        export_onnx(checkpoint, tmp_path)
    assert checkpoint.read_bytes() == before and _leftovers(tmp_path) == []
