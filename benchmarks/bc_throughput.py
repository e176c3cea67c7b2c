"""BC throughput and memory: the data path's overhead over the model, and peak RSS.

    .venv/bin/python benchmarks/bc_throughput.py [--frames 4000] [--batches 30]

1. Writes a synthetic demo file (real HDF5, real gzip chunks) of `--frames` frames and
   measures, side by side in one process, alternating rounds: model-only training steps
   (a fused Adam, as BC steps; and the per-tensor Adam that is torch's CPU default)
   on a batch already in memory, the same steps fed by the streaming and the cached
   data path (`DemoDataset`), all channels-last as BC trains on CPU in fp32, and
   model-only steps in the default NCHW layout and under bf16 autocast (`--precision
   bf16`; fast only where the CPU has AVX512-BF16 or AMX). Prints medians of samples/s
   and the ratios.
2. Runs `oakemu bootstrap bc` for one epoch in a child process on a small file and on a
   10x larger one, streaming with a fixed cache size, and prints each child's peak RSS:
   memory must not grow with the file.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from oakemu_rl import PPOModel
from oakemu_rl.demos import DemoFile, DemoWriter, EpisodeBuffer
from oakemu_rl.demos.dataset import DemoDataset, EpisodeRef
from oakemu_rl.envs import EnvSpec
from oakemu_rl.model import mixed_logits
from oakemu_rl.rl.losses import bc_loss


def synthetic_file(path: Path, frames: int, episode_length: int = 1000, seed: int = 0) -> Path:
    """Frames with moving blocks (compressible like a game screen), random actions."""
    spec = EnvSpec(game="pong")
    writer = DemoWriter(path, spec)
    rng = np.random.default_rng(seed)
    written = 0
    episode = 0
    while written < frames:
        n = min(episode_length, frames - written)
        buffer = EpisodeBuffer()
        for t in range(n):
            frame = np.full((84, 84), 87, np.uint8)
            y = (t * 3 + episode * 7) % 76
            frame[y:y + 8, 10:14] = 200
            frame[(y * 5) % 80:(y * 5) % 80 + 2, 40:42] = 236
            buffer.add(frame, int(rng.integers(6)), 0.0, t == n - 1, False)
        writer.write_episode(buffer, recorder="scripted", seed=episode)
        written += n
        episode += 1
    return path


def train_steps(model, optimizer, batches, mask, bf16: bool = False) -> float:
    """Samples/s of forward+backward+step over `batches` (an iterator of (obs, actions)),
    with the forward pass under bf16 autocast when asked (as `--precision bf16` trains)."""
    n = 0
    start = time.perf_counter()
    for obs, actions in batches:
        logits = mixed_logits(model, obs, torch.bfloat16 if bf16 else None)
        loss = bc_loss(logits, actions, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        n += len(actions)
    return n / (time.perf_counter() - start)


def throughput(path: Path, batches: int, batch_size: int, rounds: int) -> None:
    demo = DemoFile(path)
    refs = [EpisodeRef(0, i, e.length) for i, e in enumerate(demo.episodes)]
    mask = torch.ones(6, dtype=torch.bool)
    # BC trains channels-last on CPU (bootstrap/bc.py); the NCHW model shows what that buys.
    # It steps a fused Adam too; the per-tensor one, torch's default on the CPU, shows what
    # that buys.
    model = PPOModel((4, 84, 84), 6).to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    per_tensor = torch.optim.Adam(model.parameters(), lr=1e-4)
    nchw = PPOModel((4, 84, 84), 6)
    nchw_optimizer = torch.optim.Adam(nchw.parameters(), lr=1e-4, fused=True)
    fixed = (torch.randint(0, 256, (batch_size, 4, 84, 84), dtype=torch.uint8),
             torch.randint(0, 6, (batch_size,)))
    common = dict(batch_size=batch_size, action_mask=np.ones(6, bool))
    results: dict[str, list[float]] = {"model only": [], "streaming": [], "cached": [],
                                       "model NCHW": [], "model bf16": [],
                                       "per-tensor Adam": []}
    for r in range(rounds):
        results["model only"].append(train_steps(model, optimizer, [fixed] * batches, mask))
        results["per-tensor Adam"].append(train_steps(model, per_tensor, [fixed] * batches,
                                                      mask))
        results["model NCHW"].append(train_steps(nchw, nchw_optimizer, [fixed] * batches, mask))
        results["model bf16"].append(train_steps(model, optimizer, [fixed] * batches, mask,
                                                 bf16=True))
        for name, cache in (("streaming", 0), ("cached", 1 << 34)):
            data = DemoDataset([demo], refs, cache_bytes=cache, seed=r, **common)
            data.set_epoch(r)
            it = iter(data)
            feed = (next(it) for _ in range(min(batches, len(data))))
            results[name].append(train_steps(model, optimizer, feed, mask))
    base = statistics.median(results["model only"])
    print(f"BC training, batch {batch_size}, {batches} batches x {rounds} rounds "
          f"(medians, torch threads {torch.get_num_threads()})")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"  {name:<15} {med:8.1f} samples/s   ({med / base:.2f}x model-only)")


def peak_rss(path: Path, cache_mb: int) -> float:
    code = (
        "import resource, sys\n"
        "from oakemu_rl.bootstrap.bc import BCConfig, train_bc\n"
        f"train_bc(BCConfig(epochs=1, cache_mb={cache_mb}, val_fraction=0.1), "
        f"({str(path)!r},), run_dir={str(path.parent / 'run')!r}, progress=False)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.split()
    return int(out[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=4000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rss-frames", type=int, default=3000,
                        help="frames of the small file for the RSS test (the large is 10x)")
    parser.add_argument("--cache-mb", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        throughput(synthetic_file(folder / "demos.h5", args.frames), args.batches,
                   args.batch_size, args.rounds)
        small = synthetic_file(folder / "small" / "demos.h5", args.rss_frames)
        large = synthetic_file(folder / "large" / "demos.h5", 10 * args.rss_frames)
        raw = [f.stat().st_size for f in (small, large)]
        print(f"peak RSS of a 1-epoch BC run, streaming (cache {args.cache_mb} MB):")
        for label, path, size in (("small", small, raw[0]), ("10x", large, raw[1])):
            frames = DemoFile(path).num_steps
            rss = peak_rss(path, args.cache_mb)
            print(f"  {label:<5} {frames:7d} frames ({frames * 7056 / 2**20:6.0f} MB raw, "
                  f"{size / 2**20:5.1f} MB on disk): peak RSS {rss:6.0f} MB")


if __name__ == "__main__":
    main()
