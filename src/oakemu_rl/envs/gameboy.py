"""The Game Boy backend: PyBoy, headless and silent, behind the same env interface as Atari.

One `GameBoyEnv` is one emulator. An agent step presses the action's buttons, holds them
for the game config's `press_frames`, releases them and runs to `frames_per_action`; only
the last frame is rendered. Observations are grayscale, cropped, resized to
`screen_size` × `screen_size` and stacked like Atari's (zeros before the first frame).
Rewards and episode ends are read from RAM as the game config says.

PyBoy is single-threaded, so training steps several emulators in worker processes
(`pool.PoolVectorEnv`); `benchmarks/gameboy_speed.py` measures what that costs against one
bare emulator.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from ..errors import EnvError
from . import roms
from .gameconfig import BUTTONS, GameConfig, RewardTracker
from .spec import EnvSpec

_START_CACHE: dict[tuple[str, str], bytes] = {}  # (rom sha256, config) -> start state


def _pyboy(rom: bytes) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the SDL2 binaries announce themselves on import
        from pyboy import PyBoy

    emulator = PyBoy(io.BytesIO(rom), window="null", sound_emulated=False, log_level="ERROR")
    emulator.set_emulation_speed(0)
    return emulator


def _load_state(emulator: Any, data: bytes, spec: EnvSpec) -> None:
    owner, body = roms.split_state(data, f"the start state of {spec.game}")
    if owner is not None and owner != spec.rom_sha256:
        raise roms.RomError(
            f"the start state of {spec.game} was saved on another ROM (sha256 {owner[:12]}…, "
            f"this one is {spec.rom_sha256[:12]}…); make it again on this ROM")
    stream = io.BytesIO(body)
    try:
        emulator.load_state(stream)
    except Exception as error:  # the emulator raises several kinds
        raise roms.RomError(f"the start state of {spec.game} cannot be loaded: {error}") \
            from None
    if stream.read(1):
        raise roms.RomError(f"the start state of {spec.game} is not a save state of this "
                            "emulator and ROM (bytes are left over after loading it)")
    # A state saved between steps still holds the last step's buttons: PyBoy applies their
    # release on the next tick, and that pending release is not part of the state. Queue
    # it again, so a loaded game goes on as the saved one did instead of holding them.
    for button in BUTTONS:
        emulator.button_release(button.lower())


class GameBoyEnv(gym.Env):
    """A preprocessed Game Boy game; observations (frame_stack, size, size) uint8.

    `memory(address)` reads one byte of RAM (scripted players use it); `render()` returns
    the screen as (144, 160, 3) RGB.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 60}

    def __init__(self, spec: EnvSpec, render_mode: str | None = None) -> None:
        if spec.backend != "pyboy":
            raise EnvError(f"{spec.game} is not a Game Boy game")
        self.spec_ = spec
        self.config: GameConfig = spec.gameboy_config
        self.render_mode = render_mode
        self.emulator = _pyboy(roms.rom_for(spec.rom_sha256, spec.game))
        self._buttons = [[b.lower() for b in action] for action in self.config.actions]
        self.action_space = gym.spaces.Discrete(len(self.config.actions))
        self.observation_space = gym.spaces.Box(0, 255, spec.observation_shape, np.uint8)
        self._stack = np.zeros(spec.observation_shape, dtype=np.uint8)
        self._tracker = RewardTracker(self.config.rewards, self.memory)
        self._last_action = 0
        self._steps = 0
        self._frames = 0

    # -- emulator ----------------------------------------------------------------------

    def memory(self, address: int) -> int:
        return int(self.emulator.memory[address])

    def _press(self, action: int, hold: int, total: int) -> None:
        buttons = self._buttons[action]
        for button in buttons:
            self.emulator.button_press(button)
        if hold < total:
            self.emulator.tick(hold, False)
            for button in buttons:
                self.emulator.button_release(button)
            self.emulator.tick(total - hold, True)
        else:
            self.emulator.tick(total, True)
            for button in buttons:
                self.emulator.button_release(button)
        self._frames += total

    def _start_state(self) -> bytes:
        key = (self.spec_.rom_sha256, self.spec_.game_config)
        if key not in _START_CACHE:
            config = self.config
            if config.start_mode == "state":
                _load_state(self.emulator, roms.state_for(config.state_sha256, self.spec_.game),
                            self.spec_)
            else:
                self.emulator.tick(max(config.boot_frames, 1), True)
                for button, wait in config.start_buttons:
                    self.emulator.button_press(button.lower())
                    self.emulator.tick(config.press_frames, False)
                    self.emulator.button_release(button.lower())
                    self.emulator.tick(max(wait, 1), True)
            out = io.BytesIO()
            self.emulator.save_state(out)
            _START_CACHE[key] = out.getvalue()
        return _START_CACHE[key]

    def _frame(self) -> np.ndarray:
        import cv2

        screen = self.emulator.screen.ndarray
        gray = cv2.cvtColor(screen, cv2.COLOR_RGBA2GRAY)
        top, bottom, left, right = self.config.crop
        gray = gray[top:gray.shape[0] - bottom, left:gray.shape[1] - right]
        size = self.spec_.screen_size
        return cv2.resize(gray, (size, size), interpolation=cv2.INTER_AREA)

    def _push(self) -> np.ndarray:
        self._stack[:-1] = self._stack[1:]
        self._stack[-1] = self._frame()
        return self._stack.copy()

    def _lives(self) -> int:
        lives = self.config.lives
        return lives.values(self.memory)[0] if lives is not None else 0

    # -- gymnasium ---------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        _load_state(self.emulator, self._start_state(), self.spec_)
        noops = int(self.np_random.integers(0, self.spec_.noop_max + 1))
        for _ in range(noops):
            self._press(0, self.config.press_frames, self.config.frames_per_action)
        self.emulator.tick(1, True)  # a rendered frame whatever the state held
        self._frames = 0
        self._steps = 0
        self._last_action = 0
        self._tracker.reset()
        self._stack[:] = 0
        self._stack[-1] = self._frame()
        return self._stack.copy(), {"lives": self._lives()}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        action = int(action)
        if not 0 <= action < self.action_space.n:
            raise EnvError(f"action {action} is out of range for {self.spec_.game} "
                           f"(0..{self.action_space.n - 1})")
        if self.np_random.random() < self.spec_.repeat_action_probability:
            action = self._last_action  # sticky: the previous action goes on for this step
        self._last_action = action
        self._press(action, self.config.press_frames, self.config.frames_per_action)
        self._steps += 1
        reward, _parts = self._tracker.step()
        terminated = any(end.holds(self.memory) for end in self.config.ends)
        truncated = not terminated and (self._steps >= self.config.max_steps
                                        or self._frames >= self.spec_.max_episode_frames)
        lives = self._lives()
        if self.spec_.reward_clipping:
            reward = float(np.sign(reward))
        return self._push(), float(reward), terminated, truncated, {"lives": lives}

    def render(self) -> np.ndarray:
        return np.ascontiguousarray(self.emulator.screen.ndarray[:, :, :3])

    def close(self) -> None:
        emulator = getattr(self, "emulator", None)
        if emulator is not None:
            emulator.stop(save=False)
            self.emulator = None
