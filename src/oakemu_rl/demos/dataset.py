"""(observation, action) samples from demo files, with memory that does not grow with them.

Frames are stored once per step; a sample's observation is rebuilt as a window of
`frame_stack` frames over a *segment* of frames padded with zeros in front (so a stack
never reaches before its episode's start). Two modes:

- **cached**: when all frames fit in `cache_bytes`, every episode is read once and kept;
  each epoch is a uniform shuffle of all samples.
- **streaming**: otherwise the episodes are cut into blocks of `block_size` steps; an
  epoch shuffles the blocks, reads `shuffle_blocks` of them at a time (a few tens of MB),
  shuffles the samples within that group and yields them. Resident frames never exceed
  `shuffle_blocks × (block_size + frame_stack − 1)`, whatever the files' size.

The dataset is a torch `IterableDataset`; each DataLoader worker takes every W-th group
and opens its own h5py handles (`DemoFile` reopens lazily after a fork).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .reader import DemoFile


@dataclass(frozen=True)
class EpisodeRef:
    file: int
    episode: int
    length: int


def _padded_frames(demo: DemoFile, episode: int, start: int, stop: int, k: int) -> np.ndarray:
    """Frames start-k+1 .. stop-1 of an episode, zeros before its first frame."""
    lo = max(0, start - k + 1)
    frames = demo.read(episode, "frames", slice(lo, stop))
    missing = (k - 1) - (start - lo)
    if missing > 0:
        pad = np.zeros((missing, *frames.shape[1:]), dtype=frames.dtype)
        frames = np.concatenate([pad, frames])
    return frames


def _windows(frames: np.ndarray, k: int) -> np.ndarray:
    """View of shape (len - k + 1, k, H, W): window j is the observation at step j."""
    return np.lib.stride_tricks.sliding_window_view(frames, k, axis=0).transpose(0, 3, 1, 2)


class DemoDataset(IterableDataset):
    """Batches of (observations uint8 (B, k, H, W), actions int64 (B,)) from `episodes`."""

    def __init__(
        self,
        demos: list[DemoFile],
        episodes: list[EpisodeRef],
        *,
        batch_size: int,
        action_mask: np.ndarray,
        shuffle: bool = True,
        seed: int = 0,
        cache_bytes: int = 2 << 30,
        block_size: int = 256,
        shuffle_blocks: int = 32,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        super().__init__()
        self.demos = demos
        self.episodes = episodes
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.k = demos[0].spec.frame_stack
        self.block_size = block_size
        self.shuffle_blocks = shuffle_blocks
        self.action_mask = np.asarray(action_mask, dtype=bool)
        frame_bytes = int(np.prod(demos[0].frame_shape))
        total = sum(e.length for e in episodes)
        self.cached = total * frame_bytes <= cache_bytes
        self._cache: dict[int, np.ndarray] = {}
        # Actions are small: keep them all, and the positions whose action is allowed.
        self._actions = [demos[e.file].read(e.episode, "actions") for e in episodes]
        self.total_samples = int(sum(self.action_mask[a].sum() for a in self._actions))
        self.dropped = total - self.total_samples
        # (rank, ranks): this rank keeps every ranks-th sample of the epoch's one global
        # order, the same number on every rank (the last total % ranks samples sit out an
        # epoch), so no sample is seen twice in an epoch and every rank takes as many steps.
        self.rank, self.ranks = shard
        self.num_samples = self.total_samples // self.ranks
        self.max_resident_frames = 0

    def action_counts(self, n_actions: int) -> np.ndarray:
        counts = np.zeros(n_actions, dtype=np.int64)
        for actions in self._actions:
            counts += np.bincount(actions[self.action_mask[actions]], minlength=n_actions)
        return counts

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches per epoch (the last may be short)."""
        return -(-self.num_samples // self.batch_size)

    # -- segments -------------------------------------------------------------------------

    def _segments(self) -> list[tuple[int, int, int]]:
        """(episode position, start, stop) pieces that are read together."""
        if self.cached:
            return [(i, 0, e.length) for i, e in enumerate(self.episodes)]
        pieces = []
        for i, e in enumerate(self.episodes):
            for start in range(0, e.length, self.block_size):
                pieces.append((i, start, min(e.length, start + self.block_size)))
        return pieces

    def _allowed(self, piece: tuple[int, int, int]) -> int:
        """Samples of a segment whose action the mask allows."""
        i, start, stop = piece
        return int(self.action_mask[self._actions[i][start:stop]].sum())

    def _load(self, piece: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(windows view, actions, allowed positions) of one segment."""
        i, start, stop = piece
        ref = self.episodes[i]
        if self.cached:
            frames = self._cache.get(i)
            if frames is None:
                frames = _padded_frames(self.demos[ref.file], ref.episode, 0, ref.length, self.k)
                self._cache[i] = frames
        else:
            frames = _padded_frames(self.demos[ref.file], ref.episode, start, stop, self.k)
        actions = self._actions[i][start:stop]
        return _windows(frames, self.k), actions, np.flatnonzero(self.action_mask[actions])

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        pieces = self._segments()
        order = rng.permutation(len(pieces)) if self.shuffle else np.arange(len(pieces))
        group = len(pieces) if self.cached else self.shuffle_blocks
        groups = [order[i:i + group] for i in range(0, len(order), group)]
        counts = [self._allowed(pieces[j]) for j in order]
        offsets = np.concatenate([[0], np.cumsum(counts)])[::group] if counts else [0]
        groups = [(g, members, offsets[g]) for g, members in enumerate(groups)]
        worker = get_worker_info()
        if worker is not None:
            groups = groups[worker.id::worker.num_workers]
        carry: tuple[np.ndarray, np.ndarray] | None = None  # a short batch from the last group
        for g, members, offset in groups:
            loaded = [self._load(pieces[j]) for j in members]
            if not self.cached:
                self.max_resident_frames = max(
                    self.max_resident_frames,
                    sum(w.shape[0] + self.k - 1 for w, _, _ in loaded),
                )
            index = np.concatenate(
                [np.stack([np.full(len(pos), n), pos], 1) for n, (_, _, pos) in enumerate(loaded)]
            )
            if self.shuffle:
                index = index[np.random.default_rng([self.seed, self.epoch, g]).permutation(
                    len(index))]
            if self.ranks > 1:
                position = offset + np.arange(len(index))
                index = index[(position % self.ranks == self.rank)
                              & (position < self.ranks * self.num_samples)]
                if len(index) == 0:
                    continue
            start = 0
            if carry is not None:  # top up the previous group's short batch first
                start = self.batch_size - len(carry[1])
                obs, act = self._gather(loaded, index[:start])
                carry = (np.concatenate([carry[0], obs]), np.concatenate([carry[1], act]))
                if len(carry[1]) < self.batch_size:
                    continue
                yield torch.from_numpy(carry[0]), torch.from_numpy(carry[1])
                carry = None
            for b in range(start, len(index), self.batch_size):
                obs, act = self._gather(loaded, index[b:b + self.batch_size])
                if len(act) < self.batch_size:
                    carry = (obs, act)
                    break
                yield torch.from_numpy(obs), torch.from_numpy(act)
        if carry is not None and len(carry[1]):
            yield torch.from_numpy(carry[0]), torch.from_numpy(carry[1])

    @staticmethod
    def _gather(loaded, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(chunk) == 0:
            first = loaded[0][0]
            return np.zeros((0, *first.shape[1:]), first.dtype), np.zeros(0, np.int64)
        obs = np.stack([loaded[n][0][t] for n, t in chunk])
        act = np.array([loaded[n][1][t] for n, t in chunk], dtype=np.int64)
        return obs, act


def split_episodes(
    demos: list[DemoFile], val_fraction: float, seed: int
) -> tuple[list[EpisodeRef], list[EpisodeRef]]:
    """Train/validation split by whole episodes: the file's stored split where it has one,
    else a seeded random choice of about `val_fraction` of each file's episodes."""
    train: list[EpisodeRef] = []
    valid: list[EpisodeRef] = []
    rng = np.random.default_rng(seed)
    for f, demo in enumerate(demos):
        refs = [EpisodeRef(f, i, e.length) for i, e in enumerate(demo.episodes)]
        if demo.split is not None:
            names = {e.name: r for e, r in zip(demo.episodes, refs, strict=True)}
            train += [names[n] for n in demo.split["train"]]
            valid += [names[n] for n in demo.split["valid"]]
            continue
        n_val = round(val_fraction * len(refs)) if len(refs) >= 2 else 0
        if val_fraction > 0 and len(refs) >= 2:
            n_val = min(max(n_val, 1), len(refs) - 1)
        chosen = set(rng.choice(len(refs), size=n_val, replace=False).tolist()) if n_val else set()
        for i, ref in enumerate(refs):
            (valid if i in chosen else train).append(ref)
    return train, valid
