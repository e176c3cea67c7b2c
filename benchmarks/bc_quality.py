"""BC quality on a real game: does the cloned policy play like its demonstrator?

    .venv/bin/python benchmarks/bc_quality.py --game pong --frames 30000 --epochs 15

Records about `--frames` frames of scripted demonstrations in `--style` (with a little
action noise), trains `oakemu bootstrap bc` on them, calibrates the critic, and scores greedily over
`--episodes` episodes: the demonstrator, the BC policy, the calibrated policy (must equal
BC) and a uniform random policy. Prints the scores, BC on the random-to-demonstrator scale
((bc - random) / (demonstrator - random)), calibration explained variance and wall times.
Everything lands in `--run-dir` (default data/runs/bench-bc-GAME), so the stages can be
inspected (bc_curves.png, calibration_scatter.png).

`--relabel-episodes N` adds one DAgger round: the clone plays N episodes while the script
labels every frame (`oakemu record --relabel`), a fresh BC model trains on the demos and
those frames (in RUN_DIR/relabel), and it is scored beside the first clone.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from oakemu_rl.agents import RandomAgent
from oakemu_rl.bootstrap.bc import BCConfig, train_bc
from oakemu_rl.bootstrap.calibrate import CalibrateConfig, calibrate
from oakemu_rl.checkpoint import load_checkpoint
from oakemu_rl.demos import DemoFile
from oakemu_rl.demos.record import RecordConfig, record, relabelling_agents
from oakemu_rl.demos.scripted import make_demonstrator
from oakemu_rl.envs import EnvSpec, action_mask
from oakemu_rl.tester import EvalConfig, evaluate, format_table, load_policy_agent


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
    parser.add_argument("--episodes", type=int, default=5)
    parser.add_argument("--calibrate-iterations", type=int, default=8)
    parser.add_argument("--relabel-episodes", type=int, default=0,
                        help="also score BC after one relabelling round of this many episodes")
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
    walls["record"] = time.perf_counter() - start
    with DemoFile(demos) as demo:
        print(f"demos: {len(demo.episodes)} episodes, {demo.num_steps} frames, mean return "
              f"{np.mean([e.episode_return for e in demo.episodes]):+.1f}")

    start = time.perf_counter()
    bc_path = train_bc(BCConfig(demos=(str(demos),), run_dir=str(run_dir), epochs=args.epochs,
                                architecture=args.architecture, seed=args.seed,
                                augment_shift=args.augment_shift, lr=args.lr,
                                head_gain=args.head_gain))
    walls["bc"] = time.perf_counter() - start
    start = time.perf_counter()
    cal_path = calibrate(CalibrateConfig(run_dir=str(run_dir),
                                         iterations=args.calibrate_iterations))
    walls["calibrate"] = time.perf_counter() - start
    agents = {"bc": bc_path, "calibrated": cal_path}
    if args.relabel_episodes:
        start = time.perf_counter()
        relabelled = run_dir / "relabelled.h5"
        if not relabelled.exists():
            labeller, driver, driver_spec = relabelling_agents(bc_path, style=args.style)
            record(RecordConfig(out=relabelled, spec=driver_spec,
                                episodes=args.relabel_episodes, seed=5000), labeller, driver)
        walls["relabel record"] = time.perf_counter() - start
        start = time.perf_counter()
        agents["bc+relabel"] = train_bc(BCConfig(
            demos=(str(demos), str(relabelled)), run_dir=str(run_dir / "relabel"),
            epochs=args.epochs, architecture=args.architecture, seed=args.seed,
            augment_shift=args.augment_shift, lr=args.lr, head_gain=args.head_gain))
        walls["relabel bc"] = time.perf_counter() - start

    config = EvalConfig(episodes=args.episodes, seed=1000)
    results = {}
    start = time.perf_counter()
    results["demonstrator"] = evaluate(make_demonstrator(spec, seed=1000, style=args.style),
                                       spec, config)
    results["random"] = evaluate(RandomAgent(action_mask(spec)), spec, config)
    for name, path in agents.items():
        agent, agent_spec = load_policy_agent(path, device="cpu")
        results[name] = evaluate(agent, agent_spec, config)
    walls["test"] = time.perf_counter() - start

    print(format_table(results))
    demo, rand, bc = (results[k].mean for k in ("demonstrator", "random", "bc"))
    scale = (bc - rand) / (demo - rand) if demo != rand else float("nan")
    metrics = load_checkpoint(bc_path).extra["metrics"]
    calibration = load_checkpoint(cal_path).extra["calibration"]
    print(f"BC on the random-to-demonstrator scale: {100 * scale:.0f}%  (target >= 80%)")
    if "bc+relabel" in results:
        relabel = (results["bc+relabel"].mean - rand) / (demo - rand) if demo != rand else 0
        print(f"BC after one relabelling round: {100 * relabel:.0f}%")
    print(f"BC best epoch: val loss {metrics.get('bc/val_loss', float('nan')):.3f}, "
          f"val accuracy {metrics.get('bc/val_accuracy', float('nan')):.3f}")
    print(f"calibration explained variance {calibration['initial_explained_variance']:.3f} -> "
          f"{calibration['explained_variance']:.3f} in {calibration['wall_seconds']:.0f}s")
    print("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in walls.items()))


if __name__ == "__main__":
    main()
