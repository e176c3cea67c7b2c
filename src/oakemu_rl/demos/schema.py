"""The HDF5 demonstration format (documented in docs/demo-format.md).

```
/                       attrs: format, schema_version, env_spec (JSON), action_meanings (JSON),
                               action_mask (JSON), frame_shape, package_version,
                               ale_py_version, created_at
/data                   attrs: total (steps in all episodes), episodes
/data/demo_<i>          attrs: recorder, seed, return, length, num_samples, created_at
    frames        uint8  (T, H, W)   newest frame of the observation actions[t] was taken on
    actions       int64  (T,)
    rewards       float32 (T,)       raw game reward after actions[t]
    terminations  bool   (T,)        the game ended after actions[t]
    truncations   bool   (T,)        the episode was cut after actions[t] (time limit, stop)
/mask/train, /mask/valid (optional)  bytes arrays of episode names, a stored split
```

The policy's observation at step t is frames[t-k+1 .. t] stacked, with zero frames before
the episode's first frame (k = env_spec.frame_stack).
"""

from __future__ import annotations

import numpy as np

FORMAT = "oakemu-rl-demos"
SCHEMA_VERSION = 1
RECORDERS = ("human", "scripted", "policy", "relabelled")

EPISODE_PREFIX = "demo_"

# name -> (dtype, dimensions after the time axis: None means the frame shape)
EPISODE_DATASETS: dict[str, tuple[np.dtype, bool]] = {
    "frames": (np.dtype(np.uint8), True),
    "actions": (np.dtype(np.int64), False),
    "rewards": (np.dtype(np.float32), False),
    "terminations": (np.dtype(np.bool_), False),
    "truncations": (np.dtype(np.bool_), False),
}

FILE_ATTRS = (
    "format",
    "schema_version",
    "env_spec",
    "action_meanings",
    "action_mask",
    "frame_shape",
    "package_version",
    "ale_py_version",
    "created_at",
)
EPISODE_ATTRS = ("recorder", "seed", "return", "length")

FRAME_CHUNK = 64
"""Frames per HDF5 chunk: about 450 KB raw, a few KB compressed."""
COMPRESSION = "gzip"
COMPRESSION_LEVEL = 4
"""gzip level 4: about 70 bytes per 84x84 frame at 60k frames/s (benchmarks/demo_storage.py)."""


def episode_name(index: int) -> str:
    return f"{EPISODE_PREFIX}{index}"


def episode_index(name: str) -> int | None:
    if not name.startswith(EPISODE_PREFIX):
        return None
    digits = name[len(EPISODE_PREFIX):]
    return int(digits) if digits.isdigit() else None


def stack_frames(frames: np.ndarray, t: int, k: int) -> np.ndarray:
    """The (k, H, W) observation at step t of an episode: frames t-k+1..t, zeros before 0."""
    out = np.zeros((k, *frames.shape[1:]), dtype=frames.dtype)
    start = t - k + 1
    lo = max(start, 0)
    out[lo - start:] = frames[lo:t + 1]
    return out
