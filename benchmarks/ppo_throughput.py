"""PPO throughput: `finetune_ppo` steps/s per trunk precision and torch thread count.

    .venv/bin/python benchmarks/ppo_throughput.py [--steps 16384] [--rounds 3]
        [--threads 1 2] [--precision fp32 bf16] [--mode warm] [--start calibrated.pt]
        [--label-rollouts human]

Each run trains the Atari recipe (8 envs x 128 steps, 4 epochs of 4 minibatches of 256, no
evaluation games) on Pong for `--steps` agent steps in a fresh process, from `--start` (a
calibrated checkpoint, such as a run's `calibrated.pt`) or else from a fresh Nature-DQN
model. `--mode warm` keeps the warm-start guards on (the KL anchor's reference pass) with
the trunk and policy learning from the first update, so every update costs what a
fine-tuning update costs; `scratch` is plain PPO. Each round runs every (precision,
threads) pair once, the order alternating between rounds. It prints the median steps/s
over rounds, each precision's ratio to the first one named at the same thread count, and
the median time split (env / inference / learning, from ppo.pt's extra["timings"]).

bf16 runs the conv trunk under autocast (`PPOConfig.precision`); it pays on a CPU with
bf16 matrix instructions and on GPUs that support bf16.

`--label-rollouts STYLE` adds, beside every (precision, threads) run, one whose rollouts
the scripted player in STYLE labels (`PPOConfig.label_rollouts`, with the BC loss at
weight 1 on those labels and on demo batches of the start's lineage, so `--start` must be
a checkpoint of a bc lineage): its envs step as single emulators in worker processes, the
script beside each, instead of the C++ vector env. The ratio is the labelled run's steps/s
to the plain one's at the same precision and thread count; it includes the BC loss on
demo batches, which labelled rollouts need.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NUM_ENVS, NUM_STEPS = 8, 128


def worker(steps: int, threads: int, seed: int, mode: str, precision: str,
           start: str | None, labels: str | None = None) -> dict:
    """One run in this process; returns its steps/s, wall time and time split."""
    import torch

    from oakemu_rl import PPOModel
    from oakemu_rl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
    from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
    from oakemu_rl.finetune.ppo import PPOConfig, finetune_ppo
    from oakemu_rl.metrics import read_metrics

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        os.environ["OAKEMU_RUNS"] = str(folder / "runs")
        if start is None:
            spec = EnvSpec(game="pong")
            meanings = list(action_meanings("pong"))
            start = save_checkpoint(folder / "calibrated.pt", Checkpoint.from_model(
                PPOModel(spec.observation_shape, len(meanings)), stage="calibrate",
                action_meanings=meanings, action_mask=action_mask(spec).tolist(),
                env_spec=spec.to_dict(), steps={}))
        config = PPOConfig(from_scratch=mode == "scratch", total_steps=steps,
                           num_envs=NUM_ENVS, num_steps=NUM_STEPS, warmup_updates=0,
                           warmup_ramp_updates=0, eval_episodes=0, checkpoint_every=10**9,
                           seed=seed, threads=threads, precision=precision,
                           bc_coef=1.0 if labels else 0.0, bc_decay=1.0,
                           label_rollouts=labels)
        wall = time.perf_counter()
        path = finetune_ppo(config, run_dir=folder / "run", checkpoint=start, device="cpu",
                            progress=False)
        wall = time.perf_counter() - wall
        records = [r for r in read_metrics(path.parent / "ppo_metrics.jsonl")
                   if "charts/SPS" in r]
        timings = load_checkpoint(path).extra["timings"]
    return {"sps": records[-1]["charts/SPS"], "wall": wall, "split": timings}


def run_worker(args: argparse.Namespace, precision: str, threads: int, labels: str | None,
               seed: int) -> dict:
    command = [sys.executable, __file__, "--worker", "--steps", str(args.steps),
               "--threads", str(threads), "--precision", precision, "--seed", str(seed),
               "--mode", args.mode]
    if args.start:
        command += ["--start", str(args.start)]
    if labels:
        command += ["--label-rollouts", labels]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"the {name(precision, labels)} run on {threads} thread(s) failed:\n"
                 f"{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def name(precision: str, labels: str | None) -> str:
    return f"{precision}+{labels} labels" if labels else precision


def split_text(split: dict) -> str:
    total = sum(split.values())
    return ", ".join(f"{k} {v:5.1f}s ({100 * v / total:3.0f}%)" for k, v in split.items()
                     if v or k != "evaluation")  # these runs play no evaluation games


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16384, help="agent steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="torch thread counts to try")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"], help="trunk precisions to try")
    parser.add_argument("--mode", default="warm", choices=["scratch", "warm"],
                        help="warm: the warm-start guards on; scratch: plain PPO")
    parser.add_argument("--start", type=Path,
                        help="calibrated checkpoint to start from (default: a fresh model)")
    parser.add_argument("--label-rollouts", metavar="STYLE",
                        help="also run each pair with rollouts labelled by this scripted "
                             "style (needs --start)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.start is not None and not args.start.is_file():
        sys.exit(f"--start {args.start} is not a file")
    if args.label_rollouts and args.start is None and not args.worker:
        sys.exit("--label-rollouts needs --start: its BC loss reads the start's demos")
    if args.label_rollouts and args.mode == "scratch":
        sys.exit("--label-rollouts needs --mode warm: PPO from scratch has no BC loss")

    if args.worker:
        print(json.dumps(worker(args.steps, args.threads[0], args.seed, args.mode,
                                args.precision[0], args.start and str(args.start),
                                args.label_rollouts)))
        return

    variants = [None] + ([args.label_rollouts] if args.label_rollouts else [])
    kinds = [(p, v) for p in args.precision for v in variants]
    jobs = [(p, t, v) for t in args.threads for p, v in kinds]
    results: dict[tuple[str, int, str | None], list[dict]] = {job: [] for job in jobs}
    load = [os.getloadavg()[0]]
    print(f"PPO throughput, Pong, {NUM_ENVS} envs x {NUM_STEPS} steps, {args.steps} agent "
          f"steps per run, {args.rounds} rounds, {args.mode}, start "
          f"{args.start or 'a fresh model'}, {os.cpu_count()} CPUs")
    for r in range(args.rounds):
        for precision, threads, labels in jobs if r % 2 == 0 else jobs[::-1]:
            result = run_worker(args, precision, threads, labels, args.seed + r)
            results[precision, threads, labels].append(result)
            load.append(os.getloadavg()[0])
            print(f"  round {r + 1}: {name(precision, labels)} threads {threads}: "
                  f"{result['sps']:7.1f} SPS (load {load[-1]:.2f})", flush=True)

    first = args.precision[0]
    print(f"\nmedians over {args.rounds} rounds (1-min load average: median "
          f"{statistics.median(load):.2f}, range {min(load):.2f}-{max(load):.2f})")

    def sps(precision: str, threads: int, labels: str | None) -> float:
        return statistics.median(r["sps"] for r in results[precision, threads, labels])

    print(f"{'threads':>7} " + " ".join(f"{p + ' SPS':>10}" for p in args.precision)
          + "".join(f"   {p}/{first}" for p in args.precision[1:]))
    for t in args.threads:
        plain = {p: sps(p, t, None) for p in args.precision}
        print(f"{t:>7} " + " ".join(f"{plain[p]:10.1f}" for p in args.precision)
              + "".join(f"   {plain[p] / plain[first]:8.2f}x" for p in args.precision[1:]))
    if args.label_rollouts:
        print(f"\n{'threads':>7} {'precision':>9} {'plain SPS':>10} {'labelled SPS':>13} "
              f"{'labelled/plain':>15}")
        for t in args.threads:
            for p in args.precision:
                plain, labelled = sps(p, t, None), sps(p, t, args.label_rollouts)
                print(f"{t:>7} {p:>9} {plain:10.1f} {labelled:13.1f} "
                      f"{labelled / plain:14.2f}x")
    print("\ntime split (medians of each part, seconds per run):")
    for t in args.threads:
        for p, v in kinds:
            runs = results[p, t, v]
            split = {k: statistics.median(r["split"][k] for r in runs) for k in runs[0]["split"]}
            print(f"  threads {t}, {name(p, v)}: {split_text(split)}")


if __name__ == "__main__":
    main()
