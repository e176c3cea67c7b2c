"""Greedy play speed: the torch model against onnxruntime, steps per second with the emulator.

    .venv/bin/python benchmarks/greedy_play.py data/runs/pong/bc.pt [--steps 3000]
        [--rounds 5] [--threads 1 2] [--games 8 --max-steps 2000] [--workers 2]

Greedy play (the tester, PPO's evaluation games, the relabelling games of the pipeline's
bc stage) runs one forward pass per emulator step, batch 1 for one game. Each round plays
`--steps` steps of the checkpoint's evaluation spec with each engine of
`oakemu_rl.agents.greedy_agent`, one after the other, from the same seeds; the script
prints the median steps/s per engine and thread count, their ratio, and whether both
engines chose the same action on every step
(they play the same game until the first differing choice).

With `--games N`, each round also plays N games of at most `--max-steps` steps through
`play_games` with the default engine, once one game at a time and once together (up to
`BATCH_GAMES` games sharing each forward pass), alternating which goes first, and prints
the median steps/s of each, their ratio, and whether every game scored alike both ways.

With `--games N --workers W [W ...]` instead, each round plays the N games together in
this process on the last of `--threads`, and on W processes of one thread each
(`EvalConfig.workers`, the time of starting them included), alternating which goes
first, and prints the median steps/s of each, the ratio to this process, and whether
every game scored alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from oakemu_rl.agents import greedy_agent
from oakemu_rl.agents.play import EvalConfig, play_games
from oakemu_rl.checkpoint import checkpoint_spec, load_checkpoint
from oakemu_rl.envs import make_env

ENGINES = ("torch", "onnx")


def play(agent, spec, steps: int, seed: int) -> tuple[float, list[int]]:
    """Steps/s of `steps` greedy steps (episodes restart with seed + step), and the actions."""
    env = make_env(spec)
    observation, _ = env.reset(seed=seed)
    agent.reset(env, seed)
    actions = []
    start = time.perf_counter()
    for step in range(steps):
        action = agent.act(env, observation)
        actions.append(action)
        observation, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            observation, _ = env.reset(seed=seed + step)
    elapsed = time.perf_counter() - start
    env.close()
    return steps / elapsed, actions


class InTurn:
    """The agent without its batch play: `play_games` plays its games one at a time."""

    def __init__(self, agent) -> None:
        self.agent, self.kind = agent, agent.kind

    def reset(self, env, seed: int) -> None:
        self.agent.reset(env, seed)

    def act(self, env, observation):
        return self.agent.act(env, observation)


def games(agent, spec, config: EvalConfig, together: bool = True) -> tuple[float, list, list]:
    """Steps/s of `play_games` over the games of `config`, and the games' scores and lengths."""
    start = time.perf_counter()
    result = play_games(agent if together else InTurn(agent), spec, config, progress=False)
    elapsed = time.perf_counter() - start
    return sum(result.lengths) / elapsed, result.scores, result.lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--games", type=int, default=0,
                        help="also time this many games played in turn against together")
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[],
                        help="with --games, also time the games on this many processes")
    args = parser.parse_args()
    if args.workers and not args.games:
        parser.error("--workers times games: give --games N too")

    checkpoint = load_checkpoint(args.checkpoint)
    spec = checkpoint_spec(checkpoint, args.checkpoint).for_evaluation()
    mask = np.asarray(checkpoint.action_mask, dtype=bool)
    model = checkpoint.build_model("cpu").eval()
    rates: dict[tuple[str, int], list[float]] = {}
    same = True
    for threads in args.threads:
        torch.set_num_threads(threads)
        agents = {engine: greedy_agent(model, mask, device="cpu", engine=engine)
                  for engine in ENGINES}
        for round_ in range(args.rounds):
            played = {}
            for engine in ENGINES:
                rate, played[engine] = play(agents[engine], spec, args.steps, seed=round_)
                rates.setdefault((engine, threads), []).append(rate)
            same &= played["torch"] == played["onnx"]

    print(f"{args.checkpoint}: {args.rounds} rounds of {args.steps} greedy steps per engine")
    print(f"{'threads':>7}  {'torch steps/s':>13}  {'onnx steps/s':>12}  {'onnx/torch':>10}")
    for threads in args.threads:
        torch_rate = statistics.median(rates["torch", threads])
        onnx_rate = statistics.median(rates["onnx", threads])
        print(f"{threads:>7}  {torch_rate:>13,.0f}  {onnx_rate:>12,.0f}  "
              f"{onnx_rate / torch_rate:>9.2f}x")
    print("same actions on every step" if same else "the engines chose differently somewhere")
    if args.workers:
        processes(args, model, mask, spec)
    elif args.games:
        print(f"{args.games} games of at most {args.max_steps} steps, default engine, "
              f"{args.rounds} rounds")
        print(f"{'threads':>7}  {'in turn steps/s':>15}  {'together steps/s':>16}  "
              f"{'together/in turn':>16}")
        alike = True
        for threads in args.threads:
            torch.set_num_threads(threads)
            agent = greedy_agent(model, mask, device="cpu")
            config = EvalConfig(episodes=args.games, seed=0, max_steps=args.max_steps)
            rate = {True: [], False: []}
            for round_ in range(args.rounds):
                played = {}
                for together in ((True, False) if round_ % 2 else (False, True)):
                    speed, *played[together] = games(agent, spec, config, together)
                    rate[together].append(speed)
                alike &= played[True] == played[False]
            turn, both = statistics.median(rate[False]), statistics.median(rate[True])
            print(f"{threads:>7}  {turn:>15,.0f}  {both:>16,.0f}  {both / turn:>15.2f}x")
        print("every game scored alike both ways" if alike
              else "some game scored differently together")


def processes(args, model, mask, spec) -> None:
    """The games together in this process against on each count of `--workers`."""
    threads = args.threads[-1]
    torch.set_num_threads(threads)
    agent = greedy_agent(model, mask, device="cpu")
    configs = {0: EvalConfig(episodes=args.games, seed=0, max_steps=args.max_steps)}
    configs.update({w: EvalConfig(episodes=args.games, seed=0, max_steps=args.max_steps,
                                  workers=w) for w in args.workers})
    rate: dict[int, list[float]] = {w: [] for w in configs}
    alike = True
    for round_ in range(args.rounds):
        order = list(configs) if round_ % 2 == 0 else list(configs)[::-1]
        played = {}
        for w in order:
            speed, *played[w] = games(agent, spec, configs[w])
            rate[w].append(speed)
        alike &= all(played[w] == played[0] for w in played)
    here = statistics.median(rate[0])
    print(f"{args.games} games of at most {args.max_steps} steps, together, {args.rounds} "
          f"rounds: this process on {threads} thread(s) against processes of one thread")
    print(f"{'processes':>9}  {'steps/s':>9}  {'ratio':>6}")
    print(f"{'here':>9}  {here:>9,.0f}  {1:>5.2f}x")
    for w in args.workers:
        there = statistics.median(rate[w])
        print(f"{w:>9}  {there:>9,.0f}  {there / here:>5.2f}x")
    print("every game scored alike" if alike else "some game scored differently")


if __name__ == "__main__":
    main()
