"""Learning results on Pong: the warm start against the two ways PPO is usually started.

    .venv/bin/oakemu pipeline run pipelines/pong.toml          # makes data/runs/pong
    .venv/bin/python benchmarks/learning_results.py --source data/runs/pong --seeds 0 1 2

The arms fine-tune with the same PPO step budget, recipe and seeds:

    full          calibrated.pt with the pipeline's warm-start guards (critic-first
                  warm-up, KL anchor, BC loss when the pipeline turns it on)
    uncalibrated  bc.pt with the guards: the ablation of calibration alone
    unguarded     calibrated.pt without the guards: the ablation of the guards alone
    naive         bc.pt straight into PPO: no calibration, no guards
    scratch       a fresh model (plain PPO)

Every `--eval-every` updates the policy plays `--eval-episodes` greedy whole games; at the
end each `ppo.pt`, the BC policy and the scripted demonstrator play `--final-episodes`
greedy episodes on the same seeds. Prints, per arm (mean over seeds, and each seed):
the lowest greedy score during the first 20% of fine-tuning (the collapse); the same
worst case measured against the BC policy on the same games (every evaluation plays PPO's
selection games, seeds `eval_seed` onwards, which the BC policy plays too, so the games'
own luck cancels; the target is ≥ -3); the
first steps at which a greedy evaluation reached the demonstrator's score and `--goal`; and
the final score. Writes `results.md`, `results.json` and `learning_curves.png` under
`--out`.

Each (arm, seed) run lives in its own directory under `--out`; a run whose `result.json`
exists is not run again, so adding seeds later only runs the new ones, and a run that was
killed resumes from its last `ppo_last.pt` (written every 25 updates). Runs go `--jobs`
at a time, one torch thread each.

`--ppo KEY=VALUE` (repeatable) changes one `[ppo]` key of the pipeline's recipe, checked
as the pipeline file would be (`--ppo kl_coef=1.0 --ppo ent_coef=0.003`). The arms without
guards still turn every guard off, whatever `--ppo` gives them. Give such a variant its own
`--out`, as finished runs there are not run again.

`--early-only` pauses every run after the first 20% of its steps, with the schedules of
the whole `--steps` (the ablation's collapse question needs no more), and skips the final
games. Running again without it resumes those runs to the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ARMS = ("full", "uncalibrated", "unguarded", "naive", "scratch")
GUARDS_OFF = {"warmup_updates": 0, "warmup_ramp_updates": 0, "kl_coef": 0.0, "bc_coef": 0.0}
CALIBRATED = ("full", "unguarded")
GUARDED = ("full", "uncalibrated")

EARLY_SHARE = 0.2
"""The start of fine-tuning where a collapse is looked for (the first 20% of the steps)."""


def arm_start(arm: str) -> tuple[str, dict]:
    """The file an arm starts from in the source run directory, and the PPO settings it
    changes from the pipeline's recipe."""
    return ("calibrated.pt" if arm in CALIBRATED else "bc.pt",
            ({} if arm in GUARDED else GUARDS_OFF) | {"from_scratch": arm == "scratch"})


_WATCHING = False


BENCHMARK_KEYS = ("total_steps", "eval_every", "eval_episodes", "seed", "threads",
                  "checkpoint_every", "from_scratch")
"""[ppo] keys the benchmark sets itself, from its own options or per arm."""


def ppo_overrides(items: list[str], base) -> dict:
    """`--ppo KEY=VALUE` pairs as checked values of the pipeline's PPOConfig `base`. VALUE is
    read as a TOML value (`0.003`, `true`, `"linear"`), or else as a bare string; the
    changed recipe must pass PPOConfig's own checks, as the pipeline file would."""
    from oakemu_rl.configs import table_values
    from oakemu_rl.finetune.ppo import PPOConfig

    table = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--ppo {item!r} is not KEY=VALUE")
        if key in BENCHMARK_KEYS:
            raise ValueError(f"--ppo {key} is set by the benchmark itself (see its options)")
        try:
            table[key] = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            table[key] = text
    values = table_values(PPOConfig, table, "ppo")
    dataclasses.replace(base, **values)  # PPOConfig's range checks, on the changed recipe
    return values


def recipe(args: dict):
    """The PPOConfig every arm starts from: the pipeline file's [ppo] with `--ppo`'s keys."""
    from oakemu_rl.pipeline import load_pipeline

    return dataclasses.replace(load_pipeline(args["pipeline"]).ppo, **args["ppo_overrides"])


def _exit_with_parent() -> None:
    """A killed benchmark must not leave its fine-tunes running (and writing) on their own."""
    global _WATCHING
    if _WATCHING:
        return
    _WATCHING = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def run_arm(arm: str, seed: int, args: dict) -> dict:
    """One fine-tune; runs in a worker process."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _exit_with_parent()
    from oakemu_rl.agents import load_policy_agent
    from oakemu_rl.checkpoint import load_checkpoint
    from oakemu_rl.finetune.ppo import finetune_ppo
    from oakemu_rl.metrics import read_metrics
    from oakemu_rl.tester import EvalConfig, evaluate

    source = Path(args["source"])
    run_dir = Path(args["out"]) / f"{arm}-s{seed}"
    early_only = args["early_only"]
    start_file, changes = arm_start(arm)
    settings = changes | {
        "total_steps": args["steps"], "eval_every": args["eval_every"],
        "eval_episodes": args["eval_episodes"], "seed": seed, "threads": 1,
        # ppo_last.pt every 25 updates: a run killed with its session resumes from there
        "checkpoint_every": 25}
    config = dataclasses.replace(recipe(args), **settings)
    checkpoint = source / start_file
    start = time.perf_counter()
    earlier = _read_result(run_dir)
    path = finetune_ppo(config, run_dir=run_dir, checkpoint=checkpoint, device="cpu",
                        progress=False, resume=(run_dir / "ppo_last.pt").exists(),
                        stop_after_steps=int(EARLY_SHARE * args["steps"]) if early_only
                        else None)
    wall = time.perf_counter() - start + (earlier or {}).get("wall_seconds", 0.0)
    curve = [(r["step"], r["eval/greedy_return"])
             for r in read_metrics(run_dir / "ppo_metrics.jsonl") if "eval/greedy_return" in r]
    checkpoint_file = load_checkpoint(path)
    final = None
    if not early_only:
        agent, spec = load_policy_agent(path, device="cpu")
        final = evaluate(agent, spec, EvalConfig(episodes=args["final_episodes"], seed=1000),
                         progress=False).to_dict()
    result = {"arm": arm, "seed": seed, "steps": args["steps"], "curve": curve,
              "final": final, "early_only": early_only,
              "steps_run": checkpoint_file.steps["ppo/global_step"]
              if early_only else args["steps"],
              "wall_seconds": wall, "timings": checkpoint_file.extra.get("timings", {}),
              "config": dataclasses.asdict(config)}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _read_result(run_dir: Path) -> dict | None:
    path = run_dir / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def _done(run_dir: Path, early_only: bool) -> bool:
    """Whether a run has what this invocation asks of it: a paused run is done for
    --early-only and is resumed to the end otherwise."""
    result = _read_result(run_dir)
    return result is not None and (early_only or not result.get("early_only", False))


def _reference_scores(args: argparse.Namespace) -> dict:
    """BC, the scripted demonstrator and a random policy on the final test's seeds."""
    from oakemu_rl.agents import RandomAgent, load_policy_agent
    from oakemu_rl.agents.scripted import make_demonstrator
    from oakemu_rl.envs import action_mask
    from oakemu_rl.pipeline import load_pipeline
    from oakemu_rl.tester import EvalConfig, evaluate

    path = Path(args.out) / "reference.json"
    scores = json.loads(path.read_text()) if path.exists() else {}
    pipeline = load_pipeline(args.pipeline)
    ppo = recipe(vars(args))
    config = EvalConfig(episodes=args.final_episodes, seed=1000)
    agent, spec = load_policy_agent(Path(args.source) / "bc.pt", device="cpu")
    early = _early_updates(args, ppo)
    selection = dataclasses.replace(config, episodes=args.eval_episodes, seed=ppo.eval_seed,
                                    max_steps=ppo.eval_max_steps)
    games = {"episodes": args.eval_episodes, "seed": ppo.eval_seed,
             "max_steps": ppo.eval_max_steps}
    if scores and sorted(map(int, scores.get("early", {}))) == early \
            and scores.get("selection_games") == games:
        return scores
    if not scores or scores.get("selection_games") != games:
        demonstrator = make_demonstrator(spec, seed=1000, style=pipeline.demos.style)
        scores = {
            "bc": evaluate(agent, spec, config, progress=False).to_dict(),
            # The BC start on the fine-tunes' selection games (every evaluation plays them).
            "start": evaluate(agent, spec, selection, progress=False).to_dict(),
            "demonstrator": evaluate(demonstrator, spec, config, progress=False).to_dict(),
            "random": evaluate(RandomAgent(action_mask(spec)), spec, config,
                               progress=False).to_dict(),
        }
    # The BC policy on the very games of each evaluation in the first 20%: every evaluation
    # plays the selection games, so that is the start's score for each of them.
    scores["early"] = {str(u): scores["start"]["mean"] for u in early}
    scores["selection_games"] = games
    path.write_text(json.dumps(scores, indent=2))
    return scores


def _early_updates(args: argparse.Namespace, ppo) -> list[int]:
    """The updates whose greedy evaluations fall in the first 20% of fine-tuning of the
    PPOConfig `ppo`."""
    batch = ppo.num_envs * ppo.num_steps
    return [u for u in range(args.eval_every, args.steps // batch + 1, args.eval_every)
            if u * batch <= EARLY_SHARE * args.steps]


def _summary(results: list[dict], reference: dict, goal: float, steps: int) -> tuple[str, dict]:
    bc, demo, rand = (reference[k]["mean"] for k in ("bc", "demonstrator", "random"))
    rows, table = [], {}
    for arm in ARMS:
        runs = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])
        if not runs:
            continue
        early = [min((s for step, s in r["curve"] if step <= EARLY_SHARE * steps), default=np.nan)
                 for r in runs]
        drop = [_early_drop(r, reference["early"], steps) for r in runs] if arm != "scratch" \
            else None
        reach = [next((step for step, s in r["curve"] if s >= goal), None) for r in runs]
        level = [next((step for step, s in r["curve"] if s >= demo), None) for r in runs]
        final = [r["final"]["mean"] if r.get("final") else None for r in runs]
        table[arm] = {"seeds": [r["seed"] for r in runs], "early_min": early,
                      "early_drop_vs_bc": drop,
                      "steps_to_goal": reach, "steps_to_demonstrator": level, "final": final,
                      "sps": [r.get("steps_run", steps) / r["wall_seconds"] for r in runs]}
        reached = [s for s in reach if s is not None]
        per_seed = ", ".join(f"{e:+.0f}" for e in early)
        rows.append(
            f"| {arm} | {len(runs)} | {np.mean(early):+.1f} ({per_seed})"
            + (f" | {min(drop):+.1f} ({', '.join(f'{d:+.1f}' for d in drop)})" if drop
               else " | -")
            + f" | {', '.join('-' if s is None else f'{s // 1000}k' for s in level)}"
            f" | {len(reached)}/{len(runs)}"
            + (f" (median {int(np.median(reached)):,})" if reached else "")
            + f" | {_finals(runs)} |")
    text = "\n".join([
        f"PPO budget {steps:,} agent steps; BC {_with_se(reference['bc'])}, scripted "
        f"demonstrator {_with_se(reference['demonstrator'])}, random "
        f"{_with_se(reference['random'])} (greedy, {reference['bc']['episodes']} games "
        "each): BC at "
        f"{100 * (bc - rand) / (demo - rand):.0f}% of the random-to-demonstrator scale.",
        "",
        "| arm | seeds | lowest greedy score in the first 20% (per seed) "
        "| worst score minus BC's on the same games, first 20% (per seed) "
        "| first step at the demonstrator's score (per seed) "
        f"| reached {goal:+.0f} | final greedy score (per seed) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ])
    return text, table


def _finals(runs: list[dict]) -> str:
    """The final-score cell: the mean over seeds and each seed's score, or where the runs
    were paused (--early-only) when some have no final games."""
    if any(not r.get("final") for r in runs):
        paused = sorted({r.get("steps_run") or r["steps"] for r in runs if not r.get("final")})
        return "- (paused at " + ", ".join(f"{s:,}" for s in paused) + " steps)"
    return (f"{np.mean([r['final']['mean'] for r in runs]):+.1f} ("
            + ", ".join(f"{r['final']['mean']:+.1f} ± {r['final'].get('sem', np.nan):.1f}"
                        for r in runs)
            + f"; {runs[0]['final'].get('episodes', '?')} games each)")


def _with_se(result: dict) -> str:
    """`mean ± SE` of an EvalResult dict (results written before SEs say so)."""
    sem = result.get("sem")
    return f"{result['mean']:+.1f}" + (f" ± {sem:.1f}" if sem is not None else " (no SE)")


def _early_drop(run: dict, early: dict, steps: int) -> float:
    """The fine-tune's worst evaluation in the first 20% minus the BC policy's score on the
    same games (the collapse, with the games' own luck taken out); 0 means no drop."""
    batch = run["config"]["num_envs"] * run["config"]["num_steps"]
    return min((s - early[str(step // batch)] for step, s in run["curve"]
                if step <= EARLY_SHARE * steps and str(step // batch) in early), default=np.nan)


def _plot(results: list[dict], reference: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {"full": "tab:green", "uncalibrated": "tab:purple", "unguarded": "tab:red",
               "naive": "tab:orange", "scratch": "tab:blue"}
    start = reference["start"]["mean"]
    for arm in ARMS:
        runs = [r for r in results if r["arm"] == arm]
        if not runs:
            continue
        for r in runs:
            points = ([(0, start)] if arm != "scratch" else []) + [tuple(p) for p in r["curve"]]
            ax.plot(*zip(*points, strict=True), color=colours[arm], alpha=0.25, lw=1)
        steps = sorted({p[0] for r in runs for p in r["curve"]})
        mean = [np.mean([s for r in runs for st, s in r["curve"] if st == step]) for step in steps]
        if arm != "scratch":
            steps, mean = [0, *steps], [start, *mean]
        ax.plot(steps, mean, "o-", ms=3, color=colours[arm], label=f"{arm} ({len(runs)} seeds)")
    # The curves play the selection games, where the clone's own score is `start`; the
    # final games (bc, demonstrator) are other seeds, and the labels say which is which.
    for name, label, style in (("start", "bc, selection games", "-."),
                               ("bc", "bc, final games", ":"),
                               ("demonstrator", "demonstrator, final games", "--")):
        ax.axhline(reference[name]["mean"], color="grey", ls=style, lw=1,
                   label=f"{label} {reference[name]['mean']:+.1f}")
    ax.set(xlabel="PPO agent steps", ylabel="greedy game score",
           title="Pong: fine-tuning from the warm start vs the usual starts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="data/runs/pong",
                        help="pipeline run dir holding bc.pt and calibrated.pt")
    parser.add_argument("--pipeline", default="pipelines/pong.toml",
                        help="its pipeline file (PPO recipe and guards)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--eval-every", type=int, default=8, help="updates between evaluations")
    parser.add_argument("--eval-episodes", type=int, default=10,
                        help="games per greedy evaluation (the pipeline's selection games)")
    parser.add_argument("--final-episodes", type=int, default=3)
    parser.add_argument("--goal", type=float, default=15.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="data/runs/bench-learning")
    parser.add_argument("--ppo", action="append", default=[], metavar="KEY=VALUE",
                        help="change one [ppo] key of the pipeline's recipe (repeatable; "
                             "the unguarded arms keep their guards off)")
    parser.add_argument("--early-only", action="store_true",
                        help="pause each run after the first 20%% of --steps (the collapse "
                             "window) and skip its final games; a later run without this "
                             "flag resumes them")
    args = parser.parse_args()
    from oakemu_rl.errors import OakEmuError
    from oakemu_rl.pipeline import load_pipeline

    try:
        args.ppo_overrides = ppo_overrides(args.ppo, load_pipeline(args.pipeline).ppo)
    except (ValueError, OakEmuError) as error:
        parser.error(str(error))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("bc.pt", "calibrated.pt"):
        if not (Path(args.source) / name).exists():
            parser.error(f"{args.source}/{name} is missing: run `oakemu pipeline run "
                         f"{args.pipeline}` first")

    reference = _reference_scores(args)
    todo = [(arm, seed) for seed in args.seeds for arm in args.arms
            if not _done(out / f"{arm}-s{seed}", args.early_only)]
    if todo:
        print(f"running {len(todo)} fine-tune(s), {args.jobs} at a time: "
              + ", ".join(f"{a}-s{s}" for a, s in todo), flush=True)
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(run_arm, arm, seed, vars(args)) for arm, seed in todo]
            for future in futures:
                result = future.result()
                final = result["final"]
                print(f"{result['arm']}-s{result['seed']}: "
                      + (f"final {final['mean']:+.1f}" if final
                         else f"paused at {result['steps_run']:,} steps")
                      + f", {result['steps_run'] / result['wall_seconds']:.0f} SPS with "
                      "evaluations", flush=True)
    results = [result for seed in args.seeds for arm in args.arms
               if (result := _read_result(out / f"{arm}-s{seed}")) is not None]
    text, table = _summary(results, reference, args.goal, args.steps)
    _plot(results, reference, out / "learning_curves.png")
    (out / "results.md").write_text(text + "\n\n![learning curves](learning_curves.png)\n")
    (out / "results.json").write_text(json.dumps({"reference": reference, "arms": table},
                                                 indent=2))
    print(text)
    print(f"wrote {out / 'results.md'} and {out / 'learning_curves.png'}")


if __name__ == "__main__":
    main()
