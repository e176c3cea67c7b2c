"""Open, validate and read demonstration files.

`DemoFile` checks the whole layout when it opens (cheap: metadata only) and reads frames
lazily. Its h5py handle is opened per process on first use, so a `DemoFile` can be handed
to DataLoader workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..envs.spec import EnvSpec, actions_agree, require_same_env
from ..errors import DemoFileError, EnvError
from . import schema


class DamagedDemoError(DemoFileError, OSError):
    """A damaged chunk met while reading frames: a `DemoFileError` (so the CLI prints one
    line) that is still the `OSError` h5py raises, for code that catches that."""


@dataclass(frozen=True)
class EpisodeInfo:
    index: int
    name: str
    length: int
    episode_return: float
    recorder: str
    seed: int
    terminated: bool
    truncated: bool


def _attr_text(attrs: Any, key: str) -> str:
    value = attrs[key]
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        raise TypeError(key)
    return value


def _open_h5(path: Path) -> h5py.File:
    if not path.exists():
        raise DemoFileError(f"demo file {path} does not exist")
    if path.is_dir():
        raise DemoFileError(f"demo file {path} is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError:
        raise DemoFileError(
            f"{path} is not a readable HDF5 file (truncated, corrupt or another format)"
        ) from None


class DemoFile:
    """A validated demonstration file. Use as a context manager or call `close()`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._handle: h5py.File | None = None
        self._pid = -1
        try:
            with _open_h5(self.path) as handle:
                self._read_header(handle)
                self.episodes = self._read_episodes(handle)
                self.split = self._read_split(handle)
        except DemoFileError:
            raise
        except (KeyError, TypeError, ValueError, OSError, RuntimeError, OverflowError,
                IndexError) as error:
            # h5py reports damage deep inside a file as any of these; a damaged number
            # (inf, a huge value) as OverflowError.
            raise DemoFileError(f"demo file {self.path} is damaged: {_short(error)}") from None

    # -- validation -----------------------------------------------------------------

    def _fail(self, what: str) -> DemoFileError:
        return DemoFileError(f"demo file {self.path} {what}")

    def _read_header(self, handle: h5py.File) -> None:
        attrs = handle.attrs
        if attrs.get("format") is None or _attr_text(attrs, "format") != schema.FORMAT:
            raise self._fail("is not an OakEmu-RL demo file (no 'format' attribute "
                             f"'{schema.FORMAT}')")
        missing = [key for key in schema.FILE_ATTRS if key not in attrs]
        if missing:
            raise self._fail(f"lacks the file attribute '{missing[0]}'")
        version = attrs["schema_version"]
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
            raise self._fail("has a malformed schema_version attribute")
        if int(version) > schema.SCHEMA_VERSION:
            raise self._fail(
                f"has schema version {int(version)}, newer than this OakEmu-RL reads "
                f"({schema.SCHEMA_VERSION}); upgrade oakemu-rl"
            )
        if int(version) < 1:
            raise self._fail(f"has an invalid schema version {int(version)}")
        self.schema_version = int(version)
        try:
            self.spec = EnvSpec.from_json(_attr_text(attrs, "env_spec"))
        except EnvError as error:
            raise self._fail(f"has an unusable env_spec attribute: {error}") from None
        meanings = json.loads(_attr_text(attrs, "action_meanings"))
        mask = json.loads(_attr_text(attrs, "action_mask"))
        if not actions_agree(meanings, mask):
            raise self._fail("has action_meanings and action_mask attributes that disagree")
        forbidden = set(self.spec.forbidden_actions)
        if not forbidden <= set(meanings) or [m not in forbidden for m in meanings] != mask:
            raise self._fail("has an action_mask attribute that disagrees with the "
                             "forbidden_actions of its env_spec attribute")
        self.action_meanings: list[str] = meanings
        self.action_mask = np.array(mask, dtype=bool)
        frame_shape = tuple(int(v) for v in np.asarray(attrs["frame_shape"]).reshape(-1))
        if frame_shape != self.spec.frame_shape:
            raise self._fail(
                f"says frames are {frame_shape} but its env spec makes {self.spec.frame_shape}"
            )
        self.frame_shape = frame_shape
        self.attrs = {key: _plain(attrs[key]) for key in attrs}
        if "data" not in handle or not isinstance(handle["data"], h5py.Group):
            raise self._fail("has no 'data' group")

    def _read_episodes(self, handle: h5py.File) -> list[EpisodeInfo]:
        data = handle["data"]
        names = list(data.keys())
        indexed = []
        for name in names:
            index = schema.episode_index(name)
            if index is None or not isinstance(data[name], h5py.Group):
                raise self._fail(f"has an unexpected entry data/{name}")
            indexed.append((index, name))
        indexed.sort()
        episodes = []
        for index, name in indexed:
            episodes.append(self._check_episode(data[name], index, name))
        if "total" in data.attrs and int(data.attrs["total"]) != sum(e.length for e in episodes):
            raise self._fail("has a data/total attribute that does not match its episodes")
        return episodes

    def _check_episode(self, group: h5py.Group, index: int, name: str) -> EpisodeInfo:
        length = None
        for key, (dtype, is_frames) in schema.EPISODE_DATASETS.items():
            if key not in group or not isinstance(group[key], h5py.Dataset):
                raise self._fail(f"lacks the dataset data/{name}/{key}")
            dataset = group[key]
            if dataset.dtype != dtype:
                raise self._fail(
                    f"has data/{name}/{key} of dtype {dataset.dtype}, expected {dtype}"
                )
            expected_tail = self.frame_shape if is_frames else ()
            if dataset.ndim != 1 + len(expected_tail) or dataset.shape[1:] != expected_tail:
                raise self._fail(
                    f"has data/{name}/{key} of shape {dataset.shape}, expected "
                    f"(steps, {', '.join(map(str, expected_tail))})".replace(", )", ")")
                )
            if length is None:
                length = dataset.shape[0]
            elif dataset.shape[0] != length:
                raise self._fail(f"has datasets of different lengths in data/{name}")
        assert length is not None
        if length < 1:
            raise self._fail(f"has an empty episode data/{name}")
        missing = [key for key in schema.EPISODE_ATTRS if key not in group.attrs]
        if missing:
            raise self._fail(f"lacks the attribute '{missing[0]}' on data/{name}")
        if int(group.attrs["length"]) != length:
            raise self._fail(f"has data/{name} whose length attribute disagrees with its data")
        recorder = _attr_text(group.attrs, "recorder")
        if recorder not in schema.RECORDERS:
            raise self._fail(f"has an unknown recorder kind {recorder!r} on data/{name}")
        actions = group["actions"][()]
        if actions.min() < 0 or actions.max() >= len(self.action_meanings):
            raise self._fail(f"has out-of-range actions in data/{name}")
        if not np.isfinite(group["rewards"][()]).all():
            raise self._fail(f"has non-finite rewards in data/{name}")
        return EpisodeInfo(
            index=index,
            name=name,
            length=int(length),
            episode_return=float(group.attrs["return"]),
            recorder=recorder,
            seed=int(group.attrs["seed"]),
            terminated=bool(group["terminations"][-1]),
            truncated=bool(group["truncations"][-1]),
        )

    def _read_split(self, handle: h5py.File) -> dict[str, list[str]] | None:
        if "mask" not in handle:
            return None
        split = {}
        names = {e.name for e in self.episodes}
        for key in ("train", "valid"):
            if key not in handle["mask"]:
                raise self._fail(f"has a 'mask' group without mask/{key}")
            values = [v.decode() if isinstance(v, bytes) else str(v)
                      for v in handle["mask"][key][()]]
            unknown = sorted(set(values) - names)
            if unknown:
                raise self._fail(f"has mask/{key} naming a missing episode {unknown[0]}")
            split[key] = values
        return split

    # -- reading ----------------------------------------------------------------------

    @property
    def handle(self) -> h5py.File:
        """This process's read handle, opened on first use (safe across fork)."""
        if self._handle is None or self._pid != os.getpid():
            self._handle = _open_h5(self.path)
            self._pid = os.getpid()
        return self._handle

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None
        state["_pid"] = -1
        return state

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None

    def __enter__(self) -> DemoFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_steps(self) -> int:
        return sum(e.length for e in self.episodes)

    def _dataset(self, episode: int, key: str) -> h5py.Dataset:
        return self.handle["data"][self.episodes[episode].name][key]

    def read(self, episode: int, key: str, sl: slice | None = None) -> np.ndarray:
        """One dataset of episode number `episode` (position in `episodes`), or a slice.
        A damaged chunk (found only when it is read) raises `DemoFileError`."""
        try:
            dataset = self._dataset(episode, key)
            return dataset[()] if sl is None else dataset[sl]
        except (OSError, RuntimeError, KeyError) as error:
            raise DamagedDemoError(f"demo file {self.path} is damaged: {_short(error)}") \
                from None

    def observation(self, episode: int, t: int) -> np.ndarray:
        """The stacked observation actions[t] was chosen on."""
        length = self.episodes[episode].length
        if not 0 <= t < length:
            raise IndexError(f"step {t} is outside episode {episode} (steps 0..{length - 1})")
        k = self.spec.frame_stack
        lo = max(0, t - k + 1)
        frames = self.read(episode, "frames", slice(lo, t + 1))
        return schema.stack_frames(frames, t - lo, k)

    def summary(self) -> dict[str, Any]:
        returns = np.array([e.episode_return for e in self.episodes], dtype=np.float64)
        hist = np.zeros(len(self.action_meanings), dtype=np.int64)
        for i in range(len(self.episodes)):
            hist += np.bincount(self.read(i, "actions"), minlength=len(hist))
        size = self.path.stat().st_size
        return {
            "path": str(self.path),
            "schema_version": self.schema_version,
            "env_spec": self.spec.to_dict(),
            "episodes": len(self.episodes),
            "steps": self.num_steps,
            "returns": {
                "mean": float(returns.mean()) if len(returns) else None,
                "std": float(returns.std()) if len(returns) else None,
                "min": float(returns.min()) if len(returns) else None,
                "max": float(returns.max()) if len(returns) else None,
            },
            "recorders": sorted({e.recorder for e in self.episodes}),
            "action_histogram": dict(zip(self.action_meanings, hist.tolist(), strict=True)),
            "action_mask": dict(zip(self.action_meanings, self.action_mask.tolist(), strict=True)),
            "bytes": size,
            "bytes_per_frame": round(size / self.num_steps, 1) if self.num_steps else None,
            "split": None if self.split is None
            else {k: len(v) for k, v in self.split.items()},
        }


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:200]


def validate_demo_file(path: str | os.PathLike[str]) -> DemoFile:
    """Open `path` fully checked, reading every dataset once to catch damaged chunks."""
    demo = DemoFile(path)
    try:
        for i in range(len(demo.episodes)):
            for key in schema.EPISODE_DATASETS:
                demo.read(i, key)
    except (OSError, RuntimeError, ValueError, KeyError, DemoFileError) as error:
        demo.close()
        if isinstance(error, DemoFileError):
            raise
        raise DemoFileError(f"demo file {demo.path} is damaged: {_short(error)}") from None
    return demo


def open_demo_files(paths: Sequence[str | os.PathLike[str]]) -> list[DemoFile]:
    """Open demo files that share one env spec, or say which one differs."""
    demos = [DemoFile(p) for p in paths]
    for demo in demos[1:]:
        require_same_env(f"demo files {demos[0].path}", demos[0].spec, demos[0].action_meanings,
                         str(demo.path), demo.spec, demo.action_meanings,
                         hint="merge only matching files", error=DemoFileError)
    return demos
