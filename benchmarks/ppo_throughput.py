"""PPO throughput: our `finetune_ppo` against stable-baselines3's PPO, same network and recipe.

    .venv/bin/python benchmarks/ppo_throughput.py [--steps 16384] [--rounds 3]
        [--threads 1 2] [--sb3-env ale-vector] [--ours-mode scratch] [--sb3-channels-last]

Needs SB3 in its own virtualenv (never a project dependency):

    python3 -m venv benchmarks/.venv-sb3
    benchmarks/.venv-sb3/bin/pip install torch==2.13.0 stable-baselines3 gymnasium ale-py \\
        opencv-python-headless

Both sides train the Nature-DQN actor-critic (conv 32x8/4, 64x4/2, 64x3/1, fc 512, policy
and value heads on the shared trunk; SB3's `CnnPolicy` with its default `NatureCNN`, which
also scales uint8 frames by 1/255) with the Atari recipe: 8 envs x 128 steps, lr 2.5e-4
annealed linearly, 4 epochs of 4 minibatches (256), clip 0.1 (value clip 0.1 too), ent
0.01, vf 0.5, gamma 0.99, lambda 0.95, max grad norm 0.5, Adam eps 1e-5, on Pong (84x84
gray, stack 4, skip 4 with max-pool, sticky 0.25, 30 no-ops, clipped rewards).

Env side of SB3 (`--sb3-env`): `ale-vector` (default) wraps ale-py's C++ `AtariVectorEnv`
-- the env ours uses -- as an SB3 `VecEnv`, so both sides get the same, fastest emulator
and the comparison is of the learners; `subproc` / `dummy` are SB3's usual
`make_atari_env` (AtariWrapper) + `VecFrameStack` in a `SubprocVecEnv` / `DummyVecEnv`
(about half as fast on 2 cores: ~2500 vs ~4700 env-only steps/s). `--sb3-channels-last`
trains SB3's network in the channels-last layout ours uses on CPU, to show what is left
of the difference with the layout taken out.

Every run is a fresh process (ours in this venv, SB3 in `--sb3-python`) of `--steps` env
steps; each round runs every (side, thread count) once, the order alternating between
rounds. It prints the median steps/s over rounds of the training loop (setup excluded),
the ratio ours/SB3 per thread count, and the time split of each side: ours from
`Timings` (env / inference / learning, in ppo.pt's extra["timings"]), SB3 by timing
`collect_rollouts` (env + inference) and `train` (learning).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SB3_PYTHON = HERE / ".venv-sb3" / "bin" / "python"
NUM_ENVS, NUM_STEPS = 8, 128


# -- workers (one per process) ---------------------------------------------------------------


def worker_ours(steps: int, threads: int, seed: int, mode: str) -> dict:
    import dataclasses

    import torch

    from oakemu_rl import PPOModel
    from oakemu_rl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
    from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
    from oakemu_rl.finetune.ppo import PPOConfig, finetune_ppo
    from oakemu_rl.metrics import read_metrics

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    spec = EnvSpec(game="pong")
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        os.environ["OAKEMU_RUNS"] = str(folder / "runs")
        start = save_checkpoint(folder / "calibrated.pt", Checkpoint.from_model(
            PPOModel(spec.observation_shape, len(action_meanings("pong"))), stage="calibrate",
            action_meanings=list(action_meanings("pong")),
            action_mask=action_mask(spec).tolist(), env_spec=spec.to_dict(), steps={}))
        options = dict(from_scratch=mode == "scratch", total_steps=steps, num_envs=NUM_ENVS,
                       num_steps=NUM_STEPS, eval_episodes=0, checkpoint_every=10**9,
                       seed=seed)
        if "threads" in {f.name for f in dataclasses.fields(PPOConfig)}:
            options["threads"] = threads
        config = PPOConfig(**options)
        wall = time.perf_counter()
        path = finetune_ppo(config, run_dir=folder / "run", checkpoint=start, device="cpu",
                            progress=False)
        wall = time.perf_counter() - wall
        records = [r for r in read_metrics(path.parent / "ppo_metrics.jsonl")
                   if "charts/SPS" in r]
        timings = load_checkpoint(path).extra["timings"]
    return {"sps": records[-1]["charts/SPS"], "wall": wall, "split": timings,
            "threads": torch.get_num_threads()}


def _ale_vector_env(num_envs: int, seed: int):
    """ale-py's C++ vector env as an SB3 VecEnv (same settings as ours)."""
    import gymnasium as gym
    import numpy as np
    from ale_py.vector_env import AtariVectorEnv
    from stable_baselines3.common.vec_env import VecEnv

    class AleVecEnv(VecEnv):
        def __init__(self) -> None:
            self.env = AtariVectorEnv(
                game="pong", num_envs=num_envs, max_num_frames_per_episode=108_000,
                repeat_action_probability=0.25, full_action_space=False, img_height=84,
                img_width=84, grayscale=True, stack_num=4, frameskip=4, maxpool=True,
                noop_max=30, episodic_life=True, reward_clipping=True, use_fire_reset=False,
                autoreset_mode="SameStep")
            super().__init__(num_envs, gym.spaces.Box(0, 255, (4, 84, 84), np.uint8),
                             gym.spaces.Discrete(int(self.env.single_action_space.n)))
            self._actions = None

        def reset(self):
            obs, _ = self.env.reset(seed=seed)
            return obs

        def step_async(self, actions) -> None:
            self._actions = np.asarray(actions).reshape(-1)

        def step_wait(self):
            obs, reward, terminated, truncated, info = self.env.step(self._actions)
            dones = terminated | truncated
            infos: list[dict] = [{} for _ in range(num_envs)]
            if dones.any():
                final = np.asarray(info["final_obs"])
                for i in np.flatnonzero(dones):
                    infos[i]["terminal_observation"] = final[i]
                    infos[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            return obs, reward.astype(np.float32), dones, infos

        def close(self) -> None:
            self.env.close()

        def get_attr(self, attr_name, indices=None):
            return [getattr(self, attr_name)] * num_envs

        def set_attr(self, attr_name, value, indices=None) -> None:
            setattr(self, attr_name, value)

        def env_method(self, method_name, *args, indices=None, **kwargs):
            return [None] * num_envs

        def env_is_wrapped(self, wrapper_class, indices=None):
            return [False] * num_envs

    return AleVecEnv()


def worker_sb3(steps: int, threads: int, seed: int, env_kind: str,
               channels_last: bool) -> dict:
    import torch

    torch.set_num_threads(threads)
    from stable_baselines3 import PPO

    if env_kind == "ale-vector":
        env = _ale_vector_env(NUM_ENVS, seed)
    else:
        from stable_baselines3.common.env_util import make_atari_env
        from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecFrameStack

        def pong(**kwargs):  # a callable, so SubprocVecEnv's children register ALE too
            import ale_py
            import gymnasium as gym

            gym.register_envs(ale_py)
            return gym.make("ALE/Pong-v5", **kwargs)

        env = make_atari_env(
            pong, n_envs=NUM_ENVS, seed=seed,
            vec_env_cls=SubprocVecEnv if env_kind == "subproc" else DummyVecEnv,
            env_kwargs=dict(frameskip=1, repeat_action_probability=0.25))
        env = VecFrameStack(env, n_stack=4)
    model = PPO("CnnPolicy", env, n_steps=NUM_STEPS, batch_size=NUM_ENVS * NUM_STEPS // 4,
                n_epochs=4, learning_rate=lambda remaining: 2.5e-4 * remaining,
                clip_range=0.1, clip_range_vf=0.1, ent_coef=0.01, vf_coef=0.5, gamma=0.99,
                gae_lambda=0.95, max_grad_norm=0.5, seed=seed, device="cpu", verbose=0)
    if channels_last:  # the layout ours trains in on CPU, for a like-for-like comparison
        model.policy.to(memory_format=torch.channels_last)
        extractor = model.policy.features_extractor
        forward = extractor.forward
        extractor.forward = lambda obs: forward(obs.contiguous(memory_format=torch.channels_last))
    split = {"rollout": 0.0, "learn": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                split[name] += time.perf_counter() - start
        return wrapper

    model.collect_rollouts = timed("rollout", model.collect_rollouts)
    model.train = timed("learn", model.train)
    start = time.perf_counter()
    model.learn(total_timesteps=steps)
    loop = time.perf_counter() - start
    env.close()
    return {"sps": model.num_timesteps / loop, "wall": loop, "split": split,
            "threads": torch.get_num_threads()}


# -- driver ----------------------------------------------------------------------------------


def run_worker(side: str, args: argparse.Namespace, threads: int, seed: int) -> dict:
    python = sys.executable if side == "ours" else str(args.sb3_python)
    command = [python, __file__, "--worker", side, "--steps", str(args.steps),
               "--threads", str(threads), "--seed", str(seed),
               "--sb3-env", args.sb3_env, "--ours-mode", args.ours_mode]
    if args.sb3_channels_last:
        command.append("--sb3-channels-last")
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{side} worker failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def split_text(side: str, split: dict) -> str:
    total = sum(split.values())
    parts = ", ".join(f"{k} {v:5.1f}s ({100 * v / total:3.0f}%)" for k, v in split.items()
                      if v or k != "evaluation")  # these runs play no evaluation games
    return f"{side:<5} {parts}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16384, help="env steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="torch thread counts to try on each side")
    parser.add_argument("--sides", nargs="+", default=["ours", "sb3"], choices=["ours", "sb3"])
    parser.add_argument("--sb3-env", default="ale-vector",
                        choices=["ale-vector", "subproc", "dummy"])
    parser.add_argument("--sb3-python", type=Path, default=SB3_PYTHON)
    parser.add_argument("--sb3-channels-last", action="store_true",
                        help="train SB3's network in channels-last layout too (as ours on CPU)")
    parser.add_argument("--ours-mode", default="scratch", choices=["scratch", "warm"],
                        help="scratch: plain PPO like SB3; warm: the warm-start guards on "
                             "(critic-first warm-up, KL anchor)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["ours", "sb3"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker == "ours":
        print(json.dumps(worker_ours(args.steps, args.threads[0], args.seed, args.ours_mode)))
        return
    if args.worker == "sb3":
        print(json.dumps(worker_sb3(args.steps, args.threads[0], args.seed, args.sb3_env,
                                    args.sb3_channels_last)))
        return
    if "sb3" in args.sides and not args.sb3_python.exists():
        sys.exit(f"no SB3 virtualenv at {args.sb3_python}; see this script's docstring")

    jobs = [(side, t) for t in args.threads for side in args.sides]
    results: dict[tuple[str, int], list[dict]] = {job: [] for job in jobs}
    load = [os.getloadavg()[0]]
    print(f"PPO throughput, Pong, {NUM_ENVS} envs x {NUM_STEPS} steps, {args.steps} env steps "
          f"per run, {args.rounds} rounds, ours={args.ours_mode}, sb3 env={args.sb3_env}"
          f"{', sb3 channels-last' if args.sb3_channels_last else ''}, {os.cpu_count()} CPUs")
    for r in range(args.rounds):
        for side, threads in jobs if r % 2 == 0 else jobs[::-1]:
            result = run_worker(side, args, threads, args.seed + r)
            results[side, threads].append(result)
            load.append(os.getloadavg()[0])
            print(f"  round {r + 1}: {side:<4} threads {threads}: {result['sps']:7.1f} SPS "
                  f"(load {load[-1]:.2f})", flush=True)

    print(f"\nmedians over {args.rounds} rounds (1-min load average: median "
          f"{statistics.median(load):.2f}, range {min(load):.2f}-{max(load):.2f})")
    print(f"{'threads':>7} " + " ".join(f"{side + ' SPS':>10}" for side in args.sides)
          + ("   ours/SB3" if len(args.sides) == 2 else ""))
    for t in args.threads:
        sps = {side: statistics.median(r["sps"] for r in results[side, t])
               for side in args.sides}
        line = f"{t:>7} " + " ".join(f"{sps[side]:10.1f}" for side in args.sides)
        if len(args.sides) == 2:
            line += f"   {sps['ours'] / sps['sb3']:8.2f}x"
        print(line)
    print("\ntime split (medians of each part, seconds per run):")
    for t in args.threads:
        for side in args.sides:
            runs = results[side, t]
            split = {k: statistics.median(r["split"][k] for r in runs) for k in runs[0]["split"]}
            print(f"  threads {t}: {split_text(side, split)}")


if __name__ == "__main__":
    main()
