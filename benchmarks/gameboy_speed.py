"""Agent steps/s of the Game Boy vector env against one bare headless PyBoy.

    .venv/bin/python benchmarks/gameboy_speed.py [--envs 1 2 4 8] [--repeats 3] [--seconds 1]

Game CATCH (`EnvSpec(game="catch")`, 4 frames per agent step), random actions, the
vector envs in training's same-step autoreset mode. For each number of envs N:

- `gym async`: gymnasium's AsyncVectorEnv over shared memory, one process per env (fork);
  what the Game Boy vector env used before its own pool;
- `gym sync`: gymnasium's SyncVectorEnv, every env in this process;
- `pool in-process`: PoolVectorEnv with `processes=False` (own slices, no workers);
- `pool K workers`: PoolVectorEnv with K worker processes over shared memory, each
  stepping N/K envs: K = the usable cores (the default) and K = N (one process per env).

Baselines, one emulator in this process: `bare PyBoy` presses the action's buttons, ticks
4 frames rendering only the last, releases and reads the screen; `bare + preprocessing`
also makes the env's observation frame (grayscale, crop, INTER_AREA resize to 84 × 84);
`GameBoyEnv` is one env's `step` (RAM rewards and ends, frame stack, sticky actions).
So `bare` → `bare + preprocessing` → `GameBoyEnv` → vector envs shows what the frame, the
env layer and the processes each cost. Each figure is the median over `--repeats` runs
of `--seconds` each (after a short warm-up), beside the CPU time of this process and its
workers per agent step, which other load on a shared machine disturbs less. Every repeat
runs all cases in turn, so machine load hits them alike. `x bare` is the ratio to the
bare emulator, `x prep` to bare + preprocessing; with several cores the worker pools can
exceed 1.
"""

from __future__ import annotations

import argparse
import functools
import io
import multiprocessing
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from oakemu_rl.envs import EnvSpec, roms
from oakemu_rl.envs.gameboy import GameBoyEnv
from oakemu_rl.envs.pool import PoolVectorEnv, default_workers

Case = Callable[[float, np.random.Generator], tuple[float, float]]
"""Runs for about `seconds`; returns agent steps/s and CPU µs per agent step."""

WARMUP_STEPS = 20
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds() -> float:
    """CPU time of this process and its live worker processes (from /proc)."""
    total = time.process_time()
    for child in multiprocessing.active_children():
        try:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


def _timed(step: Callable[[], int], seconds: float) -> tuple[float, float]:
    for _ in range(WARMUP_STEPS):
        step()
    steps, cpu, start = 0, _cpu_seconds(), time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        steps += step()
    return steps / elapsed, (_cpu_seconds() - cpu) / steps * 1e6


def bare(spec: EnvSpec, preprocess: bool) -> Case:
    import cv2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pyboy import PyBoy

    config = spec.gameboy_config
    buttons = [[b.lower() for b in action] for action in config.actions]
    frames, size = config.frames_per_action, spec.screen_size
    top, bottom, left, right = config.crop

    def run(seconds: float, rng: np.random.Generator) -> tuple[float, float]:
        emulator = PyBoy(io.BytesIO(roms.rom_for(spec.rom_sha256, spec.game)), window="null",
                         sound_emulated=False, log_level="ERROR")
        emulator.set_emulation_speed(0)
        emulator.tick(config.boot_frames, True)
        actions = rng.integers(0, len(buttons), 1 << 16)
        count = 0

        def step() -> int:
            nonlocal count
            pressed = buttons[actions[count & 0xFFFF]]
            count += 1
            for button in pressed:
                emulator.button_press(button)
            emulator.tick(frames, True)
            for button in pressed:
                emulator.button_release(button)
            screen = emulator.screen.ndarray
            if preprocess:
                gray = cv2.cvtColor(screen, cv2.COLOR_RGBA2GRAY)
                gray = gray[top:gray.shape[0] - bottom, left:gray.shape[1] - right]
                cv2.resize(gray, (size, size), interpolation=cv2.INTER_AREA)
            return 1

        try:
            return _timed(step, seconds)
        finally:
            emulator.stop(save=False)

    return run


def single_env(spec: EnvSpec) -> Case:
    def run(seconds: float, rng: np.random.Generator) -> tuple[float, float]:
        env = GameBoyEnv(spec)
        env.reset(seed=int(rng.integers(1 << 30)))
        actions = rng.integers(0, env.action_space.n, 1 << 16)
        count = 0

        def step() -> int:
            nonlocal count
            _, _, terminated, truncated, _ = env.step(actions[count & 0xFFFF])
            count += 1
            if terminated or truncated:
                env.reset()
            return 1

        try:
            return _timed(step, seconds)
        finally:
            env.close()

    return run


def vector(make: Callable[[], object], num_envs: int, actions_n: int) -> Case:
    def run(seconds: float, rng: np.random.Generator) -> tuple[float, float]:
        venv = make()
        try:
            venv.reset(seed=int(rng.integers(1 << 30)))
            actions = rng.integers(0, actions_n, (1 << 12, num_envs))
            count = 0

            def step() -> int:
                nonlocal count
                venv.step(actions[count & 0xFFF])
                count += 1
                return num_envs

            return _timed(step, seconds)
        finally:
            venv.close()

    return run


def gym_vector(spec: EnvSpec, num_envs: int, processes: bool) -> Callable[[], object]:
    from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

    factories = [functools.partial(GameBoyEnv, spec) for _ in range(num_envs)]
    if processes:
        return lambda: AsyncVectorEnv(factories, shared_memory=True, context="fork",
                                      autoreset_mode=AutoresetMode.SAME_STEP)
    return lambda: SyncVectorEnv(factories, autoreset_mode=AutoresetMode.SAME_STEP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="measured time of each case in each repeat")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    spec = EnvSpec(game="catch")
    actions_n = len(spec.gameboy_config.actions)
    cores = default_workers(1 << 16)
    cases: dict[tuple[str, int], Case] = {
        ("bare PyBoy", 1): bare(spec, preprocess=False),
        ("bare + preprocessing", 1): bare(spec, preprocess=True),
        ("GameBoyEnv", 1): single_env(spec),
    }
    for n in args.envs:
        cases["gym async", n] = vector(gym_vector(spec, n, processes=True), n, actions_n)
        cases["gym sync", n] = vector(gym_vector(spec, n, processes=False), n, actions_n)
        cases["pool in-process", n] = vector(
            functools.partial(PoolVectorEnv, spec, n, same_step_reset=True,
                              processes=False), n, actions_n)
        for k in sorted({min(n, cores), n}):
            cases[f"pool {k} worker{'s' if k > 1 else ''}", n] = vector(
                functools.partial(PoolVectorEnv, spec, n, same_step_reset=True,
                                  processes=True, workers=k), n, actions_n)

    rates: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    cpus: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    rng = np.random.default_rng(args.seed)
    keys = list(cases)
    for repeat in range(args.repeats):
        for key in keys if repeat % 2 == 0 else reversed(keys):
            rate, cpu = cases[key](args.seconds, rng)
            rates[key].append(rate)
            cpus[key].append(cpu)
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)

    medians = {key: statistics.median(values) for key, values in rates.items()}
    raw, prep = medians["bare PyBoy", 1], medians["bare + preprocessing", 1]
    print(f"\nagent steps/s, medians over {args.repeats} repeats of {args.seconds:g} s; "
          f"catch, {spec.frame_skip} frames per step; {os.cpu_count()} CPUs, "
          f"{cores} usable; load average {os.getloadavg()[0]:.2f}")
    print("CPU µs/step: CPU time of this process and its workers per agent step (less "
          "sensitive to other load than steps/s)")
    print(f"{'case':<22} {'envs':>4} {'steps/s':>9} {'x bare':>7} {'x prep':>7} "
          f"{'CPU µs/step':>12}")
    for (name, n), rate in medians.items():
        cpu = statistics.median(cpus[name, n])
        print(f"{name:<22} {n:>4} {rate:>9,.0f} {rate / raw:>7.2f} {rate / prep:>7.2f} "
              f"{cpu:>12,.0f}")


if __name__ == "__main__":
    main()
