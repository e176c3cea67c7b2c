"""BC samples/s and PPO agent steps/s on 1 and N processes (torchrun), and the scaling
efficiency against one process.

    .venv/bin/python benchmarks/scaling.py [--procs 1 2] [--rounds 3] [--device cpu]

Each round runs, for every process count, one BC run (the Nature-CNN trunk on a recorded
Pong demo file, the same global batch) and one PPO run (8 envs per process, so N processes
step N × 8 envs), alternating the process counts so machine load hits them alike. Figures
are the medians over rounds of each run's own rate (BC: the samples/s of its last epoch;
PPO: the SPS of its last update, over every rank). Efficiency is rate(N) / (N × rate(1)).
On the 2-core machine every process gets one torch thread; on a GPU machine, each process
its own GPU (`--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def launch(procs: int, command: list[str]) -> None:
    prefix = [sys.executable, "-m", "oakemu_rl"] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}", "-m", "oakemu_rl"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([*prefix, *command], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:2])} on {procs} process(es) failed:\n{done.stderr[-2000:]}")


def last(path: Path, key: str) -> float:
    records = [json.loads(line) for line in path.open()]
    return [r[key] for r in records if key in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bc-epochs", type=int, default=2)
    parser.add_argument("--ppo-steps", type=int, default=8192,
                        help="agent steps per process for each PPO run")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="oakemu-scaling-"))
    demos = work / "demos.h5"
    launch(1, ["record", "--demonstrator", "scripted", "--style", "follow", "--episodes", "2",
               "--max-steps", "2000", "--out", str(demos)])
    launch(1, ["bootstrap", "bc", str(demos), "--epochs", "1", "--run-dir", str(work / "start"),
               "--device", args.device, "--no-progress"])
    start = work / "start" / "bc.pt"
    rates: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for procs in (args.procs if round_ % 2 == 0 else list(reversed(args.procs))):
            bc_dir, ppo_dir = work / f"bc-{procs}-{round_}", work / f"ppo-{procs}-{round_}"
            launch(procs, ["bootstrap", "bc", str(demos), "--epochs", str(args.bc_epochs),
                           "--batch-size", "128", "--patience", "0", "--run-dir", str(bc_dir),
                           "--device", args.device, "--no-progress"])
            rates.setdefault(("bc", procs), []).append(
                last(bc_dir / "bc_metrics.jsonl", "bc/samples_per_second"))
            launch(procs, ["finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                           str(ppo_dir), "--total-steps", str(args.ppo_steps * procs),
                           "--num-envs", "8", "--eval-episodes", "0", "--device", args.device,
                           "--no-progress"])
            rates.setdefault(("ppo", procs), []).append(
                last(ppo_dir / "ppo_metrics.jsonl", "charts/SPS"))
            print(f"round {round_ + 1}: {procs} process(es) bc "
                  f"{rates['bc', procs][-1]:,.0f} samples/s, ppo {rates['ppo', procs][-1]:,.0f} "
                  "SPS", flush=True)
    print(f"\nmedians over {args.rounds} rounds ({args.device}, {os.cpu_count()} CPUs)")
    print("stage  processes  rate         efficiency")
    for stage, unit in (("bc", "samples/s"), ("ppo", "SPS")):
        one = statistics.median(rates[stage, args.procs[0]]) * (1 / args.procs[0])
        for procs in args.procs:
            rate = statistics.median(rates[stage, procs])
            print(f"{stage:<6} {procs:>9}  {rate:>8,.0f} {unit:<9} "
                  f"{rate / (procs * one):>6.0%}")


if __name__ == "__main__":
    main()
