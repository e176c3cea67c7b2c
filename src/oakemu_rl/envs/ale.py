"""The Arcade Learning Environment backend: one env for play, a C++ vector env for training
(single envs in worker processes instead where a scripted player labels the rollouts from
each emulator's RAM, which the C++ vector env does not expose: `pool.PoolVectorEnv`).

Both paths preprocess the same way (frame skip with max-pool, grayscale, resize, a stack
that is zero before the episode's first frame), so a policy trained on one plays on the
other. `tests/test_envs.py` checks that they agree frame for frame.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np

from ..errors import EnvError
from .spec import EnvSpec


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The emulator prints a banner on stderr when it loads a ROM; keep the terminal clean."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def _atari_env(spec: EnvSpec, render_mode: str | None = None) -> gym.Env:
    import ale_py
    from ale_py import roms

    try:
        roms.get_rom_path(spec.game)
    except Exception:
        raise EnvError(
            f"the ROM for {spec.game!r} is missing from this ale-py install; reinstall ale-py "
            "or pick another game with `oakemu envs`"
        ) from None
    with _quiet_stderr():
        return ale_py.AtariEnv(
            game=spec.game,
            obs_type="rgb",
            frameskip=1,
            repeat_action_probability=spec.repeat_action_probability,
            full_action_space=spec.full_action_space,
            max_num_frames_per_episode=spec.max_episode_frames,
            render_mode=render_mode,
        )


@functools.lru_cache(maxsize=64)
def ale_action_meanings(game: str, full_action_space: bool = False) -> tuple[str, ...]:
    """The meanings of an Atari game's actions, in action-index order."""
    env = _atari_env(EnvSpec(game=game, full_action_space=full_action_space,
                             repeat_action_probability=0.0))
    try:
        return tuple(env.get_action_meanings())
    finally:
        env.close()


class FrameStack(gym.Wrapper):
    """Stack the last `k` single frames into a (k, H, W) uint8 observation.

    Before the episode's first frame the stack holds zeros, as the vector env does, and
    as the demo reader does when it rebuilds stacks from frames stored once.
    """

    def __init__(self, env: gym.Env, k: int) -> None:
        super().__init__(env)
        height, width = env.observation_space.shape
        self._stack = np.zeros((k, height, width), dtype=np.uint8)
        self.observation_space = gym.spaces.Box(0, 255, self._stack.shape, np.uint8)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        frame, info = self.env.reset(**kwargs)
        self._stack[:] = 0
        self._stack[-1] = frame
        return self._stack.copy(), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        frame, reward, terminated, truncated, info = self.env.step(action)
        self._stack[:-1] = self._stack[1:]
        self._stack[-1] = frame
        return self._stack.copy(), reward, terminated, truncated, info


def fire_action(spec: EnvSpec) -> int:
    """The index of FIRE in the spec's action set (`fire_reset` presses it; `action_mask`,
    which every env factory calls first, has refused a game without FIRE)."""
    return ale_action_meanings(spec.game, spec.full_action_space).index("FIRE")


class FireReset(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """`spec.fire_reset` on the single env: the first action of a game and the first after
    a lost life become FIRE. The action is replaced rather than an extra step taken, so
    the vector env (`FireResetVector`) can do exactly the same and both stay frame for
    frame alike; to the player the replaced step is one whose choice did not matter."""

    def __init__(self, env: gym.Env, fire: int) -> None:
        # The recorded argument puts FIRE's index into the env spec of a gym.make'd env, so
        # a dataset recorded from it names the serving (demos.minari_io reads it back).
        gym.utils.RecordConstructorArgs.__init__(self, fire=fire)
        gym.Wrapper.__init__(self, env)
        self._fire = fire
        self._serve = True
        self._lives = 0

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self._serve, self._lives = True, int(info.get("lives", 0))
        return obs, info

    def played(self, action: int) -> int:
        """The action the next `step(action)` plays: FIRE where it serves."""
        return self._fire if self._serve else action

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._serve:
            action, self._serve = self._fire, False
        obs, reward, terminated, truncated, info = self.env.step(action)
        lives = int(info.get("lives", 0))
        self._serve = lives < self._lives and not (terminated or truncated)
        self._lives = lives
        return obs, reward, terminated, truncated, info


class FireResetVector:
    """`spec.fire_reset` on the vector env, sub-env by sub-env, as `FireReset` does it."""

    def __init__(self, env: Any, fire: int, *, same_step_reset: bool) -> None:
        self.env = env
        self._fire = fire
        self._same_step = same_step_reset
        self._serve = np.ones(env.num_envs, dtype=bool)
        self._resetting = np.zeros(env.num_envs, dtype=bool)
        self._lives = np.zeros(env.num_envs, dtype=np.int64)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self._serve[:], self._resetting[:] = True, False
        self._lives = np.asarray(info["lives"]).astype(np.int64)
        return obs, info

    def step(self, actions: np.ndarray) -> tuple[Any, ...]:
        actions = np.where(self._serve, self._fire, actions).astype(actions.dtype)
        obs, reward, terminated, truncated, info = self.env.step(actions)
        done = np.asarray(terminated) | np.asarray(truncated)
        lives = np.asarray(info["lives"]).astype(np.int64)
        serve = (lives < self._lives) & ~done
        if self._same_step:  # a finished game's next one starts with this observation
            serve |= done
        else:  # the step after a game's end only resets it; the new game's first is next
            serve |= self._resetting
            self._resetting = done
        self._serve, self._lives = serve, lives
        return obs, reward, terminated, truncated, info


def make_ale_env(spec: EnvSpec, render_mode: str | None = None) -> gym.Env:
    """A single preprocessed Atari env whose observations are (frame_stack, size, size) uint8.

    `env.unwrapped` is the emulator (`.ale.getRAM()`, `.render()` for RGB frames).
    """
    env: gym.Env = _atari_env(spec, render_mode)
    env = gym.wrappers.AtariPreprocessing(
        env,
        noop_max=spec.noop_max,
        frame_skip=spec.frame_skip,
        screen_size=spec.screen_size,
        terminal_on_life_loss=spec.episodic_life,
        grayscale_obs=True,
        scale_obs=False,
    )
    if spec.reward_clipping:
        env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))
    env = FrameStack(env, spec.frame_stack)
    return FireReset(env, fire_action(spec)) if spec.fire_reset else env


def make_ale_vector_env(
    spec: EnvSpec, num_envs: int, *, num_threads: int = 0, same_step_reset: bool = False
) -> Any:
    """ale-py's C++ `AtariVectorEnv` for `spec`; observations are (n, stack, size, size) uint8.

    By default a finished sub-env resets on the following `step` call (gymnasium's
    next-step mode). With `same_step_reset` it resets at once: the step that ends an
    episode returns the next episode's first observation and the last one in
    `info["final_obs"]`, which training needs to bootstrap truncated episodes.
    """
    from ale_py.vector_env import AtariVectorEnv

    fire = fire_action(spec) if spec.fire_reset else None
    with _quiet_stderr():
        env = AtariVectorEnv(
            game=spec.game,
            num_envs=num_envs,
            num_threads=num_threads,
            max_num_frames_per_episode=spec.max_episode_frames,
            repeat_action_probability=spec.repeat_action_probability,
            full_action_space=spec.full_action_space,
            img_height=spec.screen_size,
            img_width=spec.screen_size,
            grayscale=True,
            stack_num=spec.frame_stack,
            frameskip=spec.frame_skip,
            maxpool=True,
            noop_max=spec.noop_max,
            episodic_life=spec.episodic_life,
            reward_clipping=spec.reward_clipping,
            use_fire_reset=False,
            autoreset_mode="SameStep" if same_step_reset else "NextStep",
        )
    if fire is None:
        return env
    return FireResetVector(env, fire, same_step_reset=same_step_reset)
