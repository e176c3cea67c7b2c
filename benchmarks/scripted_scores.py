"""Scores of the built-in scripted demonstrators over whole games.

    .venv/bin/python benchmarks/scripted_scores.py [--games pong breakout] [--episodes 5]
        [--seed 0] [--noise 0.0] [--max-steps 27000] [--style planner]

Plays each game with the default EnvSpec (sticky actions 0.25, up to 30 NOOPs at the
start, the full 108,000-frame episode limit) until the emulator ends the episode or
`--max-steps` agent steps have passed. Episode i uses seed `seed + i` for both the env
and the demonstrator, as `oakemu record` does. Prints each episode's score and length,
then mean / std / min / max per game and the steps per second (emulator and script
together, one process).
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--games", nargs="+", default=list(SCRIPTED_GAMES),
                        choices=sorted(SCRIPTED_GAMES))
    parser.add_argument("--episodes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.0,
                        help="Chance per step of a random allowed action.")
    parser.add_argument("--style", default="planner",
                        help="Demonstrator style (planner; follow on Pong).")
    parser.add_argument("--max-steps", type=int, default=27_000,
                        help="Agent steps after which an episode is cut.")
    args = parser.parse_args()

    for game in args.games:
        spec = EnvSpec(game=game)
        print(f"{spec.env_id}: sticky {spec.repeat_action_probability}, noise {args.noise}, "
              f"style {args.style}, "
              f"{args.episodes} episode(s), seed {args.seed}")
        scores, total_steps, started = [], 0, time.perf_counter()
        for episode in range(args.episodes):
            seed = args.seed + episode
            agent = make_demonstrator(spec, seed=seed, noise=args.noise, style=args.style)
            score, steps, end = play_episode(spec, agent, seed, args.max_steps)
            scores.append(score)
            total_steps += steps
            print(f"  episode {episode} (seed {seed}): score {score:+.0f}, {steps} steps, {end}")
        elapsed = time.perf_counter() - started
        std = statistics.pstdev(scores) if len(scores) > 1 else 0.0
        print(f"  {game}: mean {statistics.fmean(scores):+.2f}, std {std:.2f}, "
              f"min {min(scores):+.0f}, max {max(scores):+.0f}; "
              f"{total_steps / elapsed:.0f} steps/s")


if __name__ == "__main__":
    main()
