"""`oakemu record`, `oakemu demos` and `oakemu test` as a user runs them (real emulator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from oakemu_rl import PPOModel, PPOModelConfiguration
from oakemu_rl.agents.play import AgentActionError
from oakemu_rl.agents.recording import RecordConfig, record
from oakemu_rl.agents.scripted import make_demonstrator
from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.demos import DemoFile, validate_demo_file
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings

SMALL = PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(32,))


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def scripted_file(tmp_path: Path) -> Path:
    out = tmp_path / "pong.h5"
    result = invoke("record", "--demonstrator", "scripted", "--game", "pong", "--episodes", "2",
                    "--max-steps", "40", "--out", str(out), "--seed", "3")
    assert result.exit_code == 0, result.output
    assert "wrote 2 episode(s)" in result.output
    return out


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    spec = EnvSpec(game="pong")
    model = PPOModel(spec.observation_shape, 6, SMALL)
    ckpt = Checkpoint.from_model(model, stage="bc", action_meanings=list(action_meanings("pong")),
                                 action_mask=action_mask(spec).tolist(), env_spec=spec.to_dict())
    return save_checkpoint(tmp_path / "bc.pt", ckpt)


def test_scripted_recording_is_a_valid_file(scripted_file: Path) -> None:
    with validate_demo_file(scripted_file) as demo:
        assert [e.length for e in demo.episodes] == [40, 40]
        assert all(e.recorder == "scripted" and e.truncated for e in demo.episodes)
        assert [e.seed for e in demo.episodes] == [3, 4]
        assert demo.spec == EnvSpec(game="pong")


def test_record_and_test_in_the_follow_style(tmp_path: Path) -> None:
    out = tmp_path / "follow.h5"
    result = invoke("record", "--demonstrator", "scripted", "--style", "follow", "--episodes",
                    "1", "--max-steps", "30", "--out", str(out))
    assert result.exit_code == 0, result.output
    with DemoFile(out) as demo:
        assert demo.num_steps == 30
    result = invoke("test", "--demonstrator", "scripted", "--style", "follow", "--episodes", "1",
                    "--max-steps", "30", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["scripted"]["lengths"] == [30]
    result = invoke("record", "--demonstrator", "scripted", "--game", "breakout", "--style",
                    "follow", "--out", str(tmp_path / "b.h5"))
    assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1
    assert "no style 'follow'" in result.output and not (tmp_path / "b.h5").exists()


def test_appending_with_another_spec_is_refused(scripted_file: Path) -> None:
    before = scripted_file.read_bytes()
    result = invoke("record", "--demonstrator", "scripted", "--episodes", "1", "--max-steps",
                    "10", "--sticky", "0", "--out", str(scripted_file))
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1
    assert "different env spec" in result.output and "repeat_action_probability" in result.output
    assert scripted_file.read_bytes() == before


def test_appending_with_the_same_spec_continues(scripted_file: Path) -> None:
    result = invoke("record", "--demonstrator", "scripted", "--episodes", "1", "--max-steps",
                    "10", "--out", str(scripted_file))
    assert result.exit_code == 0, result.output
    with DemoFile(scripted_file) as demo:
        assert [e.name for e in demo.episodes] == ["demo_0", "demo_1", "demo_2"]


def test_demos_info_validate_and_merge(scripted_file: Path, tmp_path: Path) -> None:
    result = invoke("demos", "info", str(scripted_file))
    assert result.exit_code == 0, result.output
    assert "episodes    2 (scripted)" in result.output and "steps       80" in result.output
    assert "ALE/Pong-v5" in result.output and "bytes/frame" in result.output
    summary = json.loads(invoke("demos", "info", "--json", str(scripted_file)).stdout)
    assert sum(summary["action_histogram"].values()) == 80

    result = invoke("demos", "validate", str(scripted_file))
    assert result.exit_code == 0 and "valid, 2 episodes, 80 steps" in result.output

    merged = tmp_path / "merged.h5"
    result = invoke("demos", "merge", str(merged), str(scripted_file), str(scripted_file))
    assert result.exit_code == 0, result.output
    with DemoFile(merged) as demo:
        assert len(demo.episodes) == 4 and demo.num_steps == 160


def test_demos_commands_on_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5 at all")
    for args in (["demos", "info", str(bad)], ["demos", "validate", str(bad)],
                 ["bootstrap", "bc", str(bad)]):
        result = invoke(*args)
        assert result.exit_code != 0
        assert result.output.strip().splitlines() == [
            f"Error: {bad} is not a readable HDF5 file (truncated, corrupt or another format)"
        ], args


def test_record_a_policy(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "policy.h5"
    result = invoke("record", "--policy", str(checkpoint), "--episodes", "1", "--max-steps",
                    "20", "--out", str(out), "--device", "cpu")
    assert result.exit_code == 0, result.output
    with DemoFile(out) as demo:
        assert demo.episodes[0].recorder == "policy" and demo.episodes[0].length == 20


def test_record_relabelled_by_the_script(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "relabelled.h5"
    result = invoke("record", "--demonstrator", "scripted", "--style", "follow", "--relabel",
                    str(checkpoint), "--episodes", "1", "--max-steps", "25", "--out", str(out),
                    "--device", "cpu")
    assert result.exit_code == 0, result.output
    follower = tmp_path / "follower.h5"  # the script playing by itself from the same seed
    assert invoke("record", "--demonstrator", "scripted", "--style", "follow", "--episodes",
                  "1", "--max-steps", "25", "--out", str(follower)).exit_code == 0
    with validate_demo_file(out) as demo, DemoFile(follower) as alone:
        assert demo.episodes[0].recorder == "relabelled" and demo.episodes[0].length == 25
        # Same first frame; then the checkpoint's moves, not the script's, steer the game.
        np.testing.assert_array_equal(demo.read(0, "frames")[0], alone.read(0, "frames")[0])
        assert not np.array_equal(demo.read(0, "frames"), alone.read(0, "frames"))
    for bad in (["--relabel", str(checkpoint)],
                ["--demonstrator", "scripted", "--policy", str(checkpoint), "--relabel",
                 str(checkpoint)]):
        result = invoke("record", *bad, "--out", str(tmp_path / "x.h5"))
        assert result.exit_code != 0 and "--relabel needs --demonstrator scripted" in result.output
        assert not (tmp_path / "x.h5").exists()


def test_test_command_compares_checkpoint_and_scripted(checkpoint: Path) -> None:
    result = invoke("test", str(checkpoint), "--demonstrator", "scripted", "--episodes", "2",
                    "--max-steps", "30", "--device", "cpu")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()[1:]
            if line and line.split()[0] in ("checkpoint", "scripted")}
    assert set(rows) == {"checkpoint", "scripted"}
    assert rows["checkpoint"][1] == "2" and rows["scripted"][-1] == "30.0"
    data = json.loads(invoke("test", str(checkpoint), "--episodes", "1", "--max-steps", "10",
                             "--json", "--device", "cpu").stdout)
    assert data["checkpoint"]["lengths"] == [10]


def test_test_command_needs_something_to_test() -> None:
    result = invoke("test")
    assert result.exit_code != 0 and "give a CHECKPOINT to test, --onnx MODEL" in result.output


def test_keyboard_recording_without_a_display_is_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER")}
    proc = subprocess.run(
        [sys.executable, "-m", "oakemu_rl", "record", "--out", str(tmp_path / "k.h5")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no display found" in lines[0], proc.stderr
    assert not (tmp_path / "k.h5").exists()


def test_export_onnx_then_play_it(checkpoint: Path, tmp_path: Path) -> None:
    model = tmp_path / "policy.onnx"
    result = invoke("export", "onnx", str(checkpoint), "--out", str(model),
                    "--verify-frames", "16")
    assert result.exit_code == 0, result.output
    assert "verified onnxruntime against torch on 16 real Pong frames" in result.output
    assert model.exists()
    result = invoke("test", str(checkpoint), "--onnx", str(model), "--episodes", "1",
                    "--max-steps", "25", "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)
    # The same greedy policy through torch and through onnxruntime plays the same game.
    assert scores["onnx"]["scores"] == scores["checkpoint"]["scores"]
    assert scores["onnx"]["lengths"] == [25]


# -- an agent's bad action ends the recording in one line ---------------------------------


NO_FIRE = EnvSpec(game="pong", forbidden_actions=("FIRE",))


class BadActionAgent:
    """Plays NOOP, but returns `bad` at step `at` of episode `episode` (from 1)."""

    def __init__(self, bad, *, episode: int = 1, at: int = 3, kind: str = "scripted") -> None:
        self.bad, self.bad_episode, self.at, self.kind = bad, episode, at, kind
        self.episode = self.step = 0

    def reset(self, env, seed: int) -> None:
        self.episode += 1
        self.step = 0

    def act(self, env, observation) -> int:
        self.step += 1
        if self.episode == self.bad_episode and self.step == self.at:
            return self.bad
        return 0


@pytest.mark.parametrize(("bad", "message"), [
    (1, "the scripted agent chose the forbidden action FIRE (1); the action mask allows only "
        "NOOP, RIGHT, LEFT, RIGHTFIRE, LEFTFIRE"),
    (6, "the scripted agent returned action 6, but the game has actions 0..5"),
    (-1, "the scripted agent returned action -1, but the game has actions 0..5"),
    (2.0, "the scripted agent returned 2.0, which is not an action index"),
])
def test_record_refuses_a_bad_action_with_an_agent_action_error(tmp_path: Path, bad,
                                                                message: str) -> None:
    out = tmp_path / "bad.h5"
    config = RecordConfig(out=out, spec=NO_FIRE, episodes=2, max_steps=10, progress=False)
    with pytest.raises(AgentActionError) as raised:
        record(config, BadActionAgent(bad, episode=2))
    assert str(raised.value) == message
    with DemoFile(out) as demo:  # the episode before it was committed, and only that one
        assert [e.length for e in demo.episodes] == [10]


def test_record_refuses_a_drivers_bad_action(tmp_path: Path) -> None:
    config = RecordConfig(out=tmp_path / "driven.h5", spec=NO_FIRE, episodes=1, max_steps=10,
                          progress=False)
    labeller = make_demonstrator(NO_FIRE.for_evaluation(), style="follow")
    with pytest.raises(AgentActionError, match=r"^the policy agent chose the forbidden action "
                                               r"FIRE \(1\)"):
        record(config, labeller, BadActionAgent(1, kind="policy"))


def test_cli_record_ends_a_bad_action_in_one_error_line(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("oakemu_rl.agents.recording.make_demonstrator",
                        lambda spec, **_: BadActionAgent(1, episode=2))
    out = tmp_path / "bad.h5"
    result = invoke("record", "--demonstrator", "scripted", "--forbid", "FIRE", "--episodes",
                    "3", "--max-steps", "10", "--out", str(out))
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1:] == [
        "Error: the scripted agent chose the forbidden action FIRE (1); the action mask allows "
        "only NOOP, RIGHT, LEFT, RIGHTFIRE, LEFTFIRE"], result.output
    assert [line for line in result.output.splitlines() if line.startswith("Error")] == \
        result.output.strip().splitlines()[-1:]
    with DemoFile(out) as demo:
        assert [e.length for e in demo.episodes] == [10]


def test_cli_record_fire_reset_is_stored_in_the_demo_file(tmp_path: Path) -> None:
    """`--fire-reset` reaches the env spec every later stage reads from the demo file."""
    out = tmp_path / "served.h5"
    result = invoke("record", "--demonstrator", "scripted", "--game", "breakout",
                    "--fire-reset", "--episodes", "1", "--max-steps", "10", "--out", str(out))
    assert result.exit_code == 0, result.output
    with DemoFile(out) as demo:
        assert demo.spec.fire_reset is True
        assert demo.spec.game == "breakout"
