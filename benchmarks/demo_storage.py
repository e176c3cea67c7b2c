"""Demo storage: bytes per stored frame, and what recording costs over bare emulation.

    .venv/bin/python benchmarks/demo_storage.py [--game pong] [--episodes 3] [--steps 2000]

Plays the same seeded episodes three ways, side by side, several rounds, and prints
medians: bare emulator steps/s (single env, the recording wrappers), steps/s of
`oakemu record` into a fresh HDF5 file (the copy-on-write commit included), and the
file's bytes per frame.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from oakemu_rl.agents import RandomAgent
from oakemu_rl.agents.recording import RecordConfig, record
from oakemu_rl.demos import DemoFile
from oakemu_rl.envs import EnvSpec, action_mask, make_env


def agent_for(name: str, spec: EnvSpec):
    if name == "random":
        return RandomAgent(action_mask(spec))
    from oakemu_rl.agents.scripted import make_demonstrator

    return make_demonstrator(spec, seed=0)


def bare(spec: EnvSpec, agent, episodes: int, steps: int) -> float:
    env = make_env(spec, render_mode="rgb_array")
    total = 0
    start = time.perf_counter()
    for episode in range(episodes):
        obs, _ = env.reset(seed=episode)
        agent.reset(env, episode)
        for _ in range(steps):
            obs, _, terminated, truncated, _ = env.step(agent.act(env, obs))
            total += 1
            if terminated or truncated:
                break
    elapsed = time.perf_counter() - start
    env.close()
    return total / elapsed


def recorded(spec: EnvSpec, agent, episodes: int, steps: int, folder: Path) -> tuple[float, float]:
    path = folder / f"bench-{time.monotonic_ns()}.h5"
    start = time.perf_counter()
    record(RecordConfig(out=path, spec=spec, episodes=episodes, max_steps=steps,
                        progress=False), agent)
    elapsed = time.perf_counter() - start
    with DemoFile(path) as demo:
        frames = demo.num_steps
    size = path.stat().st_size
    path.unlink()
    return frames / elapsed, size / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="pong")
    parser.add_argument("--agent", choices=["random", "scripted"], default="scripted")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="max agent steps per episode")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = EnvSpec(game=args.game)
    bare_sps, rec_sps, bpf = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            bare_sps.append(bare(spec, agent_for(args.agent, spec), args.episodes, args.steps))
            sps, size = recorded(spec, agent_for(args.agent, spec), args.episodes, args.steps,
                                 Path(folder))
            rec_sps.append(sps)
            bpf.append(size)
    b, r = statistics.median(bare_sps), statistics.median(rec_sps)
    print(f"game {spec.game}, agent {args.agent}, {args.episodes} episodes x <= {args.steps} "
          f"steps, {args.rounds} rounds (medians)")
    print(f"bare emulation      {b:8.0f} steps/s")
    print(f"recording to HDF5   {r:8.0f} steps/s   ({100 * (b / r - 1):.1f}% slower)")
    print(f"bytes per frame     {statistics.median(bpf):8.1f}   (raw frame "
          f"{spec.screen_size ** 2} bytes)")


if __name__ == "__main__":
    main()
