"""Greedy scores of checkpoints beside the scripted demonstrator and a random policy.

    .venv/bin/python benchmarks/policy_scores.py data/runs/pong/bc.pt \\
        --episodes 20 --test-seeds 1000 2000

Each checkpoint, the scripted demonstrator of the first checkpoint's game (`--style`) and
a uniform random policy play `--episodes` greedy whole games on each test set (game i of
a set is seeded with its seed + i) with the first checkpoint's env spec and raw rewards,
`--jobs` evaluations at a time, one torch thread each. Prints a table per test set and
each checkpoint on the random-to-demonstrator scale, (policy - random) / (demonstrator -
random), per set and pooled over every set's games; `--out FILE` keeps the scores as JSON.
`benchmarks/bc_quality.py` scores its clones with the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

REFERENCES = ("demonstrator", "random")


def score(job: tuple[str, str | None, int], settings: dict) -> dict:
    """One player on one test set, in a worker process: `job` is (name, checkpoint path or
    None for the references, first seed); `settings` holds the references' env spec (a
    dict), the demonstrator's style and the games per set."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from oakemu_rl.agents import RandomAgent, load_policy_agent
    from oakemu_rl.agents.scripted import make_demonstrator
    from oakemu_rl.envs import EnvSpec, action_mask
    from oakemu_rl.tester import EvalConfig, evaluate

    torch.set_num_threads(1)
    name, path, seed = job
    config = EvalConfig(episodes=settings["episodes"], seed=seed)
    if path is not None:
        agent, spec = load_policy_agent(path, device="cpu")
        return evaluate(agent, spec, config, progress=False).to_dict()
    spec = EnvSpec.from_dict(settings["spec"]).for_evaluation()
    if name == "demonstrator":
        agent = make_demonstrator(spec, seed=seed, style=settings["style"])
    else:
        agent = RandomAgent(action_mask(spec))
    return evaluate(agent, spec, config, progress=False).to_dict()


def score_all(jobs: list[tuple[str, str | None, int]], settings: dict, workers: int) -> list:
    """`score` over every job, `workers` processes at a time; results in the jobs' order."""
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(score, jobs, [settings] * len(jobs)))


def on_scale(policy: float, demonstrator: float, random: float) -> float:
    """Percent of the way from the random policy's score to the demonstrator's."""
    return 100 * (policy - random) / (demonstrator - random) if demonstrator != random else 0.0


def scale_lines(scores: dict[tuple[str, int], dict], names: list[str],
                seeds: list[int]) -> list[str]:
    """Each named player on the random-to-demonstrator scale, per test set and pooled (the
    mean over every set's games, each set's games counted alike)."""
    def percent(name: str, chosen: list[int]) -> float:
        means = [float(np.mean([s for seed in chosen for s in scores[player, seed]["scores"]]))
                 for player in (name, *REFERENCES)]
        return on_scale(*means)

    lines = []
    for name in names:
        parts = [f"seed {seed} {percent(name, [seed]):.0f}%" for seed in seeds]
        if len(seeds) > 1:
            pooled = percent(name, seeds)
            games = sum(len(scores[name, seed]["scores"]) for seed in seeds)
            parts.append(f"pooled ({games} games) {pooled:.0f}%")
        lines.append(f"{name} on the random-to-demonstrator scale: " + ", ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--episodes", type=int, default=20, help="games per test set")
    parser.add_argument("--test-seeds", type=int, nargs="+", default=[1000, 2000],
                        help="first seed of each test set")
    parser.add_argument("--style", default="follow", help="the demonstrator's scripted style")
    parser.add_argument("--jobs", type=int, default=2, help="evaluations at a time")
    parser.add_argument("--out", type=Path, help="write the scores here as JSON")
    args = parser.parse_args()
    for path in args.checkpoints:
        if not path.is_file():
            parser.error(f"{path} does not exist")
    from oakemu_rl.checkpoint import load_checkpoint
    from oakemu_rl.tester import EvalResult, format_table

    spec = load_checkpoint(args.checkpoints[0]).env_spec
    names = [str(p) for p in args.checkpoints]
    players = [(n, n) for n in names] + [(r, None) for r in REFERENCES]
    jobs = [(name, path, seed) for seed in args.test_seeds for name, path in players]
    settings = {"spec": spec, "style": args.style, "episodes": args.episodes}
    start = time.perf_counter()
    results = dict(zip([(n, s) for n, _, s in jobs], score_all(jobs, settings, args.jobs),
                       strict=True))
    for seed in args.test_seeds:
        print(f"\n{args.episodes} games from seed {seed}:")
        print(format_table({name: EvalResult(scores=results[name, seed]["scores"],
                                             lengths=results[name, seed]["lengths"])
                            for name, _ in players}))
    print()
    print("\n".join(scale_lines(results, names, args.test_seeds)))
    print(f"{len(jobs)} evaluations in {time.perf_counter() - start:.0f}s, {args.jobs} at a time")
    if args.out:
        args.out.write_text(json.dumps({f"{n}|{s}": r for (n, s), r in results.items()},
                                       indent=2))


if __name__ == "__main__":
    main()
