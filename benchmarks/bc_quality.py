"""BC quality on a real game: does the cloned policy play like its demonstrator?

    .venv/bin/python benchmarks/bc_quality.py --game pong --frames 30000 --epochs 15

Records about `--frames` frames of scripted demonstrations in `--style` (with a little
action noise), trains `oakemu bootstrap bc` on them, calibrates the critic, and scores greedily over
`--episodes` episodes: the demonstrator, the BC policy, the calibrated policy (must equal
BC) and a uniform random policy. Prints the scores, BC on the random-to-demonstrator scale
((bc - random) / (demonstrator - random)), calibration explained variance and wall times.
Everything lands in `--run-dir` (default data/runs/bench-bc-GAME), so the stages can be
inspected (bc_curves.png, calibration_scatter.png).

`--relabel-episodes N` adds DAgger rounds (`--relabel-rounds`, default 1): the newest
clone plays N episodes while the script labels every frame (`oakemu record --relabel`),
and a fresh BC model trains on the demos and every relabelled file so far (round k in
RUN_DIR/relabel, relabel2, ...); each round's clone is scored beside the first.

Every policy plays `--episodes` games on each of `--test-seeds` (game i of a set is
seeded with its seed + i), `--jobs` evaluations at a time. `--reuse` keeps the
checkpoints and relabelled files already in the run dir (BC is deterministic on CPU for a
given seed, so a rerun with the same options would train the same models); the wall
times leave out what was kept.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from policy_scores import scale_lines, score_all

from oakemu_rl.agents.recording import RecordConfig, record, relabelling_agents
from oakemu_rl.agents.scripted import make_demonstrator
from oakemu_rl.bootstrap.bc import BCConfig, train_bc
from oakemu_rl.bootstrap.calibrate import CalibrateConfig, calibrate
from oakemu_rl.checkpoint import load_checkpoint
from oakemu_rl.demos import DemoFile
from oakemu_rl.envs import EnvSpec
from oakemu_rl.tester import EvalResult, format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="pong")
    parser.add_argument("--frames", type=int, default=30_000)
    parser.add_argument("--noise", type=float, default=0.03)
    parser.add_argument("--style", default="follow", help="scripted style: follow or planner")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--architecture", default="nature")
    parser.add_argument("--augment-shift", type=int, default=0)
    parser.add_argument("--head-gain", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0, help="BC seed")
    parser.add_argument("--episodes", type=int, default=5, help="games per test set")
    parser.add_argument("--test-seeds", type=int, nargs="+", default=[1000],
                        help="first seed of each test set")
    parser.add_argument("--jobs", type=int, default=2, help="evaluations at a time")
    parser.add_argument("--reuse", action="store_true",
                        help="keep checkpoints already in the run dir instead of retraining")
    parser.add_argument("--calibrate-iterations", type=int, default=8)
    parser.add_argument("--relabel-episodes", type=int, default=0,
                        help="also score BC after relabelling rounds of this many episodes")
    parser.add_argument("--relabel-rounds", type=int, default=1)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    spec = EnvSpec(game=args.game)
    run_dir = Path(args.run_dir or f"data/runs/bench-bc-{spec.game}-{args.style}")
    run_dir.mkdir(parents=True, exist_ok=True)
    demos = run_dir / "demos.h5"
    walls = {}

    start = time.perf_counter()
    have = DemoFile(demos).num_steps if demos.exists() else 0
    seed = 0
    while have < args.frames:
        agent = make_demonstrator(spec, seed=seed, noise=args.noise, style=args.style)
        result = record(RecordConfig(out=demos, spec=spec, episodes=1, seed=seed), agent)
        have += result.episodes[0]["length"]
        seed += 1
    if seed:  # frames were recorded this run
        walls["record"] = time.perf_counter() - start
    with DemoFile(demos) as demo:
        print(f"demos: {len(demo.episodes)} episodes, {demo.num_steps} frames, mean return "
              f"{np.mean([e.episode_return for e in demo.episodes]):+.1f}")

    def kept(path: Path) -> bool:
        """With --reuse, an output already in the run dir is kept (and not timed)."""
        return args.reuse and path.exists()

    def bc(path: Path, files: list[Path], wall: str) -> Path:
        if kept(path / "bc.pt"):
            return path / "bc.pt"
        start = time.perf_counter()
        made = train_bc(BCConfig(
            epochs=args.epochs, architecture=args.architecture, seed=args.seed,
            augment_shift=args.augment_shift, lr=args.lr, head_gain=args.head_gain),
            tuple(map(str, files)), run_dir=path)
        walls[wall] = time.perf_counter() - start
        return made

    bc_path = bc(run_dir, [demos], "bc")
    cal_path = run_dir / "calibrated.pt"
    if not kept(cal_path):
        start = time.perf_counter()
        cal_path = calibrate(CalibrateConfig(iterations=args.calibrate_iterations),
                             run_dir=run_dir)
        walls["calibrate"] = time.perf_counter() - start
    agents = {"bc": bc_path, "calibrated": cal_path}
    files, clone = [demos], bc_path
    for round_ in range(1, args.relabel_rounds + 1 if args.relabel_episodes else 1):
        suffix = "" if round_ == 1 else str(round_)
        relabelled = run_dir / f"relabelled{suffix}.h5"
        if not kept(relabelled):
            start = time.perf_counter()
            relabelled.unlink(missing_ok=True)
            labeller, driver, driver_spec = relabelling_agents(clone, style=args.style)
            record(RecordConfig(out=relabelled, spec=driver_spec,
                                episodes=args.relabel_episodes,
                                seed=5000 + (round_ - 1) * args.relabel_episodes),
                   labeller, driver)
            walls[f"relabel{suffix} record"] = time.perf_counter() - start
        files.append(relabelled)
        clone = agents[f"bc+relabel{suffix}"] = bc(run_dir / f"relabel{suffix}", files,
                                                   f"relabel{suffix} bc")

    start = time.perf_counter()
    players = {"demonstrator": None, "random": None, **agents}
    jobs = [(name, str(path) if path else None, seed)
            for seed in args.test_seeds for name, path in players.items()]
    # With --reuse, a player whose checkpoint is unchanged keeps its scores from last time.
    cache_path = run_dir / "scores.json"
    cache = json.loads(cache_path.read_text()) if args.reuse and cache_path.exists() else {}

    def key(job: tuple[str, str | None, int]) -> str:
        name, path, seed = job
        made = Path(path).stat().st_mtime_ns if path else 0
        return f"{name}|{path}|{made}|{seed}|{args.episodes}|{args.style}"

    todo = [job for job in jobs if key(job) not in cache]
    settings = {"spec": spec.to_dict(), "style": args.style, "episodes": args.episodes}
    for job, result in zip(todo, score_all(todo, settings, args.jobs), strict=True):
        cache[key(job)] = result
    cache_path.write_text(json.dumps(cache, indent=2))
    scores = [EvalResult(scores=cache[key(job)]["scores"],
                         lengths=cache[key(job)]["lengths"]) for job in jobs]
    walls[f"test ({len(todo)} of {len(jobs)} evaluations run)"] = time.perf_counter() - start

    for seed in args.test_seeds:
        results = {name: result for (name, _, s), result in zip(jobs, scores, strict=True)
                   if s == seed}
        print(f"\n{args.episodes} games from seed {seed}:")
        print(format_table(results))
    print("\n(target for BC: >= 80%)")
    print("\n".join(scale_lines({(name, s): cache[key((name, path, s))]
                                 for name, path, s in jobs},
                                [name for name in agents if name != "calibrated"],
                                args.test_seeds)))
    metrics = load_checkpoint(bc_path).extra["metrics"]
    calibration = load_checkpoint(cal_path).extra["calibration"]
    print(f"BC best epoch: val loss {metrics.get('bc/val_loss', float('nan')):.3f}, "
          f"val accuracy {metrics.get('bc/val_accuracy', float('nan')):.3f}")
    print(f"calibration explained variance {calibration['initial_explained_variance']:.3f} -> "
          f"{calibration['explained_variance']:.3f} in {calibration['wall_seconds']:.0f}s")
    print("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in walls.items()))


if __name__ == "__main__":
    main()
