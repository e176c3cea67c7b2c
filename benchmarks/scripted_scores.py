"""Scores of the built-in scripted demonstrators over whole games.

    .venv/bin/python benchmarks/scripted_scores.py [--games pong breakout] [--episodes 5]
        [--seeds 0 [1000 ...]] [--noise 0.0] [--max-steps 27000] [--style planner]
        [--jobs 1]

Plays each game with the default EnvSpec (sticky actions 0.25, up to 30 NOOPs at the
start, the full 108,000-frame episode limit) until the emulator ends the episode or
`--max-steps` agent steps have passed. Each number given to `--seeds` (`--seed` is the
same option) starts a set of `--episodes` games: game i of the set starting at s uses
seed `s + i` for both the env and the demonstrator, as `oakemu record` does. Prints each
episode's score and length, then per game and seed set the mean ± its standard error
(std / sqrt(n)), std, min and max, and the steps per second (emulator and script
together, per process); with several sets, also the figures over all of them.
`--jobs N` plays N games at a time in separate processes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from oakemu_rl.agents.scripted import SCRIPTED_GAMES, make_demonstrator
from oakemu_rl.envs import EnvSpec, make_env


def play_episode(spec: EnvSpec, agent, seed: int, max_steps: int) -> tuple[float, int, str]:
    env = make_env(spec)
    try:
        observation, _ = env.reset(seed=seed)
        agent.reset(env, seed)
        score, steps, end = 0.0, 0, "max-steps"
        while steps < max_steps:
            observation, reward, terminated, truncated, _ = env.step(agent.act(env, observation))
            score += float(reward)
            steps += 1
            if terminated or truncated:
                end = "game over" if terminated else "frame limit"
                break
        return score, steps, end
    finally:
        env.close()


def play_seed(game: str, style: str, noise: float, seed: int,
              max_steps: int) -> tuple[float, int, str, float]:
    """One game with demonstrator and env seeded `seed`: score, steps, how it ended, and
    the seconds it took."""
    spec = EnvSpec(game=game)
    started = time.perf_counter()
    agent = make_demonstrator(spec, seed=seed, noise=noise, style=style)
    score, steps, end = play_episode(spec, agent, seed, max_steps)
    return score, steps, end, time.perf_counter() - started


def summary(scores: list[float]) -> str:
    """mean ± standard error (std / sqrt(n)), std, min and max of `scores`."""
    std = statistics.pstdev(scores) if len(scores) > 1 else 0.0
    sem = std / math.sqrt(len(scores))
    return (f"mean {statistics.fmean(scores):+.2f} ± {sem:.2f} (n {len(scores)}), "
            f"std {std:.2f}, min {min(scores):+.0f}, max {max(scores):+.0f}")


class _Inline:
    """Plays the games one after another in this process (`--jobs 1`)."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @staticmethod
    def map(fn, *iterables):  # the same shape as Executor.map
        return map(fn, *iterables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--games", nargs="+", default=list(SCRIPTED_GAMES),
                        choices=sorted(SCRIPTED_GAMES))
    parser.add_argument("--episodes", type=int, default=5, help="Games per seed set.")
    parser.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0],
                        help="First seed of each set of games.")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="Chance per step of a random allowed action.")
    parser.add_argument("--style", default="planner",
                        help="Demonstrator style (planner or human; follow on Pong).")
    parser.add_argument("--max-steps", type=int, default=27_000,
                        help="Agent steps after which an episode is cut.")
    parser.add_argument("--jobs", type=int, default=1, help="Games played at a time.")
    args = parser.parse_args()

    with ProcessPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else _Inline() as pool:
        for game in args.games:
            spec = EnvSpec(game=game)
            everything: list[float] = []
            for first in args.seeds:
                print(f"{spec.env_id}: sticky {spec.repeat_action_probability}, noise "
                      f"{args.noise}, style {args.style}, {args.episodes} episode(s), "
                      f"seeds {first}..{first + args.episodes - 1}", flush=True)
                seeds = [first + i for i in range(args.episodes)]
                runs = pool.map(play_seed, [game] * len(seeds), [args.style] * len(seeds),
                                [args.noise] * len(seeds), seeds,
                                [args.max_steps] * len(seeds))
                scores, total_steps, busy = [], 0, 0.0
                for episode, (seed, (score, steps, end, seconds)) in enumerate(
                        zip(seeds, runs, strict=True)):
                    scores.append(score)
                    total_steps += steps
                    busy += seconds
                    print(f"  episode {episode} (seed {seed}): score {score:+.0f}, "
                          f"{steps} steps, {end}", flush=True)
                everything += scores
                print(f"  {game}, seeds {first}..{seeds[-1]}: {summary(scores)}; "
                      f"{total_steps / busy:.0f} steps/s", flush=True)
            if len(args.seeds) > 1:
                print(f"  {game}, all {len(args.seeds)} sets: {summary(everything)}",
                      flush=True)


if __name__ == "__main__":
    main()
