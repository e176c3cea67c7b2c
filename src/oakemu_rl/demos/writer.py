"""Append episodes to a demonstration file without ever leaving it half-written.

HDF5 files are not crash-safe: a process killed while HDF5 updates its metadata can
leave the whole file unreadable. So each episode is committed by copy-on-write: the
current file is copied beside itself, the episode is added to the copy, the copy is
fsynced and renamed over the original. A kill at any moment leaves either the file as
it was or the file with the new episode — every committed episode stays readable. The
copy costs about 70 bytes per stored frame (benchmarks/demo_storage.py).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from .. import __version__
from ..envs import EnvSpec, action_mask, action_meanings
from ..errors import DemoFileError
from ..fsutil import commit, temp_beside
from . import schema
from .reader import DemoFile

# HDF5's 1.10 file format checksums every metadata block (superblock, object headers,
# B-trees), so a damaged file is reported instead of parsed. Text attributes are stored as
# fixed-length byte strings, inside those checksummed headers: h5py's default for `str`
# (variable-length) puts them in the global heap, which has no checksum, and one bad size
# byte there sends libhdf5 into an endless loop.
_LIBVER = ("v110", "latest")


def _text(value: str) -> np.bytes_:
    return np.bytes_(value.encode("utf-8"))


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _ale_version() -> str:
    try:
        from importlib.metadata import version

        return version("ale-py")
    except Exception:
        return "unknown"


@dataclass
class EpisodeBuffer:
    """Steps of the episode being played, kept in memory until it is committed."""

    frames: list[np.ndarray] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    terminations: list[bool] = field(default_factory=list)
    truncations: list[bool] = field(default_factory=list)

    def add(self, frame: np.ndarray, action: int, reward: float, terminated: bool,
            truncated: bool) -> None:
        """Record that `action` was taken on the observation whose newest frame is `frame`."""
        self.frames.append(np.asarray(frame, dtype=np.uint8).copy())
        self.actions.append(int(action))
        self.rewards.append(float(reward))
        self.terminations.append(bool(terminated))
        self.truncations.append(bool(truncated))

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def episode_return(self) -> float:
        return float(sum(self.rewards))

    def clear(self) -> None:
        for values in (self.frames, self.actions, self.rewards, self.terminations,
                       self.truncations):
            values.clear()


class DemoWriter:
    """Writes episodes to `path`, creating it or appending to a file with the same spec."""

    def __init__(self, path: str | os.PathLike[str], spec: EnvSpec) -> None:
        self.path = Path(path)
        self.spec = spec.for_evaluation()  # demos keep raw rewards and whole games
        self.action_meanings = list(action_meanings(spec))
        self.action_mask = action_mask(spec)
        if self.path.exists():
            with DemoFile(self.path) as existing:
                if existing.spec != self.spec:
                    raise DemoFileError(
                        f"cannot append to {self.path}: it was recorded with a different env "
                        f"spec ({_spec_difference(existing.spec, self.spec)}); choose another "
                        "--out file"
                    )
                self._next_index = max((e.index for e in existing.episodes), default=-1) + 1
        else:
            self._create()
            self._next_index = 0

    def _create(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DemoFileError(f"cannot create {self.path.parent}: {error.strerror}") from None

        def build(handle: h5py.File) -> None:
            handle.attrs["format"] = _text(schema.FORMAT)
            handle.attrs["schema_version"] = schema.SCHEMA_VERSION
            handle.attrs["env_spec"] = _text(self.spec.to_json())
            handle.attrs["action_meanings"] = _text(json.dumps(self.action_meanings))
            handle.attrs["action_mask"] = _text(json.dumps(self.action_mask.tolist()))
            handle.attrs["frame_shape"] = np.array(self.spec.frame_shape, dtype=np.int64)
            handle.attrs["package_version"] = _text(__version__)
            handle.attrs["ale_py_version"] = _text(_ale_version())
            handle.attrs["created_at"] = _text(_now())
            data = handle.create_group("data")
            data.attrs["total"] = 0
            data.attrs["episodes"] = 0

        self._commit(build, start_from=None)

    def _commit(self, change, start_from: Path | None) -> None:
        """Apply `change` to a copy of the file (or a new file) and rename it into place."""
        tmp = temp_beside(self.path)
        try:
            if start_from is not None:
                shutil.copyfile(start_from, tmp)
            with h5py.File(tmp, "a" if start_from is not None else "w",
                           libver=_LIBVER) as handle:
                change(handle)
        except BaseException as error:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(error, OSError):
                raise DemoFileError(f"cannot write {self.path}: {error.strerror or error}") \
                    from None
            raise
        commit(tmp, self.path)

    def write_episode(self, episode: EpisodeBuffer, *, recorder: str, seed: int) -> int:
        """Commit one finished episode; returns its index (the N of data/demo_N)."""
        return self.write_episodes([(episode, recorder, seed)])[0]

    def write_episodes(self, episodes: list[tuple[EpisodeBuffer, str, int]]) -> list[int]:
        """Commit several finished episodes, as (buffer, recorder, seed), in one copy."""
        prepared = [self._arrays(buffer, recorder) for buffer, recorder, _ in episodes]
        first = self._next_index

        def add(handle: h5py.File) -> None:
            data = handle["data"]
            pairs = zip(prepared, episodes, strict=True)
            for offset, (arrays, (_, recorder, seed)) in enumerate(pairs):
                group = data.create_group(schema.episode_name(first + offset))
                for key, values in arrays.items():
                    if key == "frames":
                        group.create_dataset(
                            key,
                            data=values,
                            chunks=(min(schema.FRAME_CHUNK, len(values)), *values.shape[1:]),
                            compression=schema.COMPRESSION,
                            compression_opts=schema.COMPRESSION_LEVEL,
                        )
                    else:
                        group.create_dataset(key, data=values)
                length = len(arrays["actions"])
                group.attrs["recorder"] = _text(recorder)
                group.attrs["seed"] = int(seed)
                group.attrs["return"] = float(arrays["rewards"].sum(dtype=np.float64))
                group.attrs["length"] = length
                group.attrs["num_samples"] = length
                group.attrs["created_at"] = _text(_now())
                data.attrs["total"] = int(data.attrs["total"]) + length
                data.attrs["episodes"] = int(data.attrs["episodes"]) + 1

        self._commit(add, start_from=self.path)
        self._next_index += len(episodes)
        return list(range(first, self._next_index))

    def _arrays(self, episode: EpisodeBuffer, recorder: str) -> dict[str, np.ndarray]:
        if recorder not in schema.RECORDERS:
            raise ValueError(f"recorder must be one of {schema.RECORDERS}, got {recorder!r}")
        if len(episode) == 0:
            raise ValueError("cannot write an empty episode")
        frames = np.stack(episode.frames).astype(np.uint8, copy=False)
        if frames.shape[1:] != self.spec.frame_shape:
            raise ValueError(
                f"frames are {frames.shape[1:]}, the spec makes {self.spec.frame_shape}"
            )
        actions = np.asarray(episode.actions, dtype=np.int64)
        if actions.min() < 0 or actions.max() >= len(self.action_meanings):
            raise ValueError("an action is out of range for this game")
        return {
            "frames": frames,
            "actions": actions,
            "rewards": np.asarray(episode.rewards, dtype=np.float32),
            "terminations": np.asarray(episode.terminations, dtype=bool),
            "truncations": np.asarray(episode.truncations, dtype=bool),
        }


_MERGE_BATCH_FRAMES = 20_000
"""Merge commits this many frames at a time (about 140 MB in memory)."""


def _spec_difference(old: EnvSpec, new: EnvSpec) -> str:
    a, b = old.to_dict(), new.to_dict()
    diffs = [f"{k}: file {a[k]!r}, now {b[k]!r}" for k in a if a[k] != b.get(k)]
    return "; ".join(diffs) or "same values"


def merge_demo_files(out: str | os.PathLike[str], inputs: list[str | os.PathLike[str]]) -> int:
    """Copy every episode of `inputs` (all with one spec) into `out`; returns episodes copied."""
    if not inputs:
        raise DemoFileError("merge needs at least one input file")
    out_path = Path(out)
    sources = [DemoFile(p) for p in inputs]
    try:
        spec = sources[0].spec
        for source in sources[1:]:
            if source.spec != spec:
                raise DemoFileError(
                    f"cannot merge {source.path} with {sources[0].path}: different env specs "
                    f"({_spec_difference(sources[0].spec, source.spec)})"
                )
        if any(out_path.exists() and out_path.samefile(s.path) for s in sources):
            raise DemoFileError(f"the merge output {out_path} is also an input")
        writer = DemoWriter(out_path, spec)
        copied = 0
        batch: list[tuple[EpisodeBuffer, str, int]] = []
        batch_frames = 0
        for source in sources:
            for i, info in enumerate(source.episodes):
                buffer = EpisodeBuffer(
                    frames=list(source.read(i, "frames")),
                    actions=source.read(i, "actions").tolist(),
                    rewards=source.read(i, "rewards").tolist(),
                    terminations=source.read(i, "terminations").tolist(),
                    truncations=source.read(i, "truncations").tolist(),
                )
                batch.append((buffer, info.recorder, info.seed))
                batch_frames += len(buffer)
                if batch_frames >= _MERGE_BATCH_FRAMES:
                    copied += len(writer.write_episodes(batch))
                    batch, batch_frames = [], 0
        if batch:
            copied += len(writer.write_episodes(batch))
        return copied
    finally:
        for source in sources:
            source.close()
