"""The Game Boy learning check: the pipeline's agent on CATCH against random play and the
scripted demonstrator.

    .venv/bin/python benchmarks/gameboy_learning.py                  # runs pipelines/catch.toml
    .venv/bin/python benchmarks/gameboy_learning.py --skip-run --run-dir data/runs/catch

Runs the pipeline (record → bc → calibrate → ppo) into `--run-dir`, then plays
`--episodes` greedy whole games from `--test-seed` (seeds the pipeline's recording,
training and test stage do not use) with every stage's checkpoint, the scripted
demonstrator and a uniform random policy, `--jobs` evaluations at a time. Prints each
player's mean ± standard error over its games, and the verdicts the benchmark exists
for: the agent beats random clearly, and reaches the demonstrator's score.

Every player plays the same seeds, so the agent and the demonstrator are also compared
game by game: the mean of their per-game differences and its standard error. Near the
game's ceiling most games end level, and the paired figure separates the two where the
difference of two independent means cannot. With `--misses` it then replays the agent's
and the demonstrator's games and counts where their misses fell: on the ball already
falling when control starts (after the no-op start), or on a later one.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_scores import score_all

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("bc.pt", "calibrated.pt", "ppo.pt")


def mean_se(scores: list[float]) -> tuple[float, float]:
    values = np.asarray(scores, dtype=np.float64)
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
    return float(values.mean()), se


def count_misses(checkpoint: Path, seeds: range, trace: int = 0
                 ) -> dict[str, tuple[int, int, int, list]]:
    """(games with a miss, misses of the ball in flight at the start, later misses, and for
    each later miss its seed, step and last `trace` steps as (step, action, basket x, ball
    x, ball y)) for the agent at `checkpoint` and the scripted demonstrator, on `seeds`."""
    from oakemu_rl.agents import load_policy_agent
    from oakemu_rl.agents.scripted import make_demonstrator
    from oakemu_rl.envs.backends import make_env
    from oakemu_rl.envs.gbgame import RAM

    agent, spec = load_policy_agent(checkpoint, device="cpu")
    spec = spec.for_evaluation()
    env = make_env(spec)
    memory = env.unwrapped.memory
    counts = {}
    for name in ("agent", "demonstrator"):
        games = first = later = 0
        lost = []
        for seed in seeds:
            player = agent if name == "agent" else make_demonstrator(spec, seed=seed)
            observation, _ = env.reset(seed=seed)
            player.reset(env, seed)
            misses, height = memory(RAM["misses"]), memory(RAM["object_y"])
            respawned = missed = False
            recent = deque(maxlen=trace)
            step = 0
            while True:
                action = player.act(env, observation)
                observation, _, terminated, truncated, _ = env.step(action)
                step += 1
                recent.append((step, int(action), memory(RAM["player_x"]),
                               memory(RAM["object_x"]), memory(RAM["object_y"])))
                if memory(RAM["misses"]) != misses:  # (a lost ball respawns in the same step)
                    misses, missed = memory(RAM["misses"]), True
                    if respawned:
                        later += 1
                        lost.append((seed, step, list(recent)))
                    else:
                        first += 1
                respawned |= memory(RAM["object_y"]) < height
                height = memory(RAM["object_y"])
                if terminated or truncated:
                    break
            games += missed
        counts[name] = (games, first, later, lost)
    env.close()
    return counts


def run_pipeline(pipeline: Path, run_dir: Path) -> float:
    start = time.perf_counter()
    command = [sys.executable, "-m", "oakemu_rl", "pipeline", "run", str(pipeline),
               "--run-dir", str(run_dir), "--no-progress"]
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=Path, default=ROOT / "pipelines" / "catch.toml")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "data" / "runs" / "catch-bench")
    parser.add_argument("--skip-run", action="store_true", help="score an existing run")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--test-seed", type=int, default=500_000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--misses", action="store_true",
                        help="also count where the agent's and the demonstrator's misses fell")
    parser.add_argument("--trace", type=int, default=0, metavar="STEPS",
                        help="with --misses: print the last STEPS steps before each miss of "
                             "a ball in play (action, basket x, ball x, ball y)")
    args = parser.parse_args()
    if not args.skip_run:
        minutes = run_pipeline(args.pipeline, args.run_dir) / 60
        print(f"pipeline {args.pipeline.name}: {minutes:.1f} min")
    from oakemu_rl.checkpoint import load_checkpoint

    paths = [args.run_dir / name for name in STAGES if (args.run_dir / name).is_file()]
    if not paths:
        parser.error(f"no checkpoints in {args.run_dir}")
    spec = load_checkpoint(paths[0]).env_spec
    players = [(p.stem, str(p)) for p in paths] + [("demonstrator", None), ("random", None)]
    jobs = [(name, path, args.test_seed) for name, path in players]
    settings = {"spec": spec, "style": "planner", "episodes": args.episodes}
    results = dict(zip([name for name, _ in players], score_all(jobs, settings, args.jobs),
                       strict=True))
    print(f"\n{args.episodes} greedy games each from seed {args.test_seed} ({spec['env_id']}):")
    print(f"{'player':<14}{'games':>6}{'mean':>9}{'± SE':>8}{'min':>7}{'max':>7}")
    stats = {}
    for name, result in results.items():
        mean, se = mean_se(result["scores"])
        stats[name] = (mean, se)
        print(f"{name:<14}{len(result['scores']):>6}{mean:>+9.2f}{se:>8.2f}"
              f"{min(result['scores']):>+7.0f}{max(result['scores']):>+7.0f}")
    agent = "ppo" if "ppo" in stats else paths[-1].stem
    (a, a_se), (r, r_se), (d, d_se) = stats[agent], stats["random"], stats["demonstrator"]
    gap = (a - r) / math.sqrt(a_se**2 + r_se**2) if a_se + r_se > 0 else math.inf
    print(f"\n{agent} - random: {a - r:+.2f} ({gap:.1f} standard errors)")
    differences = [x - y for x, y in zip(results[agent]["scores"],
                                         results["demonstrator"]["scores"], strict=True)]
    paired_mean, paired_se = mean_se(differences)
    level = differences.count(0)
    print(f"{agent} - demonstrator: {a - d:+.2f} ± {math.hypot(a_se, d_se):.2f} (means); "
          f"game by game {paired_mean:+.2f} ± {paired_se:.2f}, level in {level} of "
          f"{args.episodes} games; reaches the demonstrator: {'yes' if a >= d else 'no'}")

    if args.misses:
        seeds = range(args.test_seed, args.test_seed + args.episodes)
        counts = count_misses(args.run_dir / f"{agent}.pt", seeds, args.trace)
        for name, (games, first, later, lost) in counts.items():
            print(f"{name}: a miss in {games} of {len(seeds)} games; {first} of the ball "
                  f"falling when control starts, {later} later"
                  + (" (seed, step: " + ", ".join(f"{seed}, {step}" for seed, step, _ in lost)
                     + ")" if lost else ""))
            for seed, step, steps in lost if args.trace else ():
                print(f"  seed {seed}, the {len(steps)} steps to the miss at step {step} "
                      "(step, action, basket x, ball x, ball y):")
                for row in steps:
                    print("   ", *row)


if __name__ == "__main__":
    main()
