"""Checkpoint round trip, and every way a checkpoint can be unusable, through the CLI."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from oakemu_rl import PPOModel, PPOModelConfiguration
from oakemu_rl.checkpoint import (
    FORMAT,
    SCHEMA_VERSION,
    Checkpoint,
    lineage_inputs,
    load_checkpoint,
    load_model,
    plain_state_dict,
    policy_differences,
    save_checkpoint,
)
from oakemu_rl.cli import cli
from oakemu_rl.envs import EnvSpec
from oakemu_rl.errors import CheckpointError
from oakemu_rl.fsutil import sha256_file

MEANINGS = ["NOOP", "FIRE", "RIGHT", "LEFT", "RIGHTFIRE", "LEFTFIRE"]
SMALL = PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(32,))


def make_checkpoint(config: PPOModelConfiguration = SMALL) -> Checkpoint:
    torch.manual_seed(0)
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE",))
    model = PPOModel(spec.observation_shape, len(MEANINGS), config)
    return Checkpoint.from_model(
        model,
        stage="bc",
        action_meanings=MEANINGS,
        action_mask=[m != "FIRE" for m in MEANINGS],
        env_spec=spec.to_dict(),
        steps={"epochs": 3, "samples": 1200},
        config={"lr": 3e-4, "batch_size": 64, "augment": True},
        extra={"optimizer": {"step": torch.tensor(5.0)}},
    )


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "bc.pt", make_checkpoint())


def test_round_trip_rebuilds_the_same_model(saved: Path) -> None:
    original = make_checkpoint()
    loaded = load_checkpoint(saved)
    assert loaded.stage == "bc"
    assert loaded.model_config == SMALL
    assert loaded.observation_shape == (4, 84, 84)
    assert loaded.action_meanings == MEANINGS
    assert loaded.action_mask == [True, False, True, True, True, True]
    assert loaded.env_spec == original.env_spec
    assert EnvSpec.from_dict(loaded.env_spec) == EnvSpec(game="pong", forbidden_actions=("FIRE",))
    assert loaded.steps == {"bc/epochs": 3, "bc/samples": 1200}
    assert loaded.config == {"lr": 3e-4, "batch_size": 64, "augment": True}
    assert loaded.lineage == [{"stage": "bc", "config": {"lr": 3e-4, "batch_size": 64,
                                                          "augment": True},
                               "steps": {"bc/epochs": 3, "bc/samples": 1200}, "inputs": []}]
    assert loaded.schema_version == SCHEMA_VERSION
    assert torch.equal(loaded.extra["optimizer"]["step"], torch.tensor(5.0))
    model = load_model(saved)
    x = torch.randint(0, 256, (2, 4, 84, 84), dtype=torch.uint8)
    reference = original.build_model()
    assert torch.equal(model.get_logits(x), reference.get_logits(x))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor)


def test_payload_is_plain_and_loads_weights_only(saved: Path) -> None:
    payload = torch.load(saved, weights_only=True)
    assert set(payload) >= {
        "model", "model_config", "observation_shape", "action_count", "action_meanings",
        "action_mask", "env_spec", "stage", "steps", "config", "schema_version",
        "package_version",
    }
    assert payload["action_count"] == 6
    json.dumps({k: v for k, v in payload.items() if k not in ("model", "extra")})


def test_non_plain_values_are_refused_before_writing(tmp_path: Path) -> None:
    ckpt = make_checkpoint()
    ckpt.config["path"] = Path("/tmp")
    with pytest.raises(TypeError, match="plain types"):
        save_checkpoint(tmp_path / "x.pt", ckpt)
    assert not (tmp_path / "x.pt").exists()
    assert list(tmp_path.iterdir()) == []


def test_save_is_atomic_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "c.pt"
    save_checkpoint(target, make_checkpoint())
    second = make_checkpoint()
    second.stage = "calibrate"
    save_checkpoint(target, second)
    assert load_checkpoint(target).stage == "calibrate"
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp files left


def test_a_kill_while_saving_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "c.pt"
    save_checkpoint(target, make_checkpoint())
    before = target.read_bytes()
    # The child starts writing a large checkpoint over the same path and is killed at once.
    script = (
        "import os, signal, torch\n"
        "from oakemu_rl import fsutil\n"
        f"with fsutil.atomic_write({str(target)!r}) as f:\n"
        "    f.write(b'x' * 1000)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False)
    assert proc.returncode == -9
    assert target.read_bytes() == before
    load_checkpoint(target)


# -- errors, each through the CLI ----------------------------------------------------------


def run_info(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["info", str(path)])
    return result.exit_code, result.output


def assert_clear_error(path: Path, phrase: str) -> None:
    code, output = run_info(path)
    assert code != 0, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert "Traceback" not in output
    assert str(path) in lines[0] and phrase in lines[0], lines[0]
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_info_prints_metadata(saved: Path) -> None:
    code, output = run_info(saved)
    assert code == 0, output
    assert re.search(r"^stage +bc$", output, re.M)
    assert re.search(r"^steps +bc/epochs=3, bc/samples=1,200$", output, re.M)
    assert "ALE/Pong-v5" in output
    assert "6 (5 allowed: NOOP, RIGHT, LEFT, RIGHTFIRE, LEFTFIRE)" in output
    params = sum(t.numel() for t in make_checkpoint().state_dict.values())
    assert f"{params:,}" in output
    result = CliRunner().invoke(cli, ["info", "--json", str(saved)])
    assert json.loads(result.output)["parameters"] == params


def test_missing_file(tmp_path: Path) -> None:
    assert_clear_error(tmp_path / "nope.pt", "does not exist")


def test_directory(tmp_path: Path) -> None:
    assert_clear_error(tmp_path, "is a directory")


def test_empty_and_foreign_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert_clear_error(empty, "not a readable checkpoint")
    text = tmp_path / "notes.pt"
    text.write_text("hello\n")
    assert_clear_error(text, "not a readable checkpoint")
    state_dict_only = tmp_path / "weights.pt"
    torch.save(PPOModel((4, 84, 84), 6, SMALL).state_dict(), state_dict_only)
    assert_clear_error(state_dict_only, "not an OakEmu-RL checkpoint")


def test_truncated_file(saved: Path) -> None:
    data = saved.read_bytes()
    for cut in (10, len(data) // 3, len(data) - 100):
        saved.write_bytes(data[:cut])
        assert_clear_error(saved, "not a readable checkpoint")


class _Payload:
    def __reduce__(self):  # what a hostile file would carry
        return (os.system, ("touch pwned-by-checkpoint",))


def test_pickle_payload_is_refused_without_running(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    hostile = tmp_path / "hostile.pt"
    payload = make_checkpoint().to_payload()
    payload["config"] = {"hook": _Payload()}
    torch.save(payload, hostile)
    assert_clear_error(hostile, "refusing to load")
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps(_Payload()))
    assert_clear_error(raw, "refusing to load")
    assert not (tmp_path / "pwned-by-checkpoint").exists()


def test_newer_schema(tmp_path: Path) -> None:
    payload = make_checkpoint().to_payload()
    payload["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "future.pt"
    torch.save(payload, path)
    assert_clear_error(path, "newer")


def test_weights_that_do_not_fit_the_config(tmp_path: Path) -> None:
    payload = make_checkpoint().to_payload()
    payload["model_config"]["fc_hidden"] = [64]
    path = tmp_path / "wrong.pt"
    torch.save(payload, path)
    assert_clear_error(path, "do not fit")

    payload = make_checkpoint().to_payload()
    del payload["model"]["value_head.bias"]
    torch.save(payload, path)
    assert_clear_error(path, "do not fit")

    payload = make_checkpoint().to_payload()
    payload["action_count"] = 4
    payload["action_meanings"] = MEANINGS[:4]
    payload["action_mask"] = [True] * 4
    torch.save(payload, path)
    assert_clear_error(path, "do not fit")


def test_damaged_metadata(tmp_path: Path) -> None:
    path = tmp_path / "damaged.pt"
    for key, value in [("steps", None), ("action_mask", [False] * 6), ("stage", 3),
                       ("model_config", {"depth": 2}), ("observation_shape", [4, 84])]:
        payload = make_checkpoint().to_payload()
        if value is None:
            del payload[key]
        else:
            payload[key] = value
        torch.save(payload, path)
        code, output = run_info(path)
        assert code != 0 and len(output.strip().splitlines()) == 1, (key, output)
        assert str(path) in output and "Traceback" not in output


def test_non_finite_weights(tmp_path: Path) -> None:
    payload = make_checkpoint().to_payload()
    payload["model"]["policy_head.bias"][0] = float("nan")
    path = tmp_path / "nan.pt"
    torch.save(payload, path)
    assert_clear_error(path, "non-finite")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--debug", "info", str(tmp_path / "nope.pt")])
    assert result.exit_code != 0
    assert isinstance(result.exception, CheckpointError)


def test_policy_differences_name_the_policy_tensors_that_moved() -> None:
    model = PPOModel((4, 84, 84), 6)
    before = plain_state_dict(model)
    assert policy_differences(before, model.state_dict()) == []
    with torch.no_grad():
        model.value_head.bias.add_(1.0)  # the value head may move
        assert policy_differences(before, model.state_dict()) == []
        model.policy_head.bias.add_(1e-6)
        model.conv[0].weight.mul_(2.0)
    moved = policy_differences(before, model.state_dict())
    assert moved == ["conv.0.weight", "policy_head.bias"]
    missing = {k: v for k, v in before.items() if k != "fc.0.bias"}
    assert "fc.0.bias" in policy_differences(missing, before)


def test_plain_state_dict_is_nchw_copy_of_a_channels_last_model() -> None:
    model = PPOModel((4, 84, 84), 6).to(memory_format=torch.channels_last)
    state = plain_state_dict(model)
    weight = state["conv.0.weight"]
    assert weight.is_contiguous() and not model.conv[0].weight.is_contiguous()
    assert torch.equal(weight, model.conv[0].weight)
    weight.add_(1.0)  # a copy: the model is untouched
    assert not torch.equal(weight, model.conv[0].weight)


# -- schema 1 and the lineage -----------------------------------------------------------------


def schema1_payload(stage: str, steps: dict[str, int]) -> dict:
    """A checkpoint as schema 1 wrote it: no lineage, stage-less step names."""
    torch.manual_seed(0)
    spec = EnvSpec(game="pong")
    model = PPOModel(spec.observation_shape, len(MEANINGS), SMALL)
    return {
        "format": FORMAT,
        "schema_version": 1,
        "package_version": "0.1.0",
        "created_at": "2026-01-02T03:04:05+00:00",
        "stage": stage,
        "model": plain_state_dict(model),
        "model_config": SMALL.to_dict(),
        "observation_shape": [4, 84, 84],
        "action_count": len(MEANINGS),
        "action_meanings": list(MEANINGS),
        "action_mask": [True] * len(MEANINGS),
        "env_spec": spec.to_dict(),
        "steps": steps,
        "config": {"lr": 3e-4},
        "extra": {},
    }


@pytest.mark.parametrize(("stage", "steps", "renamed"), [
    ("bc", {"epochs": 2, "updates": 10, "samples": 640},
     {"bc/epochs": 2, "bc/updates": 10, "bc/samples": 640}),
    ("calibrate", {"epochs": 2, "updates": 10, "samples": 640, "calibrate_env_steps": 256,
                   "calibrate_iterations": 3},
     {"bc/epochs": 2, "bc/updates": 10, "bc/samples": 640, "calibrate/env_steps": 256,
      "calibrate/iterations": 3}),
    # In a schema-1 PPO file `updates` was PPO's own count (it overwrote BC's).
    ("ppo", {"epochs": 2, "samples": 640, "updates": 5, "global_step": 640},
     {"bc/epochs": 2, "bc/samples": 640, "ppo/updates": 5, "ppo/global_step": 640}),
])
def test_a_schema_1_file_loads_with_renamed_steps_and_one_link(tmp_path: Path, stage: str,
                                                               steps: dict, renamed: dict
                                                               ) -> None:
    path = tmp_path / "old.pt"
    payload = schema1_payload(stage, steps)
    torch.save(payload, path)
    loaded = load_checkpoint(path)
    assert loaded.schema_version == 1 and loaded.stage == stage
    assert loaded.steps == renamed
    assert loaded.lineage == [{"stage": stage, "config": {"lr": 3e-4}, "steps": renamed,
                               "inputs": []}]
    assert lineage_inputs(loaded, stage) == []
    for name, tensor in payload["model"].items():
        assert torch.equal(loaded.state_dict[name], tensor)
    code, output = run_info(path)
    assert code == 0, output
    assert re.search(rf"^lineage +1\. {stage}: .*; from no input files recorded$", output, re.M)
    assert "(schema 1)" in output


@pytest.mark.parametrize("damage", [
    lambda lineage: lineage[0]["inputs"].append("demos.h5"),  # an input that is a string
    lambda lineage: lineage[0]["inputs"].append({"path": "demos.h5"}),  # no sha256
    lambda lineage: lineage[0].pop("stage"),
    lambda lineage: lineage[0]["steps"].update({"bc/epochs": "3"}),
    lambda lineage: lineage.append("bc"),
], ids=["input-string", "input-without-sha256", "no-stage", "string-steps", "link-string"])
def test_a_malformed_lineage_is_refused(tmp_path: Path, damage) -> None:
    path = tmp_path / "lineage.pt"
    payload = make_checkpoint().to_payload()
    assert payload["schema_version"] == 2
    torch.save(payload, path)
    load_checkpoint(path)  # well formed, it loads
    damage(payload["lineage"])
    torch.save(payload, path)
    assert_clear_error(path, "its 'lineage' is malformed")


def test_a_schema_2_file_without_a_lineage_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nolineage.pt"
    payload = make_checkpoint().to_payload()
    del payload["lineage"]
    torch.save(payload, path)
    assert_clear_error(path, "has no 'lineage' entry")
    payload["lineage"] = {"stage": "bc"}
    torch.save(payload, path)
    assert_clear_error(path, "its 'lineage' entry is malformed")


def test_steps_and_lineage_accumulate_and_info_prints_them(tmp_path: Path) -> None:
    demos = tmp_path / "demos.h5"
    demos.write_bytes(b"demo frames")
    extra = tmp_path / "more.h5"
    extra.write_bytes(b"more frames")
    torch.manual_seed(0)
    model = PPOModel((4, 84, 84), len(MEANINGS), SMALL)
    common = dict(action_meanings=MEANINGS, action_mask=[True] * len(MEANINGS),
                  env_spec=EnvSpec(game="pong").to_dict())
    bc = Checkpoint.from_model(model, stage="bc", steps={"epochs": 3, "samples": 1200},
                               config={"lr": 3e-4}, inputs=[demos], **common)
    calibrated = Checkpoint.from_model(model, stage="calibrate", parent=bc,
                                       steps={"env_steps": 4096, "iterations": 2},
                                       inputs=[demos, extra], **common)
    path = save_checkpoint(tmp_path / "calibrated.pt", calibrated)
    loaded = load_checkpoint(path)
    assert loaded.steps == {"bc/epochs": 3, "bc/samples": 1200, "calibrate/env_steps": 4096,
                            "calibrate/iterations": 2}
    assert [link["stage"] for link in loaded.lineage] == ["bc", "calibrate"]
    assert loaded.lineage[0]["steps"] == {"bc/epochs": 3, "bc/samples": 1200}
    assert loaded.lineage[0]["config"] == {"lr": 3e-4}
    assert loaded.lineage[0]["inputs"] == [{"path": str(demos.resolve()),
                                            "sha256": sha256_file(demos)}]
    assert lineage_inputs(loaded, "bc") == [str(demos.resolve())]
    assert lineage_inputs(loaded, "calibrate") == [str(demos.resolve()), str(extra.resolve())]
    assert lineage_inputs(loaded, "ppo") == []

    code, output = run_info(path)
    assert code == 0, output
    lines = output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("lineage "))
    assert re.fullmatch(
        rf"lineage +1\. bc: bc/epochs=3, bc/samples=1,200; from {re.escape(str(demos.resolve()))}"
        rf" \(sha256 {sha256_file(demos)[:12]}\)", lines[first]), lines[first]
    assert re.fullmatch(
        rf" +2\. calibrate: calibrate/env_steps=4,096, calibrate/iterations=2; from "
        rf"{re.escape(str(demos.resolve()))} \(sha256 {sha256_file(demos)[:12]}\), "
        rf"{re.escape(str(extra.resolve()))} \(sha256 {sha256_file(extra)[:12]}\)",
        lines[first + 1]), lines[first + 1]
    assert len(lines) == first + 2
    meta = json.loads(CliRunner().invoke(cli, ["info", "--json", str(path)]).output)
    assert meta["lineage"] == [{"stage": link["stage"], "steps": link["steps"],
                                "inputs": link["inputs"]} for link in loaded.lineage]
