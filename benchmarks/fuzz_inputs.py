"""Fuzz the demo reader and the checkpoint loader through the `oakemu` command.

From one small valid demo file and one tiny valid checkpoint this derives mutated files
(seeded): cut at random offsets, random byte flips, zeroed blocks, empty files,
directories, missing paths, random bytes, HDF5 files with a dataset of the wrong dtype or
shape, a key or attribute deleted or given a value of another type, links, other HDF5
files; checkpoints with a random subset of keys deleted or replaced by other types,
nested entries and tensors damaged, foreign torch and zip files, and pickle payloads that
would run code; and Game Boy inputs: files that are not ROMs (random bytes, a tiny file,
text, HDF5), a ROM whose header checksum fails, a missing ROM path, a game config naming
RAM outside the Game Boy's map, and a start save state taken on another ROM. Each file
goes through the commands that read it (`oakemu demos validate`, `demos info`,
`bootstrap bc`, `info`, `test`, `envs --rom`, and `record --rom` / `record --game-config`
once `oakemu record` has those options), run with click's CliRunner in a forked
child so that a hang (SIGALRM after `--timeout` seconds) or a crash inside a C library is
caught and counted instead of stopping the run. Allowed outcomes:

    ok         exit 0
    error      non-zero exit with exactly one line "Error: ...", the last one, and no traceback

Anything else is a failure: `traceback` (an exception other than SystemExit escaped),
`bad-error` (a non-zero exit without one clear "Error: " line), `hang`, `crash` (the child
died from a signal), `code-ran` (a pickle payload's marker file appeared).

    .venv/bin/python benchmarks/fuzz_inputs.py --cases 1000 --seed 0

prints the counts by outcome and by mutation kind, and every failure with its reproducer
left under --workdir. tests/test_fuzz.py runs a seeded sample of the same cases.
"""

from __future__ import annotations

import argparse
import collections
import copy
import io
import json
import math
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

ALLOWED = ("ok", "error")
FAILURES = ("traceback", "bad-error", "hang", "crash", "code-ran")

DEMO_KINDS = ("truncate", "flip", "zero_block", "empty", "directory", "missing", "random_bytes",
              "h5_dtype", "h5_shape", "h5_delete", "h5_attr", "h5_spec", "h5_values",
              "h5_extra", "h5_link", "other_hdf5", "cross")
CKPT_KINDS = ("truncate", "flip", "zero_block", "empty", "directory", "missing", "random_bytes",
              "ckpt_delete", "ckpt_replace", "ckpt_nested", "ckpt_tensor", "ckpt_spec",
              "foreign_torch", "foreign_zip", "hostile", "cross")
GB_KINDS = ("gb_not_rom", "gb_bad_checksum", "gb_missing_rom", "gb_config_ram",
            "gb_foreign_state")
"""Game Boy inputs, each refused whatever reads it: the ROM kinds through `envs --rom` (and
`record --rom`), the config kinds through `record --game-config` and, now, through
`test` on a catch checkpoint whose env spec stores that config."""


# -- the valid files everything is derived from ----------------------------------------------


def build_base(workdir: Path) -> tuple[Path, Path]:
    """A 2-episode scripted Pong demo file (with a stored split) and a tiny bc checkpoint."""
    from oakemu_rl.agents.recording import RecordConfig, record
    from oakemu_rl.agents.scripted import make_demonstrator
    from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
    from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
    from oakemu_rl.model import ARCHITECTURES, PPOModel

    workdir.mkdir(parents=True, exist_ok=True)
    spec = EnvSpec(game="pong")
    demo = workdir / "base_demos.h5"
    if not demo.exists():
        record(RecordConfig(out=demo, spec=spec, episodes=2, seed=0, max_steps=24,
                            progress=False), make_demonstrator(spec, seed=0))
        with h5py.File(demo, "a") as handle:  # the optional stored split, so it is fuzzed too
            handle.create_dataset("mask/train", data=np.array([b"demo_0"], dtype="S16"))
            handle.create_dataset("mask/valid", data=np.array([b"demo_1"], dtype="S16"))
    checkpoint = workdir / "base.pt"
    if not checkpoint.exists():
        meanings = list(action_meanings(spec.game, spec.full_action_space))
        torch.manual_seed(0)
        model = PPOModel(spec.observation_shape, len(meanings), ARCHITECTURES["tiny"])
        save_checkpoint(checkpoint, Checkpoint.from_model(
            model, stage="bc", action_meanings=meanings,
            action_mask=[bool(v) for v in action_mask(spec)], env_spec=spec.to_dict(),
            steps={"epochs": 1, "updates": 2, "samples": 48},
            config={"lr": 2.5e-4}, extra={"metrics": {"loss": 1.5}}, inputs=[demo]))
    return demo, checkpoint


# -- mutations -------------------------------------------------------------------------------


class Evil:
    """A pickle payload: unpickling it would run a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _byte_mutation(kind: str, data: bytes, rng: np.random.Generator) -> bytes:
    if kind == "truncate":
        return data[: int(rng.integers(0, len(data)))]
    buf = bytearray(data)
    if kind == "flip":
        for _ in range(int(rng.integers(1, 17))):
            i = int(rng.integers(0, len(buf)))
            buf[i] = (buf[i] ^ (1 << int(rng.integers(0, 8)))) if rng.random() < 0.5 \
                else int(rng.integers(0, 256))
        return bytes(buf)
    if kind == "zero_block":
        size = int(rng.integers(8, 4097))
        start = int(rng.integers(0, max(1, len(buf) - size)))
        buf[start:start + size] = bytes(min(size, len(buf) - start))
        return bytes(buf)
    if kind == "random_bytes":
        n = int(rng.choice([1, 8, 512, 4096, 70_000]))
        head = rng.choice([b"", b"\x89HDF\r\n\x1a\n", b"PK\x03\x04", b"\x80\x02"])
        return head + rng.bytes(n)
    raise ValueError(kind)


def _junk_values(rng: np.random.Generator) -> list[Any]:
    """Values of every type a field could wrongly hold (for HDF5 attributes)."""
    return [
        -1, 0, 2**62, 3.5, math.nan, math.inf, True, "a vlen string", np.bytes_(b"\xff\xfe\x00"),
        np.bytes_(b""), np.bytes_(b"{}"), np.bytes_(b"[]"), np.bytes_(b"null"),
        np.bytes_(b"[1e999]"), np.bytes_(b'{"game": "../../evil"}'),
        np.bytes_(json.dumps([True] * 6).encode()), np.bytes_(json.dumps(["NOOP"]).encode()),
        np.bytes_(json.dumps([False] * 6).encode()), np.array([1, 2, 3]),
        np.array([], dtype=np.int64), np.zeros((2, 2)), np.array([b"a", b"b"]),
        np.array([84, 84, 1]), np.array([84.5, 84.0]), np.float32(-0.0),
        np.bytes_(rng.bytes(16)), np.int8(-128), np.uint64(2**64 - 1),
    ]


def _h5_objects(handle: h5py.File) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    groups, datasets, attrs = ["/"], [], [("/", k) for k in handle.attrs]

    def visit(name: str, obj: Any) -> None:
        (groups if isinstance(obj, h5py.Group) else datasets).append(name)
        attrs.extend((name, k) for k in obj.attrs)

    handle.visititems(visit)
    return groups, datasets, attrs


def _pick(rng: np.random.Generator, items: list) -> Any:
    return items[int(rng.integers(0, len(items)))]


def _h5_mutation(kind: str, path: Path, rng: np.random.Generator, note: list[str]) -> None:
    with h5py.File(path, "r+") as handle:
        groups, datasets, attrs = _h5_objects(handle)
        if kind == "h5_dtype":
            name = _pick(rng, datasets)
            data = handle[name][()]
            dtype = _pick(rng, [np.float64, np.int8, np.uint16, np.float16, np.int32, np.bool_,
                                np.complex64, "S4", np.uint8, np.int64, np.float32])
            try:
                converted = np.asarray(data).astype(dtype)
            except (TypeError, ValueError):  # text that is not a number: store numbers
                dtype = np.float32
                converted = np.zeros(np.shape(data), dtype=dtype)
            del handle[name]
            handle.create_dataset(name, data=converted)
            note.append(f"{name} as {np.dtype(dtype)}")
        elif kind == "h5_shape":
            name = _pick(rng, datasets)
            data = np.asarray(handle[name][()])
            how = _pick(rng, ["drop_row", "add_axis", "transpose", "empty", "scalar", "extra_row",
                              "crop"])
            if how == "drop_row" and data.ndim:
                data = data[:-1]
            elif how == "extra_row" and data.ndim:
                data = np.concatenate([data, data[:1]])
            elif how == "add_axis":
                data = data[..., None]
            elif how == "transpose":
                data = data.T
            elif how == "empty" and data.ndim:
                data = data[:0]
            elif how == "scalar":
                data = data.reshape(-1)[:1].reshape(()) if data.size else np.int64(0)
            elif how == "crop" and data.ndim >= 2:
                data = data[:, :-1]
            del handle[name]
            handle.create_dataset(name, data=data)
            note.append(f"{name} {how} -> {data.shape}")
        elif kind == "h5_delete":
            choice = rng.random()
            if choice < 0.45 and attrs:
                obj, key = _pick(rng, attrs)
                del handle[obj].attrs[key]
                note.append(f"attr {obj}:{key}")
            else:
                name = _pick(rng, datasets + groups[1:])
                del handle[name]
                note.append(name)
        elif kind == "h5_attr":
            obj, key = _pick(rng, attrs)
            value = _pick(rng, _junk_values(rng))
            handle[obj].attrs[key] = value
            note.append(f"{obj}:{key} = {value!r}"[:120])
        elif kind == "h5_spec":
            spec = json.loads(handle.attrs["env_spec"])
            key = _pick(rng, sorted(spec))
            value = _pick(rng, [None, -1, 0, 10**12, 2.5, math.nan, "breakout", "../../evil",
                                "", [], {}, True, ["FIRE"], ["NOOP", "FIRE", "RIGHT", "LEFT",
                                                            "RIGHTFIRE", "LEFTFIRE"], 5000])
            how = _pick(rng, ["set", "set", "delete", "add"])
            if how == "delete":
                spec.pop(key)
            elif how == "add":
                spec["../../evil"] = value
            else:
                spec[key] = value
            handle.attrs["env_spec"] = np.bytes_(json.dumps(spec).encode())
            note.append(f"env_spec {how} {key}={value!r}")
        elif kind == "h5_values":
            episode = _pick(rng, [g for g in groups if g.startswith("data/demo_")])
            how = _pick(rng, ["neg_action", "big_action", "nan_reward", "length", "total",
                              "schema", "frame_shape", "episodes_attr", "seed"])
            if how in ("neg_action", "big_action"):
                actions = handle[episode]["actions"][()]
                actions[int(rng.integers(0, len(actions)))] = -3 if how == "neg_action" else 99
                handle[episode]["actions"][...] = actions
            elif how == "nan_reward":
                rewards = handle[episode]["rewards"][()]
                rewards[0] = _pick(rng, [np.nan, np.inf, -np.inf, 3e38])
                handle[episode]["rewards"][...] = rewards
            elif how == "length":
                handle[episode].attrs["length"] = _pick(rng, [0, -1, 10**9, 23])
            elif how == "total":
                handle["data"].attrs["total"] = _pick(rng, [-5, 0, 10**15, 47])
            elif how == "schema":
                handle.attrs["schema_version"] = _pick(rng, [0, -1, 2, 10**6, np.int8(1)])
            elif how == "frame_shape":
                handle.attrs["frame_shape"] = _pick(rng, [np.array([84]), np.array([84, 85]),
                                                          np.array([0, 0]), np.array([-84, -84])])
            elif how == "episodes_attr":
                handle["data"].attrs["episodes"] = -7
            else:
                handle[episode].attrs["seed"] = _pick(rng, [-1, 2**63 - 1, np.uint64(2**64 - 1)])
            note.append(f"{episode} {how}")
        elif kind == "h5_extra":
            how = _pick(rng, ["dataset_in_data", "empty_episode", "mask_unknown", "root_junk",
                              "bad_name", "mask_no_valid", "huge_index"])
            if how == "dataset_in_data":
                handle["data"].create_dataset("foo", data=np.arange(3))
            elif how == "empty_episode":
                handle["data"].create_group("demo_7")
            elif how == "mask_unknown":
                del handle["mask/train"]
                handle.create_dataset("mask/train", data=np.array([b"demo_99", b"../../evil"]))
            elif how == "root_junk":
                handle.create_dataset("junk", data=rng.bytes(64), dtype=h5py.string_dtype())
            elif how == "bad_name":
                handle["data"].move("demo_1", "demo_x")
            elif how == "mask_no_valid":
                del handle["mask/valid"]
            else:
                handle["data"].move("demo_1", "demo_99999999999999999999")
            note.append(how)
        elif kind == "h5_link":
            name = _pick(rng, datasets + [g for g in groups if g.startswith("data/demo_")])
            how = _pick(rng, ["soft_missing", "soft_loop", "external", "external_self",
                              "hard_twice"])
            del handle[name]
            if how == "soft_missing":
                handle[name] = h5py.SoftLink("/nowhere/at/all")
            elif how == "soft_loop":
                handle[name] = h5py.SoftLink("/" + name)
            elif how == "external":
                handle[name] = h5py.ExternalLink("../../evil.h5", "/data")
            elif how == "external_self":
                handle[name] = h5py.ExternalLink(str(path), "/" + name)
            else:
                other = _pick(rng, [d for d in datasets if d != name] or ["data"])
                if other in handle:
                    handle[name] = handle[other]
            note.append(f"{name} {how}")
        else:
            raise ValueError(kind)


def _other_hdf5(path: Path, rng: np.random.Generator, note: list[str]) -> None:
    """An HDF5 file of another layout, sometimes with our format marker to get further."""
    with h5py.File(path, "w") as handle:
        if rng.random() < 0.6:
            handle.attrs["format"] = _pick(rng, ["oakemu-rl-demos", np.bytes_(b"oakemu-rl-demos"),
                                                 "something-else"])
        for key in ("schema_version", "env_spec", "action_meanings", "action_mask",
                    "frame_shape", "package_version", "ale_py_version", "created_at"):
            if rng.random() < 0.5:
                handle.attrs[key] = _pick(rng, _junk_values(rng))
        for i in range(int(rng.integers(0, 4))):
            group = handle.require_group(_pick(rng, ["data", "data/demo_0", f"g{i}", "mask"]))
            if rng.random() < 0.7:
                shape = _pick(rng, [(3,), (2, 84, 84), (0,), ()])
                group.create_dataset(f"d{i}", data=np.zeros(shape, dtype=_pick(
                    rng, [np.uint8, np.float32, np.int64])))
    note.append("other layout")


def _load_payload(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _junk_payload_values() -> list[Any]:
    return [None, 0, -1, 2**40, 1.5, math.nan, math.inf, True, "x", "../../evil", b"bytes",
            [], {}, [1, 2], {"a": 1}, {"../../evil": "../../evil"}, torch.zeros(3),
            torch.tensor(math.nan), [[1, 2, 3]], ("tuple",), [None], [True] * 6,
            ["NOOP"] * 6]


def _ckpt_mutation(kind: str, base: Path, out: Path, rng: np.random.Generator,
                   note: list[str], marker: Path) -> None:
    payload = _load_payload(base)
    junk = _junk_payload_values()
    if kind == "ckpt_delete":
        keys = sorted(payload)
        drop = list(rng.choice(keys, size=int(rng.integers(1, len(keys) + 1)), replace=False))
        for key in drop:
            payload.pop(str(key))
        note.append(f"deleted {sorted(map(str, drop))}")
    elif kind == "ckpt_replace":
        keys = sorted(payload)
        chosen = list(rng.choice(keys, size=int(rng.integers(1, 4)), replace=False))
        for key in chosen:
            payload[str(key)] = copy.deepcopy(_pick(rng, junk))
        note.append(f"replaced {sorted(map(str, chosen))}")
    elif kind == "ckpt_nested":
        where = _pick(rng, ["model_config", "steps", "config", "extra", "env_spec",
                            "observation_shape", "action_meanings", "action_mask", "lineage",
                            "lineage[0]", "lineage[0].inputs[0]"])
        container = {"lineage[0]": lambda: payload["lineage"][0],
                     "lineage[0].inputs[0]": lambda: payload["lineage"][0]["inputs"][0],
                     }.get(where, lambda: payload[where])()
        if isinstance(container, dict):
            key = _pick(rng, sorted(container)) if container else "x"
            how = _pick(rng, ["set", "set", "delete", "add"])
            if how == "delete":
                container.pop(key, None)
            elif how == "add":
                container["../../evil"] = copy.deepcopy(_pick(rng, junk))
            else:
                container[key] = copy.deepcopy(_pick(rng, [
                    *junk, [[8, 8, 4], [16, 4, 2], [10**6, 1, 1]], [10**9], [[0, 0, 0]],
                    "tanhh", 10**12]))
            note.append(f"{where} {how} {key}")
        else:
            index = int(rng.integers(0, len(container)))
            how = _pick(rng, ["set", "drop", "append"])
            if how == "drop":
                container.pop(index)
            elif how == "append":
                container.append(copy.deepcopy(_pick(rng, junk)))
            else:
                container[index] = copy.deepcopy(_pick(rng, [*junk, 10**6, 0, -4, False]))
            note.append(f"{where}[{index}] {how}")
    elif kind == "ckpt_tensor":
        state = payload["model"]
        name = _pick(rng, sorted(state))
        how = _pick(rng, ["nan", "inf", "shape", "dtype", "empty", "scalar", "not_tensor",
                          "drop", "extra", "int", "huge_declared"])
        tensor = state[name]
        if how == "nan":
            tensor.view(-1)[0] = math.nan
        elif how == "inf":
            tensor.view(-1)[-1] = -math.inf
        elif how == "shape":
            state[name] = tensor.reshape(-1)[:-1] if tensor.numel() > 1 else tensor.reshape(1, 1)
        elif how == "dtype":
            state[name] = tensor.to(_pick(rng, [torch.float64, torch.float16, torch.bfloat16]))
        elif how == "empty":
            state[name] = torch.empty(0)
        elif how == "scalar":
            state[name] = torch.tensor(1.0)
        elif how == "not_tensor":
            state[name] = copy.deepcopy(_pick(rng, junk[:12]))
        elif how == "drop":
            state.pop(name)
        elif how == "extra":
            state["../../evil"] = torch.zeros(2)
        elif how == "int":
            state[name] = tensor.to(torch.int64)
        else:
            state[name] = torch.zeros(1).expand(10**6)  # a view: stored as one element
        note.append(f"{name} {how}")
    elif kind == "ckpt_spec":
        spec = payload["env_spec"]
        key = _pick(rng, sorted(spec))
        spec[key] = _pick(rng, [None, -1, 0, 10**12, 2.5, math.nan, "breakout", "../../evil", "",
                                [], True, ["FIRE"] * 6, 5000, 10**9, 100_000, 2**31])
        note.append(f"env_spec {key}={spec[key]!r}")
    elif kind == "foreign_torch":
        what = _pick(rng, ["list", "tensor", "dict", "format_only", "state_dict", "nested"])
        payload = {
            "list": [1, 2, 3], "tensor": torch.arange(6),
            "dict": {"model": payload["model"]},
            "format_only": {"format": "oakemu-rl-checkpoint"},
            "state_dict": payload["model"],
            "nested": {"format": "oakemu-rl-checkpoint", "schema_version": 1,
                       "model": {"a": {"b": torch.zeros(2)}}},
        }[what]
        note.append(what)
    elif kind == "foreign_zip":
        with zipfile.ZipFile(out, "w") as archive:
            names = ["archive/data.pkl", "archive/version", "x/1", "archive/data/0"]
            for name in rng.permutation(names)[: int(rng.integers(0, 4))]:
                archive.writestr(str(name), rng.bytes(40))
        note.append("zip")
        return
    elif kind == "hostile":
        evil = Evil(marker)
        how = _pick(rng, ["extra", "top", "state", "legacy", "raw_pickle", "config"])
        if how == "raw_pickle":
            out.write_bytes(pickle.dumps({"format": "oakemu-rl-checkpoint", "x": evil}))
        else:
            where = {"extra": payload["extra"], "top": payload, "state": payload["model"],
                     "legacy": payload, "config": payload["config"]}[how]
            where["payload"] = evil
            buffer = io.BytesIO()
            torch.save(payload, buffer, _use_new_zipfile_serialization=how != "legacy")
            out.write_bytes(buffer.getvalue())
        note.append(how)
        return
    else:
        raise ValueError(kind)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    out.write_bytes(buffer.getvalue())


# -- Game Boy inputs -------------------------------------------------------------------------


def _catch_config(rng: np.random.Generator, note: list[str]) -> dict[str, Any]:
    """The shipped catch config with one address moved outside the Game Boy's RAM map."""
    import tomllib

    from oakemu_rl.envs.gameconfig import shipped_games

    data = tomllib.loads(shipped_games()["catch"].read_text())
    outside = int(_pick(rng, [0x0000, 0x0100, 0x7FFF, 0xE000, 0xFDFF, 0xFEA0, 0xDFFF]))
    single = outside if outside != 0xDFFF else 0xE000  # $DFFF is outside only for 2 bytes
    how = _pick(rng, ["reward", "end", "lives", "symbol", "count", "list"])
    if how == "reward":
        data["rewards"][0]["address"] = outside  # the score: 2 bytes wide
    elif how == "end":
        data["ends"][0]["address"] = single
    elif how == "lives":
        data["game"]["lives"] = single
    elif how == "symbol":
        data["symbols"]["misses"] = single
    elif how == "count":
        data["rewards"][1].update(address=0xDF00, count=int(rng.integers(0x101, 0x1000)))
    else:
        data["rewards"][1].pop("address")
        data["rewards"][1]["addresses"] = ["score", single]
    note.append(f"{how} ${outside:04X}")
    return data


def _toml(data: dict[str, Any]) -> str:
    """A game config as TOML (tables and arrays of tables of plain values)."""
    def value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    lines = []
    for name, table in data.items():
        for entry in (table if isinstance(table, list) else [table]):
            lines.append(f"[[{name}]]" if isinstance(table, list) else f"[{name}]")
            lines += [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def _catch_checkpoint(path: Path, game_config: str) -> Path:
    """A tiny catch checkpoint whose env spec stores `game_config` (JSON), as a checkpoint
    made with that config (or edited afterwards) would."""
    from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
    from oakemu_rl.envs import EnvSpec
    from oakemu_rl.model import ARCHITECTURES, PPOModel

    spec = EnvSpec(game="catch").to_dict()
    spec["game_config"] = game_config
    torch.manual_seed(0)
    model = PPOModel((4, 84, 84), 3, ARCHITECTURES["tiny"])
    return save_checkpoint(path, Checkpoint.from_model(
        model, stage="bc", action_meanings=["NOOP", "LEFT", "RIGHT"],
        action_mask=[True, True, True], env_spec=spec, steps={"epochs": 1}))


def _gameboy_case(index: int, kind: str, out_dir: Path, rng: np.random.Generator,
                  note: list[str]) -> tuple[Path, Path | None]:
    """Write Game Boy case `index`: (the file a command is given, a checkpoint storing it)."""
    from oakemu_rl.envs import EnvSpec, make_env, roms
    from oakemu_rl.envs.gbgame.build import build_rom, header_checksum

    stem = out_dir / f"case{index:05d}_{kind}"
    if kind == "gb_not_rom":
        how = _pick(rng, ["random", "tiny", "text", "hdf5", "odd_size", "state"])
        data = {"random": rng.bytes(0x4000 * int(rng.integers(2, 9))),
                "tiny": rng.bytes(int(rng.integers(0, 400))),
                "text": b"[game]\nname = 'catch'\n" * 40,
                "odd_size": build_rom()[: 0x4000 * 2 - int(rng.integers(1, 0x4000))],
                "state": roms.STATE_MAGIC + b'{"rom_sha256": "00"}\n' + rng.bytes(0x8000),
                "hdf5": b""}[how]
        path = stem.with_suffix(".gb")
        if how == "hdf5":
            with h5py.File(path, "w") as handle:
                handle.create_dataset("x", data=np.zeros(0x8000, dtype=np.uint8))
        else:
            path.write_bytes(data)
        note.append(how)
        return path, None
    if kind == "gb_bad_checksum":
        rom = bytearray(build_rom())
        at = int(rng.integers(0x134, 0x14E))  # a header byte, or the checksum itself
        rom[at] ^= 1 << int(rng.integers(0, 8))
        stem.with_suffix(".gb").write_bytes(rom)
        note.append(f"${at:04X} flipped")
        return stem.with_suffix(".gb"), None
    if kind == "gb_missing_rom":
        return stem.with_suffix(".gb"), None
    if kind == "gb_config_ram":
        data = _catch_config(rng, note)
        path = stem.with_suffix(".toml")
        path.write_text(_toml(data))
        return path, _catch_checkpoint(stem.with_suffix(".pt"), json.dumps(data))
    if kind == "gb_foreign_state":
        other = bytearray(build_rom())
        other[0x134:0x13C] = b"OAKOTHER"
        other[0x14D] = header_checksum(other)
        other_sha = roms.sha256(bytes(other))
        env = make_env(EnvSpec(game="catch", noop_max=0, repeat_action_probability=0.0))
        try:
            env.reset(seed=int(rng.integers(0, 100)))
            for _ in range(int(rng.integers(0, 20))):
                env.step(int(rng.integers(0, 3)))
            buffer = io.BytesIO()
            env.unwrapped.emulator.save_state(buffer)
        finally:
            env.close()
        state = stem.with_suffix(".state")
        state.write_bytes(roms.state_bytes(other_sha, buffer.getvalue()))
        import tomllib

        from oakemu_rl.envs.gameconfig import shipped_games

        data = tomllib.loads(shipped_games()["catch"].read_text())
        data["start"] = {"mode": "state", "state": state.name}
        path = stem.with_suffix(".toml")
        path.write_text(_toml(data))
        data["start"] = {"mode": "state", "state_sha256": roms.add_state(state)}
        note.append(f"saved on {other_sha[:12]}")
        return path, _catch_checkpoint(stem.with_suffix(".pt"), json.dumps(data))
    raise ValueError(kind)


def _record_options() -> set[str]:
    """The options `oakemu record` has (`--rom` and `--game-config` are being added)."""
    from oakemu_rl.cli import cli

    return {name for param in cli.commands["record"].params for name in param.opts}


@dataclass
class Case:
    index: int
    target: str  # "demo" or "checkpoint"
    kind: str
    path: Path
    note: str
    commands: list[list[str]] = field(default_factory=list)
    checkpoint: Path | None = None
    """Game Boy config kinds: a catch checkpoint whose env spec stores the case's config."""


def make_case(index: int, target: str, kind: str, demo: Path, checkpoint: Path, out_dir: Path,
              rng: np.random.Generator, marker: Path) -> Case:
    """Write mutated file number `index` and say which commands read it."""
    if target == "gameboy":
        note: list[str] = []
        path, stored = _gameboy_case(index, kind, out_dir, rng, note)
        return Case(index, target, kind, path, "; ".join(note), checkpoint=stored)
    base = demo if target == "demo" else checkpoint
    path = out_dir / f"case{index:05d}_{kind}{'.h5' if target == 'demo' else '.pt'}"
    note: list[str] = []
    if kind in ("truncate", "flip", "zero_block", "random_bytes"):
        path.write_bytes(_byte_mutation(kind, base.read_bytes(), rng))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
    elif kind == "missing":
        pass
    elif kind == "cross":
        shutil.copyfile(checkpoint if target == "demo" else demo, path)
    elif target == "demo" and kind == "other_hdf5":
        _other_hdf5(path, rng, note)
    elif target == "demo":
        shutil.copyfile(base, path)
        _h5_mutation(kind, path, rng, note)
    else:
        _ckpt_mutation(kind, base, path, rng, note, marker)
    return Case(index, target, kind, path, "; ".join(note))


def commands_for(case: Case, run_dir: Path, rng: np.random.Generator,
                 heavy_share: float) -> list[list[str]]:
    """The CLI invocations that read `case.path`: the cheap readers always, the training
    and testing commands for a share of the cases."""
    p = str(case.path)
    if case.target == "gameboy":
        record = ["record", "--game", "catch", "--demonstrator", "scripted", "--episodes", "1",
                  "--max-steps", "5", "--out", str(run_dir / f"gb{case.index}.h5")]
        options = _record_options()
        if case.kind in ("gb_config_ram", "gb_foreign_state"):
            commands = [["test", str(case.checkpoint), "--episodes", "1", "--max-steps", "5",
                         "--device", "cpu"]]
            if "--game-config" in options:
                commands.append([*record, "--game-config", p])
        else:
            commands = [["envs", "--rom", p]]
            if "--rom" in options:
                commands.append([*record, "--rom", p])
        return commands
    heavy = rng.random() < heavy_share or case.kind in ("h5_spec", "ckpt_spec")
    if case.target == "demo":
        commands = [["demos", "validate", p], ["demos", "info", p]]
        if heavy:
            commands.append(["bootstrap", "bc", p, "--epochs", "1", "--architecture", "tiny",
                             "--batch-size", "16", "--device", "cpu", "--no-progress",
                             "--run-dir", str(run_dir / f"bc{case.index}")])
    else:
        commands = [["info", p]]
        if heavy:
            commands.append(["test", p, "--episodes", "1", "--max-steps", "5", "--device",
                             "cpu"])
    return commands


# -- running one command in a forked child ------------------------------------------------------


@dataclass
class Outcome:
    outcome: str
    exit_code: int | None
    last_line: str
    detail: str = ""


def classify(exit_code: int, exception: BaseException | None, output: str,
             stderr: str) -> tuple[str, str]:
    """The outcome of one run: `output` is stdout and stderr interleaved."""
    lines = [line for line in output.splitlines() if line.strip()]
    if exception is not None and not isinstance(exception, SystemExit):
        return "traceback", f"{type(exception).__name__}: {str(exception)[:300]}"
    if "Traceback (most recent call last)" in output:
        return "traceback", "a traceback was printed"
    if exit_code == 0:
        return "ok", ""
    errors = [line for line in lines if line.startswith("Error: ")]
    err_lines = stderr.strip().splitlines()
    if len(errors) == 1 and err_lines and err_lines[-1] == errors[0]:
        return "error", ""
    return "bad-error", f"{len(errors)} 'Error: ' lines; last line {lines[-1] if lines else ''!r}"


def run_in_child(args: list[str], timeout: float, cwd: Path) -> Outcome:
    """`oakemu ARGS` through CliRunner in a forked child, killed by SIGALRM after `timeout`."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(read_fd)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # C libraries' own messages stay off the report
            os.dup2(devnull, 2)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, math.ceil(timeout)))
            os.chdir(cwd)
            from click.testing import CliRunner

            from oakemu_rl.cli import cli

            result = CliRunner().invoke(cli, args)
            outcome, detail = classify(result.exit_code, result.exception, result.output,
                                       result.stderr)
            if outcome == "traceback" and result.exc_info is not None:
                import traceback

                detail += "\n" + "".join(traceback.format_exception(*result.exc_info))[-1500:]
            lines = [line for line in result.output.splitlines()
                     if line.startswith("Error: ")] or result.output.splitlines()
            message = json.dumps({"outcome": outcome, "exit_code": result.exit_code,
                                  "last_line": lines[-1][:300] if lines else "",
                                  "detail": detail}).encode()
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(message)
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGALRM:
            return Outcome("hang", None, "", f"no result after {timeout:.0f}s")
        return Outcome("crash", None, "", f"killed by {signal.Signals(sig).name}")
    if not chunks:
        return Outcome("crash", None, "", f"the child exited {os.WEXITSTATUS(status)} silently")
    data = json.loads(b"".join(chunks))
    return Outcome(data["outcome"], data["exit_code"], data["last_line"], data["detail"])


# -- the campaign ---------------------------------------------------------------------------------


@dataclass
class Report:
    files: int = 0
    runs: int = 0
    seconds: float = 0.0
    by_outcome: collections.Counter = field(default_factory=collections.Counter)
    by_kind: dict[str, collections.Counter] = field(default_factory=dict)
    by_command: dict[str, collections.Counter] = field(default_factory=dict)
    failures: list[tuple[Case, list[str], Outcome]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def plan(cases: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """(target, kind) of each case: every kind about equally often, demos, checkpoints and
    Game Boy inputs."""
    all_kinds = ([("demo", k) for k in DEMO_KINDS] + [("checkpoint", k) for k in CKPT_KINDS]
                 + [("gameboy", k) for k in GB_KINDS])
    order = [all_kinds[i % len(all_kinds)] for i in range(cases)]
    rng.shuffle(order)
    return order


def _warm_imports() -> None:
    """Import in the parent what the children use, so each fork starts warm."""
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    for name in ("matplotlib.pyplot", "torch.utils.tensorboard", "click.testing",
                 "oakemu_rl.cli", "oakemu_rl.demos", "oakemu_rl.bootstrap.bc",
                 "oakemu_rl.tester", "oakemu_rl.envs.gameboy", "oakemu_rl.envs.gbgame.build"):
        importlib.import_module(name)


def fuzz(cases: int, seed: int, workdir: Path, *, timeout: float = 30.0,
         heavy_share: float = 0.25, progress: Callable[[str], None] | None = None) -> Report:
    """Make `cases` mutated files under `workdir` and run each through the CLI."""
    workdir = Path(workdir)
    # Game Boy cases add ROMs and save states to the store: never to the user's.
    os.environ.setdefault("OAKEMU_ROM_DIR", str(workdir / "roms"))
    _warm_imports()
    demo, checkpoint = build_base(workdir / "base")
    out_dir = workdir / "cases"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cwd = workdir / "cwd"
    cwd.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    report = Report()
    started = time.perf_counter()
    for index, (target, kind) in enumerate(plan(cases, rng)):
        marker = workdir / f"MARKER_{index}"
        case = make_case(index, target, kind, demo, checkpoint, out_dir, rng, marker)
        case.commands = commands_for(case, workdir / "runs", rng, heavy_share)
        report.files += 1
        for args in case.commands:
            outcome = run_in_child(args, timeout, cwd)
            if marker.exists():
                outcome = Outcome("code-ran", outcome.exit_code, outcome.last_line,
                                  f"{marker} was created: the pickle payload ran")
            report.runs += 1
            report.by_outcome[outcome.outcome] += 1
            report.by_kind.setdefault(f"{target}:{kind}", collections.Counter())[
                outcome.outcome] += 1
            command = " ".join(args[:2]) if args[0] in ("demos", "bootstrap") else args[0]
            report.by_command.setdefault(command, collections.Counter())[outcome.outcome] += 1
            if outcome.outcome not in ALLOWED:
                report.failures.append((case, args, outcome))
        if progress and (index + 1) % 50 == 0:
            progress(f"{index + 1}/{cases} files, {report.runs} runs, "
                     f"{len(report.failures)} failures, {time.perf_counter() - started:.0f}s")
    report.seconds = time.perf_counter() - started
    return report


def format_report(report: Report) -> str:
    columns = ("ok", "error", *FAILURES)
    lines = [f"{report.files} mutated files, {report.runs} CLI runs, {report.seconds:.0f}s",
             "", "outcome      runs"]
    lines += [f"{name:<12} {report.by_outcome.get(name, 0):>5}" for name in columns]

    def table(title: str, rows: dict[str, collections.Counter]) -> list[str]:
        out = ["", f"{title:<26}" + "".join(f"{c:>10}" for c in columns)]
        for name in sorted(rows):
            out.append(f"{name:<26}" + "".join(f"{rows[name].get(c, 0):>10}" for c in columns))
        return out

    lines += table("by command", report.by_command)
    lines += table("by mutation kind", report.by_kind)
    if report.failures:
        lines += ["", f"{len(report.failures)} FAILURES:"]
        for case, args, outcome in report.failures[:40]:
            lines.append(f"- {outcome.outcome}: oakemu {' '.join(args)}  [{case.kind}: "
                         f"{case.note}]  {outcome.last_line!r} {outcome.detail[:2000]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="mutated files to make")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per CLI run")
    parser.add_argument("--heavy-share", type=float, default=0.25,
                        help="share of files also run through `bootstrap bc` / `test`")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the files go (default: a new temporary folder, kept)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="oakemu-fuzz-"))
    os.environ.setdefault("OAKEMU_RUNS", str(workdir / "runs_root"))
    print(f"fuzzing {args.cases} files (seed {args.seed}) in {workdir}", flush=True)
    report = fuzz(args.cases, args.seed, workdir, timeout=args.timeout,
                  heavy_share=args.heavy_share, progress=lambda s: print(s, flush=True))
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
