"""The keyboard recorder: a person plays in a pygame window while `record` stores the session.

`KeyboardAgent` is an ordinary agent (see `oakemu_rl.agents.base`): `record` calls `reset` at
each episode start and `act` once per step. Each `act` draws the emulator's screen,
waits so that the game runs at the chosen speed, reads the keyboard and returns the action
whose meaning matches the held keys.

Keys are turned into actions **by meaning**, not by index: the arrows give a joystick
direction, SPACE adds FIRE, so UP + RIGHT + SPACE asks for UPRIGHTFIRE. When the game's
action set lacks that meaning, or the spec's action mask forbids it, the agent takes the
allowed action that keeps the most of what was asked without adding anything (dropping
FIRE before a direction when one part must go), and in the end NOOP. Only when NOOP itself
is forbidden does it take the nearest allowed action that adds something.

A few games read the joystick on another axis than the screen suggests; `GAME_KEY_ALIASES`
maps the arrows for them (in Pong the paddle moves up on RIGHT and down on LEFT).

Tests drive the agent without a person: run under `SDL_VIDEODRIVER=dummy` and hand
`event_script={tick: [pygame events]}` to the constructor. The agent posts those events
to pygame's queue just before it reads the queue for the given tick. A tick is one read
of the queue: one per `act` call, plus one per refresh while paused. Without a pause the
tick number is the step number of the session (counted over all episodes from 0), so
`{10: [KEYDOWN UP], 50: [KEYUP UP]}` holds UP for steps 10 to 49. Held keys are tracked
from KEYDOWN/KEYUP events (not `pygame.key.get_pressed()`), so posted events count exactly
as typed ones.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from itertools import product
from typing import Any

import numpy as np

from ..envs import action_mask, action_meanings
from ..envs.spec import EnvSpec
from ..errors import ConfigError, OakEmuError
from .base import DiscardEpisode, StopRecording

GAME_KEY_ALIASES: dict[str, dict[str, str | None]] = {
    # Pong's paddle moves vertically but the game reads the controller's RIGHT as "up"
    # and LEFT as "down"; the side arrows would be confusing there, so they do nothing.
    "pong": {"UP": "RIGHT", "DOWN": "LEFT", "LEFT": None, "RIGHT": None},
}
"""Per-game arrow remapping: arrow direction -> joystick direction (None: the arrow is unused)."""

GAME_KEY_NOTES: dict[str, str] = {
    "pong": "the UP/DOWN arrows move your (right, green) paddle; Pong reads the controller's "
            "RIGHT as up and LEFT as down, so that is what they record; the side arrows do "
            "nothing",
}
"""Why a game's arrows are remapped, for the key map text."""

SPEEDS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
"""Speed multipliers of the base fps that + and - step through."""

PAUSE_REFRESH_HZ = 30.0
"""How often the window is redrawn and the keyboard read while paused."""

SCREEN_HEIGHT, SCREEN_WIDTH = 210, 160
GAMEBOY_HEIGHT, GAMEBOY_WIDTH = 144, 160
GAMEBOY_KEYS = (("UP", "up arrow"), ("DOWN", "down arrow"), ("LEFT", "left arrow"),
                ("RIGHT", "right arrow"), ("A", "X"), ("B", "Z"), ("START", "ENTER"),
                ("SELECT", "right SHIFT"))
"""Game Boy button -> the key that presses it (the usual emulator layout: X is A, Z is B)."""

_DIRECTIONS = ("UP", "DOWN", "LEFT", "RIGHT")
_MEANING = re.compile(r"^(UP|DOWN)?(LEFT|RIGHT)?(FIRE)?$")
_NO_DISPLAY = (
    "no display found: the keyboard recorder needs a window; set DISPLAY (or run under "
    "xvfb-run), or record with --demonstrator scripted"
)


def _pygame() -> Any:
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    try:
        import pygame
    except ImportError:  # pragma: no cover - pygame is a dependency
        raise OakEmuError(
            "pygame is not installed: the keyboard recorder needs it; pip install pygame"
        ) from None
    return pygame


# -- keys -> actions ------------------------------------------------------------------


def _components(meaning: str) -> frozenset[str] | None:
    """The joystick parts of an ALE action meaning: UPLEFTFIRE -> {UP, LEFT, FIRE}."""
    if meaning == "NOOP":
        return frozenset()
    match = _MEANING.match(meaning)
    if match is None or not meaning:
        return None
    return frozenset(part for part in match.groups() if part)


def _meaning_of(parts: frozenset[str]) -> str:
    text = "".join(p for p in ("UP", "DOWN", "LEFT", "RIGHT", "FIRE") if p in parts)
    return text or "NOOP"


def _wanted(game: str, arrows: frozenset[str], fire: bool) -> frozenset[str]:
    """Joystick parts asked for by the held arrows (after the game's aliases) and SPACE."""
    aliases = GAME_KEY_ALIASES.get(game, {})
    parts: set[str] = set()
    for arrow in arrows:
        direction = aliases.get(arrow, arrow)
        if direction is not None:
            parts.add(direction)
    for a, b in (("UP", "DOWN"), ("LEFT", "RIGHT")):
        if a in parts and b in parts:  # opposite directions cancel
            parts -= {a, b}
    if fire:
        parts.add("FIRE")
    return frozenset(parts)


def _best_action(wanted: frozenset[str], meanings: Sequence[str], mask: np.ndarray) -> int:
    """The allowed action closest to `wanted`: first those that add nothing unasked, most
    parts kept; then (only when even NOOP is forbidden) fewest parts added; on a tie a kept
    direction beats a kept FIRE, then the lowest index wins."""
    best: tuple[Any, ...] | None = None
    choice = 0
    for index, meaning in enumerate(meanings):
        if not mask[index]:
            continue
        parts = _components(meaning)
        if parts is None:
            continue
        extra = len(parts - wanted)
        kept = parts & wanted
        key = (extra == 0, len(kept), -extra, len(kept - {"FIRE"}), -index)
        if best is None or key > best:
            best, choice = key, index
    if best is None:  # only meanings the parser does not know are allowed
        choice = int(np.flatnonzero(mask)[0])
    return choice


def gameboy_action(held: frozenset[str], spec: EnvSpec) -> int:
    """The allowed Game Boy action for the held buttons: the one pressing most of them and
    nothing else (opposite directions cancel), NOOP when none fits."""
    for a, b in (("UP", "DOWN"), ("LEFT", "RIGHT")):
        if a in held and b in held:
            held = held - {a, b}
    mask = action_mask(spec)
    best, choice = (-1, 0), int(np.flatnonzero(mask)[0])
    for index, buttons in enumerate(spec.gameboy_config.actions):
        if mask[index] and set(buttons) <= held and (len(buttons), -index) > best:
            best, choice = (len(buttons), -index), index
    return choice


def _gameboy_table(spec: EnvSpec) -> dict[frozenset[str], int]:
    """Every set of held Game Boy buttons -> action index for the spec (as `_key_table` is
    for Atari: worked out once, looked up every step)."""
    from ..envs.gameconfig import BUTTONS

    held_sets = (frozenset(b for b, on in zip(BUTTONS, held, strict=True) if on)
                 for held in product((False, True), repeat=len(BUTTONS)))
    return {held: gameboy_action(held, spec) for held in held_sets}


def _gameboy_key_map(spec: EnvSpec) -> str:
    meanings = action_meanings(spec)
    lines = textwrap.wrap(f"Game Boy controls for {spec.game} (actions: {', '.join(meanings)})",
                          width=90, subsequent_indent="    ")
    for button, key in GAMEBOY_KEYS:
        action = meanings[gameboy_action(frozenset({button}), spec)]
        used = "" if action != "NOOP" or button == "NOOP" else "  (not an action of this game)"
        lines.append(f"  {key:<15} -> {button}{used}")
    lines.append("  keys held together press the game's button combination, when it has one")
    return "\n".join(lines)


def _key_table(spec: EnvSpec) -> dict[tuple[frozenset[str], bool], int]:
    """Every combination of held arrows and SPACE -> action index for the spec."""
    meanings = action_meanings(spec)
    mask = action_mask(spec)
    table = {}
    for held in product((False, True), repeat=len(_DIRECTIONS) + 1):
        arrows = frozenset(d for d, on in zip(_DIRECTIONS, held[:-1], strict=True) if on)
        fire = held[-1]
        table[(arrows, fire)] = _best_action(_wanted(spec.game, arrows, fire), meanings, mask)
    return table


def key_map_text(spec: EnvSpec) -> str:
    """A human-readable key map and the session controls for `spec`'s game."""
    if spec.backend == "pyboy":
        return _gameboy_key_map(spec) + "\n" + _SESSION_KEYS
    meanings = action_meanings(spec)
    mask = action_mask(spec)
    table = _key_table(spec)

    def name(index: int) -> str:
        return meanings[index]

    lines = textwrap.wrap(f"Keyboard controls for {spec.game} (actions: {', '.join(meanings)})",
                          width=90, subsequent_indent="    ")
    if spec.forbidden_actions:
        lines.append(f"  forbidden: {', '.join(spec.forbidden_actions)} "
                     "(keys that ask for them give the nearest allowed action)")
    note = GAME_KEY_NOTES.get(spec.game)
    if note:
        lines.extend(textwrap.wrap(f"{spec.game}: {note}", width=88, initial_indent="  ",
                                   subsequent_indent="    "))
    lines.append(f"  nothing held    -> {name(table[(frozenset(), False)])}")
    singles = [((frozenset({d}), False), f"{d.lower()} arrow") for d in _DIRECTIONS]
    singles.append(((frozenset(), True), "space"))
    for key, label in singles:
        lines.append(f"  {label:<15} -> {name(table[key])}")
    combos = []
    for (arrows, fire), action in table.items():
        count = len(arrows) + fire
        if count < 2 or {"UP", "DOWN"} <= arrows or {"LEFT", "RIGHT"} <= arrows:
            continue
        # List a combination only when it gives something none of its parts gives alone.
        parts_give = {table[(arrows - {a}, fire)] for a in arrows}
        if fire:
            parts_give.add(table[(arrows, False)])
        if action in parts_give:
            continue
        label = "+".join([a.lower() for a in _DIRECTIONS if a in arrows] +
                         (["space"] if fire else []))
        combos.append(f"{label}={name(action)}")
    if combos:
        combos.sort(key=lambda c: (c.count("+"), c))
        lines.extend(textwrap.wrap("combinations: " + ", ".join(combos), width=88,
                                   initial_indent="  ", subsequent_indent="    "))
    lines.append("  opposite arrows held together cancel out")
    reachable = set(table.values())
    unreachable = [m for i, m in enumerate(meanings) if mask[i] and i not in reachable]
    if unreachable:
        lines.append(f"  not reachable from the keyboard: {', '.join(unreachable)}")
    lines.append(_SESSION_KEYS)
    return "\n".join(lines)


_SESSION_KEYS = ("  P pause/resume | BACKSPACE discard this episode (it restarts) | "
                 "+/- faster/slower\n"
                 "  ESC or closing the window: stop (every finished episode is kept)")


# -- display --------------------------------------------------------------------------


def _display_env_problem() -> str | None:
    """Why no window can open, judged from the environment alone (None: try it)."""
    if os.environ.get("SDL_VIDEODRIVER"):
        return None  # the user chose a driver (x11, wayland, kmsdrm, dummy, ...); try it
    if sys.platform.startswith(("win", "darwin", "cygwin")):
        return None
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return None
    return _NO_DISPLAY


def _open_failure(error: Exception) -> OakEmuError:
    driver = os.environ.get("SDL_VIDEODRIVER")
    where = f" with SDL_VIDEODRIVER={driver}" if driver else ""
    return OakEmuError(
        f"pygame cannot open a window{where} ({error}): the keyboard recorder needs a "
        "display; set DISPLAY, or record with --demonstrator scripted"
    )


def check_display() -> None:
    """Raise `OakEmuError` (one sentence) unless a pygame window can be opened here."""
    problem = _display_env_problem()
    if problem is not None:
        raise OakEmuError(problem)
    pygame = _pygame()
    was_open = pygame.display.get_init()
    try:
        pygame.display.init()
        if not was_open:
            pygame.display.set_mode((1, 1), pygame.HIDDEN)
    except pygame.error as error:
        raise _open_failure(error) from None
    finally:
        if not was_open:
            pygame.display.quit()


# -- the agent ------------------------------------------------------------------------


class KeyboardAgent:
    """A person at the keyboard, playing `spec`'s game in a pygame window.

    `fps` is agent steps per second (default: the game's real speed, 60 frames a second
    over the spec's frames per step); `scale` enlarges the screen (Atari 160x210, Game Boy
    160x144). `event_script` maps a tick to pygame events to post (see the module
    docstring); it is for tests. Use as a context manager or call `close()`.
    """

    kind = "human"

    def __init__(
        self,
        spec: EnvSpec,
        *,
        fps: float | None = None,
        scale: int = 3,
        event_script: Mapping[int, Sequence[Any]] | None = None,
    ) -> None:
        fps = 60.0 / spec.frame_skip if fps is None else fps
        if not fps > 0:
            raise ConfigError(f"the keyboard recorder's fps must be positive, got {fps}")
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
            raise ConfigError(f"the window scale must be a positive integer, got {scale!r}")
        self.spec = spec
        self.base_fps = float(fps)
        self.scale = scale
        self.event_script = {int(k): list(v) for k, v in (event_script or {}).items()}
        self.meanings = action_meanings(spec)
        self.gameboy = spec.backend == "pyboy"
        self._table = {} if self.gameboy else _key_table(spec)
        self._buttons = _gameboy_table(spec) if self.gameboy else {}
        self.height, self.width = (GAMEBOY_HEIGHT, GAMEBOY_WIDTH) if self.gameboy else \
            (SCREEN_HEIGHT, SCREEN_WIDTH)
        self.speed_index = SPEEDS.index(1.0)
        self.episode = 0
        """Episodes started (each reset, including restarts after a discard)."""
        self.discarded = 0
        self.score = 0.0
        self.steps = 0
        """`act` calls that returned an action, over the whole session."""
        self.tick = 0
        """Reads of the event queue so far: the next tick `event_script` is consulted for."""
        self.paused = False
        self.held: set[int] = set()
        self._pygame: Any = None
        self._screen: Any = None
        self._font: Any = None
        self._small_font: Any = None
        self._caption = ""
        self._last_step_time: float | None = None
        self._frame: Any = None

    # -- public ----------------------------------------------------------------------

    @property
    def fps(self) -> float:
        """Agent steps per second at the current speed."""
        return self.base_fps * SPEEDS[self.speed_index]

    def reset(self, env: Any, seed: int) -> None:
        self._open()
        self.episode += 1
        self.score = 0.0
        self._last_step_time = None

    def observe(self, reward: float, terminated: bool, truncated: bool, info: Any) -> None:
        self.score += reward

    def act(self, env: Any, observation: np.ndarray) -> int:
        self._open()
        self._frame = self._grab(env)
        self._draw()
        self._wait()
        self._pump()
        while self.paused:
            self._draw()
            time.sleep(1.0 / PAUSE_REFRESH_HZ)
            self._pump()
        self.steps += 1
        return self.current_action()

    def current_action(self) -> int:
        """The action for the keys held now."""
        pg = self._pygame_module()
        if self.gameboy:
            keys = {"UP": pg.K_UP, "DOWN": pg.K_DOWN, "LEFT": pg.K_LEFT, "RIGHT": pg.K_RIGHT,
                    "A": pg.K_x, "B": pg.K_z, "START": pg.K_RETURN, "SELECT": pg.K_RSHIFT}
            return self._buttons[frozenset(b for b, key in keys.items() if key in self.held)]
        arrows = frozenset(
            d for d, key in zip(_DIRECTIONS, (pg.K_UP, pg.K_DOWN, pg.K_LEFT, pg.K_RIGHT),
                                strict=True)
            if key in self.held
        )
        return self._table[(arrows, pg.K_SPACE in self.held)]

    def screenshot(self, path: str | os.PathLike[str]) -> None:
        """Save what the window shows now as an image (PNG by the file name)."""
        if self._screen is None:
            raise OakEmuError("the keyboard recorder's window is not open yet")
        self._pygame.image.save(self._screen, os.fspath(path))

    def close(self) -> None:
        """Close the window (safe to call more than once)."""
        if self._pygame is not None:
            if self._font is not None:
                self._pygame.font.quit()
            self._pygame.display.quit()
        self._pygame = self._screen = self._font = self._small_font = None
        self._caption = ""

    def __enter__(self) -> KeyboardAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- window ----------------------------------------------------------------------

    def _pygame_module(self) -> Any:
        return self._pygame if self._pygame is not None else _pygame()

    def _open(self) -> None:
        if self._screen is not None:
            return
        problem = _display_env_problem()
        if problem is not None:
            raise OakEmuError(problem)
        pg = _pygame()
        try:
            pg.display.init()
            self._font, self._small_font = self._fonts(pg)
            width = self.width * self.scale
            height = self.height * self.scale + self._bar_height()
            self._screen = pg.display.set_mode((width, height))
        except pg.error as error:
            pg.display.quit()
            raise _open_failure(error) from None
        self._pygame = pg
        self.held.clear()

    def _fonts(self, pg: Any) -> tuple[Any, Any]:
        """Overlay fonts, or (None, None) where pygame.font is missing (text goes to the
        window title only)."""
        try:
            import pygame.font

            pygame.font.init()
            return (pygame.font.Font(None, max(24, 14 * self.scale)),
                    pygame.font.Font(None, max(16, 6 * self.scale + 2)))
        except Exception:  # NotImplementedError, ImportError, pygame.error: no fonts
            return None, None

    def _bar_height(self) -> int:
        lines = 3 if self.gameboy else 2
        return 0 if self._small_font is None else lines * self._small_font.get_linesize() + 6

    def _status(self) -> str:
        speed = SPEEDS[self.speed_index]
        text = (f"{self.spec.game} | episode {self.episode} | score {self.score:+g} | "
                f"speed {speed:g}x ({self.fps:g} steps/s)")
        if self.discarded:
            text += f" | {self.discarded} discarded"
        return text

    def _grab(self, env: Any) -> Any:
        frame = None
        unwrapped = getattr(env, "unwrapped", env)
        try:
            frame = unwrapped.render()
        except Exception:
            frame = None
        if frame is None:
            frame = unwrapped.ale.getScreenRGB()
        frame = np.ascontiguousarray(frame, dtype=np.uint8)
        height, width = frame.shape[:2]
        image = self._pygame.image.frombuffer(frame.tobytes(), (width, height), "RGB")
        return self._pygame.transform.scale(
            image, (self.width * self.scale, self.height * self.scale)
        )

    def _draw(self) -> None:
        pg, screen = self._pygame, self._screen
        caption = "OakEmu recorder | " + self._status() + (" | PAUSED" if self.paused else "")
        if caption != self._caption:
            pg.display.set_caption(caption)
            self._caption = caption
        screen.fill((0, 0, 0))
        if self._frame is not None:
            screen.blit(self._frame, (0, 0))
        game_height = self.height * self.scale
        if self.paused:
            shade = pg.Surface((self.width * self.scale, game_height), pg.SRCALPHA)
            shade.fill((0, 0, 0, 150))
            screen.blit(shade, (0, 0))
            if self._font is not None:
                label = self._font.render("PAUSED", True, (255, 255, 255))
                hint = self._small_font.render("P resume | ESC stop", True, (200, 200, 200))
                middle = screen.get_width() // 2
                screen.blit(label, label.get_rect(center=(middle, game_height // 2)))
                screen.blit(hint, hint.get_rect(
                    center=(middle, game_height // 2 + label.get_height())))
        if self._small_font is not None:
            line = self._small_font.get_linesize()
            status = self._status()
            rows = [(status, (255, 255, 255)),
                    ("P pause | BACKSPACE discard | ESC stop | +/- speed", (170, 170, 170))]
            if self.gameboy:
                rows.append(("arrows D-pad | X=A Z=B | ENTER=START RSHIFT=SELECT",
                             (170, 170, 170)))
            for row, (text, colour) in enumerate(rows):
                surface = self._small_font.render(text, True, colour)
                screen.blit(surface, (4, game_height + 3 + row * line))
        pg.display.flip()

    # -- timing and events -----------------------------------------------------------

    def _wait(self) -> None:
        """Sleep until one step period has passed since the last step (no catching up)."""
        now = time.perf_counter()
        if self._last_step_time is not None:
            target = self._last_step_time + 1.0 / self.fps
            if now < target:
                time.sleep(target - now)
                self._last_step_time = target
                return
        self._last_step_time = now

    def _pump(self) -> None:
        """Post this tick's scripted events, then read the queue; raise on stop/discard."""
        pg = self._pygame
        for event in self.event_script.pop(self.tick, ()):
            pg.event.post(event)
        self.tick += 1
        stop = discard = False
        for event in pg.event.get():
            if event.type == pg.QUIT or event.type == getattr(pg, "WINDOWCLOSE", -1):
                stop = True
            elif event.type == getattr(pg, "WINDOWFOCUSLOST", -1):
                self.held.clear()  # the key-up events go to another window
            elif event.type == pg.KEYUP:
                self.held.discard(event.key)
            elif event.type == pg.KEYDOWN:
                key = event.key
                self.held.add(key)
                if key == pg.K_ESCAPE:
                    stop = True
                elif key == pg.K_BACKSPACE:
                    discard = True
                elif key == pg.K_p:
                    self.paused = not self.paused
                    self._last_step_time = None
                elif key in (pg.K_PLUS, pg.K_EQUALS, pg.K_KP_PLUS) or (
                    getattr(event, "unicode", "") == "+"
                ):
                    self.speed_index = min(self.speed_index + 1, len(SPEEDS) - 1)
                elif key in (pg.K_MINUS, pg.K_KP_MINUS, pg.K_UNDERSCORE):
                    self.speed_index = max(self.speed_index - 1, 0)
        if stop:
            self.paused = False
            raise StopRecording
        if discard:
            self.paused = False
            self.discarded += 1
            raise DiscardEpisode
