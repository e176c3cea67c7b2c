"""Files a user is handed cannot run code, and their contents never name paths to write.

- A checkpoint carrying a pickle payload (`__reduce__` → `os.system` creating a marker
  file) is refused by every command that loads a checkpoint, and the marker never appears.
- An HDF5 demo file whose attributes (and env spec) hold "../../evil" strings, and an ONNX
  file whose metadata values look like paths, make the commands that read them write
  only where their options say: the whole tree around them is listed before and after.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import h5py
import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from oakemu_rl.agents.recording import RecordConfig, record
from oakemu_rl.agents.scripted import make_demonstrator
from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
from oakemu_rl.export import export_onnx
from oakemu_rl.model import ARCHITECTURES, PPOModel

EVIL = "../../evil"


class Payload:
    """What a hostile file carries: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tiny_checkpoint(path: Path, **changes) -> Path:
    spec = EnvSpec(game="pong")
    meanings = list(action_meanings(spec.game, spec.full_action_space))
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, len(meanings), ARCHITECTURES["tiny"])
    checkpoint = Checkpoint.from_model(
        model, stage="calibrate", action_meanings=meanings,
        action_mask=[bool(v) for v in action_mask(spec)], env_spec=spec.to_dict(),
        steps={"epochs": 1}, config={"demos": []})
    for key, value in changes.items():
        setattr(checkpoint, key, value)
    return save_checkpoint(path, checkpoint)


def hostile_files(folder: Path, marker: Path, good: Path) -> dict[str, Path]:
    """The same payload in torch's zip format, torch's legacy format and a bare pickle."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = torch.load(good, weights_only=True)
    files = {}
    zipped = dict(payload, config={"hook": Payload(marker)})
    files["zip"] = folder / "zip.pt"
    torch.save(zipped, files["zip"])
    files["legacy"] = folder / "legacy.pt"
    with open(files["legacy"], "wb") as handle:
        torch.save(zipped, handle, _use_new_zipfile_serialization=False)
    files["pickle"] = folder / "pickle.pt"
    files["pickle"].write_bytes(pickle.dumps(Payload(marker)))
    return files


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    spec = EnvSpec(game="pong")
    path = tmp_path_factory.mktemp("hostile-demo") / "demos.h5"
    record(RecordConfig(out=path, spec=spec, episodes=2, seed=0, max_steps=12, progress=False),
           make_demonstrator(spec, seed=0))
    return path


def invoke(args: list[str]):
    result = CliRunner().invoke(cli, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    return result


def listing(*roots: Path) -> set[str]:
    return {str(p) for root in roots if root.exists() for p in root.rglob("*")}


ENTRY_POINTS = {
    "info": lambda ckpt, d, w: ["info", ckpt],
    "test": lambda ckpt, d, w: ["test", ckpt, "--episodes", "1", "--max-steps", "3",
                                "--device", "cpu"],
    "calibrate --checkpoint": lambda ckpt, d, w: [
        "bootstrap", "calibrate", "--checkpoint", ckpt, "--run-dir", w, "--num-envs", "2",
        "--holdout-envs", "1", "--num-steps", "4", "--iterations", "1", "--no-progress"],
    "ppo --checkpoint": lambda ckpt, d, w: [
        "finetune", "ppo", "--checkpoint", ckpt, "--run-dir", w, "--total-steps", "8",
        "--num-envs", "1", "--num-steps", "8", "--num-minibatches", "1", "--eval-episodes",
        "0", "--no-progress"],
    "export onnx": lambda ckpt, d, w: ["export", "onnx", ckpt, "--out", f"{w}/x.onnx",
                                       "--verify-frames", "2"],
    "record --policy": lambda ckpt, d, w: ["record", "--policy", ckpt, "--episodes", "1",
                                           "--max-steps", "3", "--out", f"{w}/rec.h5"],
    "bc --checkpoint": lambda ckpt, d, w: [
        "bootstrap", "bc", d, "--checkpoint", ckpt, "--run-dir", w, "--epochs", "1",
        "--no-progress"],
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_pickle_payload_is_refused_by_every_loader(entry, demo, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "MARKER-code-ran"
    good = tiny_checkpoint(tmp_path / "good.pt")
    for kind, hostile in hostile_files(tmp_path / "hostile", marker, good).items():
        work = tmp_path / f"work-{kind}"
        result = invoke(ENTRY_POINTS[entry](str(hostile), str(demo), str(work)))
        assert result.exit_code != 0, (kind, result.output)
        last = result.output.strip().splitlines()[-1]
        assert last.startswith("Error: refusing to load") and str(hostile) in last, (kind, last)
        assert not marker.exists(), f"{entry} ran the payload of the {kind} file"


def test_a_hostile_checkpoint_in_a_run_directory_is_refused(tmp_path, monkeypatch) -> None:
    """The files a stage finds by itself (bc.pt, calibrated.pt, ppo_last.pt) are loaded the
    same way as the ones a user names."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "MARKER-code-ran"
    good = tiny_checkpoint(tmp_path / "good.pt")
    hostile = hostile_files(tmp_path / "hostile", marker, good)["zip"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("bc.pt", "calibrated.pt", "ppo_last.pt"):
        (run_dir / name).write_bytes(hostile.read_bytes())
    small = ["--num-envs", "2", "--num-steps", "4", "--no-progress"]
    for args in (["bootstrap", "calibrate", "--run-dir", str(run_dir), "--holdout-envs", "1",
                  "--iterations", "1", *small],
                 ["finetune", "ppo", "--run-dir", str(run_dir), "--total-steps", "8", *small],
                 ["finetune", "ppo", "--run-dir", str(run_dir), "--total-steps", "8",
                  "--resume", *small]):
        result = invoke(args)
        assert result.exit_code != 0
        assert result.output.strip().splitlines()[-1].startswith("Error: refusing to load")
        assert not marker.exists()


# -- metadata never names a path ---------------------------------------------------------------


def evil_demo(source: Path, out: Path, absolute: Path, spec_change: dict | None) -> Path:
    """A copy of `source` whose free-text attributes hold path-like strings."""
    out.write_bytes(source.read_bytes())
    with h5py.File(out, "r+") as handle:
        for key in ("package_version", "ale_py_version", "created_at"):
            handle.attrs[key] = np.bytes_(EVIL.encode())
        for key in ("out", "run_dir", "path", "video", "checkpoint"):
            handle.attrs[key] = np.bytes_(EVIL.encode())
        handle.attrs["absolute"] = np.bytes_(str(absolute).encode())
        for name in handle["data"]:
            handle["data"][name].attrs["created_at"] = np.bytes_(f"{EVIL}/{name}".encode())
            handle["data"][name].attrs["out"] = np.bytes_(str(absolute).encode())
        if spec_change is not None:
            spec = json.loads(handle.attrs["env_spec"])
            spec.update(spec_change)
            handle.attrs["env_spec"] = np.bytes_(json.dumps(spec).encode())
    return out


def test_hdf5_attributes_never_name_paths_to_write(demo, tmp_path, monkeypatch) -> None:
    cwd = tmp_path / "a" / "b" / "c"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    runs_root = Path(os.environ["OAKEMU_RUNS"])
    absolute = tmp_path / "absolute-evil"
    benign = evil_demo(demo, cwd / "benign.h5", absolute, None)
    refused = {
        "game": evil_demo(demo, cwd / "game.h5", absolute, {"game": EVIL}),
        "forbidden": evil_demo(demo, cwd / "forbidden.h5", absolute,
                               {"forbidden_actions": [EVIL]}),
        "extra key": evil_demo(demo, cwd / "key.h5", absolute, {EVIL: EVIL}),
    }
    run_dir = runs_root / "pong"  # bc's default run directory for a Pong demo file
    cases = [  # arguments, what they may create (everything else must stay as it was)
        (["demos", "info", str(benign)], set()),
        (["demos", "validate", str(benign)], set()),
        (["demos", "merge", str(cwd / "merged.h5"), str(benign)], {cwd / "merged.h5"}),
        (["record", "--demonstrator", "scripted", "--episodes", "1", "--max-steps", "3",
          "--out", str(benign)], set()),
        (["bootstrap", "bc", str(benign), "--architecture", "tiny", "--epochs", "1",
          "--no-progress"], {run_dir, runs_root / ".last-run"}),
    ]
    for args, allowed in cases:
        before = listing(tmp_path, runs_root)
        result = invoke(args)
        assert result.exit_code == 0, (args, result.output)
        new = listing(tmp_path, runs_root) - before
        outside = [p for p in new if not any(p == str(a) or p.startswith(f"{a}/")
                                             for a in allowed)]
        assert outside == [], (args, outside)
        assert not any("evil" in p for p in listing(tmp_path, runs_root, tmp_path.parent)
                       if p.startswith(str(tmp_path))), args
    for what, path in refused.items():
        for args in (["demos", "info", str(path)], ["bootstrap", "bc", str(path),
                                                    "--architecture", "tiny", "--epochs", "1"]):
            before = listing(tmp_path, runs_root)
            result = invoke(args)
            assert result.exit_code != 0, (what, result.output)
            assert "env_spec" in result.output or "env spec" in result.output, result.output
            assert listing(tmp_path, runs_root) == before, what
    assert not absolute.exists()


def test_onnx_metadata_never_names_paths_to_write(tmp_path, monkeypatch) -> None:
    cwd = tmp_path / "a" / "b" / "c"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    absolute = tmp_path / "absolute-evil"
    checkpoint = tiny_checkpoint(tmp_path / "tiny.pt")
    good = cwd / "good.onnx"
    export_onnx(checkpoint, good, verify_frames=2)
    proto = onnx.load(str(good))
    path_like = {"out": EVIL, "video": f"{EVIL}.gif", "path": str(absolute), "run_dir": EVIL,
                 "stage": EVIL, "checkpoint_sha256": f"{EVIL}/x", "exporter": str(absolute),
                 "input_file": f"{EVIL}.h5"}

    def rewrite(name: str, changes: dict[str, str]) -> Path:
        meta = {p.key: p.value for p in proto.metadata_props} | changes
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        del copy.metadata_props[:]
        for key, value in meta.items():
            entry = copy.metadata_props.add()
            entry.key, entry.value = key, value
        path = cwd / name
        path.write_bytes(copy.SerializeToString())
        return path

    benign = rewrite("paths.onnx", path_like)
    spec = json.loads({p.key: p.value for p in proto.metadata_props}["env_spec"])
    bad_game = rewrite("game.onnx", path_like | {"env_spec": json.dumps(spec | {"game": EVIL})})

    before = listing(tmp_path)
    result = invoke(["test", "--onnx", str(benign), "--episodes", "1", "--max-steps", "3",
                     "--json"])
    assert result.exit_code == 0, result.output
    assert listing(tmp_path) == before

    video = cwd / "play.gif"
    result = invoke(["test", "--onnx", str(benign), "--episodes", "1", "--max-steps", "3",
                     "--video", str(video)])
    assert result.exit_code == 0, result.output
    assert listing(tmp_path) - before == {str(video)}

    before = listing(tmp_path)
    result = invoke(["test", "--onnx", str(bad_game), "--episodes", "1", "--max-steps", "3"])
    assert result.exit_code != 0
    assert "unknown game" in result.output
    assert listing(tmp_path) == before
    assert not absolute.exists()
    assert not any("evil" in Path(p).name for p in listing(tmp_path))
