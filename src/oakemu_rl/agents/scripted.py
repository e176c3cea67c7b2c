"""Scripted demonstrators for Pong and Breakout that read the emulator's RAM (CATCH, the
Game Boy game, has its own in `scripted_catch`).

They play well enough to seed behaviour cloning and, with `noise`, show recoveries from
mistakes. Each step they read the ball and the paddle from RAM, predict the frame at which
the ball will reach the paddle and where it will be then, and pick the action that starts
the best short plan for the paddle.

Both games read their paddle as an analog knob: one agent step of a held direction turns
the knob by about 22 RAM units and the displayed paddle follows with a lag, one emulator
frame at a time. `_PaddleResponse` holds that step response (its mean and spread, frame by
frame, measured in the emulator with and without sticky actions); the planner adds up the
responses of the last few actions and of every 4-step plan of {back, still, forward} and
so knows, for each plan, where the paddle will be at the contact frame and how unsure that
is (sticky actions make each press a few frames longer or shorter). A lone press moves the
paddle 22 units but its first frames move it only 2-10, so pressing *late*, timed to the
contact frame, is how the paddle lands within a few units of where it should be.

The "human" style (`PongHuman`, `BreakoutHuman`) plans with the same paddle model under
two rules a person's play follows: a key once pressed stays down for at least 3 agent
steps, and each decision uses the screen as it was 2 steps (about 130 ms) before.

Actions are chosen by meaning ("RIGHT", "LEFTFIRE", ...), never by index, so the minimal
and the full action space both work, and only actions the spec's mask allows are taken.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..envs import EnvSpec, action_mask, action_meanings
from ..errors import EnvError
from .scripted_catch import CatchDemonstrator

__all__ = [
    "SCRIPTED_GAMES",
    "SCRIPTED_STYLES",
    "BreakoutDemonstrator",
    "BreakoutHuman",
    "CatchDemonstrator",
    "PongDemonstrator",
    "PongFollower",
    "PongHuman",
    "make_demonstrator",
]

_Row = tuple[float, ...]


def _reflect(x: float, lo: float, hi: float) -> float:
    """Fold `x` into [lo, hi] the way a ball bounces between two walls."""
    span = hi - lo
    if span <= 0:
        return lo
    x = (x - lo) % (2 * span)
    return lo + (x if x <= span else 2 * span - x)


def _clamp(x: Any, lo: Any, hi: Any) -> Any:
    """`x` held within [lo, hi]: np.clip's result for one number, without its per-call
    overhead, which the human style's planning pays hundreds of times a step."""
    return min(max(x, lo), hi)


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz & Stegun 7.1.26, error < 2e-7), vectorised."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


@dataclass(frozen=True)
class _PaddleResponse:
    """How the displayed paddle (RAM units) moves after one agent step of a held direction.

    `mean[phase][i]` / `std[phase][i]` are the displacement's mean and standard deviation
    i + 1 frames after the press began at a step boundary, from rest; after the last entry
    the paddle has settled. `phase` tells apart games that move the paddle every other
    frame. Measured in the emulator with sticky actions (`sticky`) and without (`plain`);
    `for_stickiness` blends the two.
    """

    sticky_mean: tuple[_Row, ...]
    sticky_std: tuple[_Row, ...]
    plain_mean: tuple[_Row, ...]
    plain_std: tuple[_Row, ...]
    lo: float
    hi: float

    def for_stickiness(self, p: float) -> tuple[np.ndarray, np.ndarray]:
        """(mean, variance of one direction change) tables, each (phases, frames + 1) with
        a leading 0 for "no frame yet", for repeat_action_probability `p`."""
        w = _clamp(p / 0.25, 0.0, 1.0)
        mean = (1 - w) * np.array(self.plain_mean) + w * np.array(self.sticky_mean)
        std = (1 - w) * np.array(self.plain_std) + w * np.array(self.sticky_std)
        # A press changes direction twice (on and off); each change shifts the rest of
        # the motion by a frame or so, so half the settled variance belongs to each.
        var = np.minimum(std**2, std[:, -1:] ** 2 / 2)
        pad = np.zeros((mean.shape[0], 1))
        return np.hstack([pad, mean]), np.hstack([pad, var])


class _ActionSet:
    """The allowed actions of a spec, found by what they do: move (RIGHT / LEFT) and FIRE."""

    def __init__(self, spec: EnvSpec) -> None:
        self.meanings = action_meanings(spec)
        self.mask = action_mask(spec)
        self.allowed = np.flatnonzero(self.mask)

    def pick(self, horizontal: str | None, fire: bool | None) -> int | None:
        """An allowed action with that horizontal part ("RIGHT", "LEFT" or None for
        neither) and, unless `fire` is None, with or without FIRE; the shortest name
        wins (NOOP before UP, RIGHT before UPRIGHT)."""
        best: tuple[int, int] | None = None
        for index in self.allowed:
            name = self.meanings[index]
            moves = "RIGHT" if "RIGHT" in name else "LEFT" if "LEFT" in name else None
            if moves != horizontal or (fire is not None and ("FIRE" in name) != fire):
                continue
            if best is None or len(name) < best[0]:
                best = (len(name), int(index))
        return None if best is None else best[1]

    def pick_plain(self, horizontal: str | None) -> int | None:
        """Prefer the action without FIRE, take one with FIRE if that is all there is."""
        found = self.pick(horizontal, False)
        return self.pick(horizontal, None) if found is None else found

    def names(self) -> str:
        return ", ".join(self.meanings[i] for i in self.allowed)


class _RamDemonstrator:
    """Shared machinery: noise, seeding, the action set and the paddle planner."""

    kind = "scripted"
    portable = True
    """Every game reseeds it and clears its memory, so copies in other processes play
    each game as this one would (`play_games`)."""
    game = ""
    response: _PaddleResponse
    right_sign = 1
    """+1 when RIGHT makes the paddle's RAM coordinate grow, -1 when it shrinks it."""
    plan_steps = 4
    """Length of the plans the planner compares (every {-1, 0, +1} sequence)."""
    base_var = 1.0
    """Variance (RAM units²) of the paddle's position even when nothing is pressed."""
    switch_cost = 1.0
    """Cost, in RAM units of distance, of each change of direction in a far-off plan."""

    def __init__(self, spec: EnvSpec, *, seed: int = 0, noise: float = 0.0) -> None:
        if spec.game != self.game:
            raise EnvError(f"{type(self).__name__} plays {self.game}, not {spec.game}")
        if not 0.0 <= float(noise) <= 1.0:
            raise EnvError(f"the demonstrator noise must be within 0..1, got {noise!r}")
        if spec.frame_skip != 4:
            raise EnvError(
                f"the scripted {self.game} player is tuned for frame_skip 4, not "
                f"{spec.frame_skip}"
            )
        self.spec = spec
        self.seed = int(seed)
        self.noise = float(noise)
        self.actions = _ActionSet(spec)
        idle = self.actions.pick_plain(None)
        moves = {h: self.actions.pick_plain(h) for h in ("RIGHT", "LEFT")}
        missing = [h for h, a in moves.items() if a is None] + (["still"] if idle is None else [])
        if missing:
            raise EnvError(
                f"the scripted {self.game} player needs allowed actions that move the paddle "
                "each way and one that leaves it still, but the action mask leaves no "
                f"{' or '.join(missing)} action (allowed: {self.actions.names()})"
            )
        self._idle: int = idle  # type: ignore[assignment]
        self._moves: dict[str, int] = moves  # type: ignore[assignment]
        self._gain, self._switch_var = self.response.for_stickiness(
            spec.repeat_action_probability)
        self._plans = np.array(list(itertools.product((0, 1, -1), repeat=self.plan_steps)),
                               dtype=float)
        edges = np.zeros((len(self._plans), 1))
        padded = np.hstack([edges, self._plans, edges])  # still before and after
        self._plan_switches = (np.diff(padded, axis=1) != 0).sum(axis=1)
        # Among plans that end equally well far from contact, move early: it leaves time
        # to correct what sticky actions did.
        self._plan_lateness = np.abs(self._plans) @ np.arange(self.plan_steps)
        self._seed(self.seed)
        self._forget()

    # -- the Agent protocol -------------------------------------------------------------

    def reset(self, env: Any, seed: int) -> None:
        self._seed(self.seed, int(seed))
        self._forget()

    def act(self, env: Any, observation: np.ndarray) -> int:
        action = self._scripted(env.unwrapped.ale.getRAM())
        if self.noise > 0.0 and self.rng.random() < self.noise:
            action = int(self.rng.choice(self.actions.allowed))
        self._history.appendleft(self._direction_of(action))
        return action

    def was_taken(self, action: int) -> None:
        """Relabelling: another agent's `action` was played instead of the one just chosen,
        so the planner's memory of its recent moves must hold what the paddle really did."""
        self._history[0] = self._direction_of(action)

    # -- helpers for the games ----------------------------------------------------------

    def _seed(self, *entropy: int) -> None:
        """Two independent streams from the seeds: `rng` draws the noise, `script_rng`
        the script's own random choices, so changing one never shifts the other."""
        sequence = np.random.SeedSequence([e % (1 << 64) for e in entropy])
        noise, script = sequence.spawn(2)
        self.rng = np.random.default_rng(noise)
        self.script_rng = np.random.default_rng(script)

    def _forget(self) -> None:
        """Drop what was seen of the previous episode."""
        self._history: deque[int] = deque([0] * 4, maxlen=4)  # newest first
        self._ball_prev: tuple[float, float] | None = None
        self._ball_v: tuple[float, float] | None = None

    def _scripted(self, ram: np.ndarray) -> int:
        raise NotImplementedError

    def _direction_of(self, action: int) -> int:
        name = self.actions.meanings[action]
        if "RIGHT" in name:
            return self.right_sign
        if "LEFT" in name:
            return -self.right_sign
        return 0

    def _action_for(self, direction: float) -> int:
        if direction == 0:
            return self._idle
        return self._moves["RIGHT" if direction == self.right_sign else "LEFT"]

    def _ball_velocity(self, x: float, y: float, limit: float, axis: int, lo: float,
                       hi: float) -> tuple[float, float] | None:
        """The ball's velocity per step, or None right after a serve or a jump.

        Along `axis` (0: x, 1: y) the ball bounces off walls at `lo` and `hi`; a read
        straddling a bounce shows a shortened, reversed motion, so near a wall a reversal
        keeps the previous speed."""
        prev, self._ball_prev = self._ball_prev, (x, y)
        last, self._ball_v = self._ball_v, None
        if prev is None:
            return None
        v = [x - prev[0], y - prev[1]]
        if abs(v[0]) > limit or abs(v[1]) > limit:
            return None
        if last is not None and v[axis] * last[axis] < 0 and abs(v[axis]) < abs(last[axis]):
            pos = (x, y)[axis]
            if min(pos - lo, hi - pos) <= abs(last[axis]):
                v[axis] = -last[axis]
        self._ball_v = (v[0], v[1])
        return self._ball_v

    def _predict(self, d: float, phase: int, frames: int, history: deque[int] | None = None,
                 clip: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the paddle position `frames` frames from now for each plan,
        after the directions in `history` (newest first; default: the ones taken)."""
        history = self._history if history is None else history
        gain, svar = self._gain[phase], self._switch_var[phase]
        last = len(gain) - 1

        def g(x: int, table: np.ndarray = gain) -> np.ndarray:
            return table[_clamp(x, 0, last)]

        # What past presses still owe, cut short by the wall the knob stops at.
        owed = sum(u * (g(frames + 4 * j) - g(4 * j)) for j, u in enumerate(history, 1))
        owed_all = sum(u * (gain[last] - g(4 * j)) for j, u in enumerate(history, 1))
        if owed_all:
            room = _clamp(d + owed_all, self.response.lo, self.response.hi) - d
            owed *= room / owed_all
        mean = np.full(len(self._plans), float(d) + owed)
        prev = np.full(len(self._plans), float(history[0]))
        var = np.full(len(self._plans), self.base_var)
        for k in range(self.plan_steps):
            u = self._plans[:, k]
            mean += u * g(frames - 4 * k)
            var += (u - prev) ** 2 * g(frames - 4 * k, svar)
            prev = u
        var += prev**2 * g(frames - 4 * self.plan_steps, svar)  # the release after the plan
        if clip:
            mean = np.clip(mean, self.response.lo, self.response.hi)
        return mean, var

    @staticmethod
    def _zone_values(offset: np.ndarray, var: np.ndarray, edges: np.ndarray,
                     values: np.ndarray, miss: float) -> np.ndarray:
        """Expected value when `ball - paddle` ~ N(offset, var) and landing in
        [edges[i], edges[i + 1]) is worth values[i], anywhere else `miss`."""
        cdf = _norm_cdf((edges - offset[..., None]) / np.sqrt(var)[..., None])
        zone = np.diff(cdf, axis=-1)
        return zone @ values + (1.0 - zone.sum(axis=-1)) * miss

    def _steer_to_zones(self, d: float, phase: int, frames: int, ball: float,
                        edges: np.ndarray, values: np.ndarray, miss: float = -1.0) -> int:
        """Direction that starts the plan with the best expected value at contact.

        `ball - paddle` at the contact frame decides the outcome: inside
        [edges[i], edges[i + 1]) it is worth values[i], outside all edges `miss`.
        """
        mean, var = self._predict(d, phase, frames)
        value = self._zone_values(ball - mean, var, edges, values, miss)
        value -= 1e-3 * self._plan_switches  # among equals, the calmest plan
        return int(self._plans[int(np.argmax(value)), 0])

    def _steer_ahead(self, d: float, phase: int, frames: int, ball: float,
                     edges: np.ndarray, values: np.ndarray, miss: float = -1.0) -> int:
        """For a contact still far off: the direction that starts the plan whose resting
        place (a spread-out guess) leaves the best plan for when the contact is `frames`
        (at most 4 * plan_steps) frames away."""
        still: deque[int] = deque([0] * 4, maxlen=4)
        offset, var = self._predict(0.0, phase, frames, still, clip=False)
        lo, hi = self.response.lo, self.response.hi
        spots = np.arange(math.floor(lo), math.ceil(hi) + 1, dtype=float)
        paddle = np.clip(spots[:, None] + offset[None, :], lo, hi)
        worth = self._zone_values(ball - paddle, var[None, :], edges, values, miss).max(axis=1)
        rest, rest_var = self._predict(d, phase, 4 * self.plan_steps + 32)
        weight = np.exp(-0.5 * (spots[None, :] - rest[:, None]) ** 2 / rest_var[:, None])
        expected = (weight @ worth) / weight.sum(axis=1)
        expected -= 1e-3 * self._plan_switches + 1e-4 * self._plan_lateness
        return int(self._plans[int(np.argmax(expected)), 0])

    def _steer_to(self, d: float, phase: int, target: float) -> int:
        """Direction that starts the plan whose paddle settles nearest `target`."""
        mean, _ = self._predict(d, phase, 4 * self.plan_steps + 32)
        cost = (np.abs(mean - target) + self.switch_cost * self._plan_switches
                + 1e-3 * self._plan_lateness)
        return int(self._plans[int(np.argmin(cost)), 0])


class PongDemonstrator(_RamDemonstrator):
    """Pong, as the right-hand (green) paddle, from RAM.

    RAM used: 51 = own paddle y (38 top .. 203 bottom), 49 / 54 = ball x / y (y = 0 while
    no ball is in play), 50 = CPU paddle y, 8 = frame counter (the paddle moves on odd
    frames only).

    Strategy: two consecutive reads give the ball's velocity, hence the frame at which it
    reaches our paddle's column (x = 188) and its y then, folding in bounces off the walls
    at y = 45 and 206. At that frame `ball y - paddle y` decides the return: -2..0 sends
    the ball up steeply (8 per step), 1..4 up, 5..8 flat, 9..12 down, 13..16 down steeply;
    outside -2..16 the ball is missed. A steep return outruns the CPU paddle, which chases
    the ball's y at under 2 units a frame and misses a ball more than 2 units above its
    aim. So each return is valued by simulating the CPU against it (a likely winner
    scores near 1, a rally goes on at `RALLY_VALUE`, a miss costs 1), and the planner
    takes the plan with the best expected value given how unsure the paddle's position
    at contact is: it goes for a steep return when it can place the paddle precisely and
    a safe one when it cannot. While the ball is far off, the paddle heads for the spot
    from which those final plans do best; while it travels away, it waits mid-court.
    Winning points quickly matters: the emulated Pong freezes after 65,536 frames (about
    16,400 agent steps), and a game still running then never ends.
    """

    game = "pong"
    right_sign = -1  # RIGHT moves the paddle up, to smaller y.
    response = _PaddleResponse(
        sticky_mean=(
            (0, 0, 4.8, 4.8, 13.0, 13.0, 17.9, 17.9, 20.4, 20.4, 21.7, 21.7, 22.4, 22.4,
             22.5, 22.5),
            (0, 2.2, 2.2, 8.8, 8.8, 15.8, 15.8, 19.3, 19.3, 21.2, 21.2, 22.3, 22.3, 22.5,
             22.5, 22.5),
        ),
        sticky_std=(
            (0, 0, 1.8, 1.8, 2.9, 2.9, 3.8, 3.8, 4.6, 4.6, 5.1, 5.1, 5.4, 5.4, 5.6, 5.9),
            (0, 1.4, 1.4, 2.6, 2.6, 3.7, 3.7, 4.6, 4.6, 5.2, 5.2, 5.4, 5.4, 5.7, 5.8, 6.1),
        ),
        plain_mean=(
            (0, 0, 5.8, 5.8, 14.4, 14.4, 18.6, 18.6, 20.6, 20.6, 21.6, 21.6, 22.4, 22.4,
             22.4, 22.4),
            (0, 2.8, 2.8, 10.1, 10.1, 16.7, 16.7, 19.7, 19.7, 21.4, 21.4, 22.4, 22.4, 22.4,
             22.4, 22.4),
        ),
        plain_std=(
            (0, 0, 0.4, 0.4, 0.8, 0.8, 1.1, 1.1, 1.1, 1.1, 1.1, 1.1, 2.5, 2.5, 2.5, 2.6),
            (1.5, 1.6, 1.6, 1.9, 1.7, 2.0, 1.8, 1.9, 1.9, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0),
        ),
        lo=38.0,
        hi=203.0,
    )

    X_HIT = 188.0
    """Ball x at the frame it meets our paddle."""
    X_CPU = 69.0
    """Ball x at the frame it meets the CPU paddle."""
    Y_TOP, Y_BOTTOM = 45.0, 206.0
    """Ball y at which it bounces off the walls."""
    ZONE_EDGES = (-2.5, 0.5, 4.5, 8.5, 12.5, 16.5)
    """Bounds of ball y - paddle y at contact for the returns below."""
    ZONE_VY = (-8.0, -4.0, 0.0, 4.0, 8.0)
    """The ball's vertical speed per step after a return from each zone."""
    CPU_WINDOW = (-2.0, 16.0)
    """The CPU paddle returns the ball when ball y - CPU y lies in this range at contact."""
    CPU_SPEED = 1.75
    """How far the CPU paddle moves towards the ball's y per frame, on average."""
    RALLY_VALUE = 0.3
    """Value of a return the CPU gets back, between a lost (-1) and a won (+1) point."""
    REST_Y = 118.0
    """Where the paddle waits while the ball travels away."""
    SHAKE_AFTER, SHAKE = 6, 8.0
    """After this many returns without a point, wait up to ±SHAKE off the chosen spot
    (a fresh random offset per return): a rally can settle into a loop that repeats
    exactly, for example with the paddle pinned against a wall."""

    def _forget(self) -> None:
        super()._forget()
        self._returns = 0  # returns since the last point
        self._incoming = False
        self._shake = 0.0

    def _scripted(self, ram: np.ndarray) -> int:
        d = float(ram[51])
        phase = int(ram[8]) & 1
        bx, by = float(ram[49]), float(ram[54])
        in_play = by != 0 and 0 < bx < 205
        motion = (self._ball_velocity(bx, by, 16.0, 1, self.Y_TOP, self.Y_BOTTOM)
                  if in_play else None)
        if not in_play:  # a point was scored: a new rally begins
            self._ball_prev = None
            self._returns, self._incoming = 0, False
        if motion is not None and motion[0] < 0 and self._incoming:
            self._returns += 1
            self._incoming = False
        if motion is None or motion[0] <= 0 or bx > self.X_HIT:
            return self._action_for(self._steer_to(d, phase, self.REST_Y))
        if not self._incoming:
            self._incoming = True
            long_rally = self._returns >= self.SHAKE_AFTER
            self._shake = self.script_rng.uniform(-self.SHAKE, self.SHAKE) if long_rally else 0.0
        vx, vy = motion
        frames = max(round((self.X_HIT - bx) * 4 / vx), 0)
        y_hit = _reflect(by + vy * frames / 4, self.Y_TOP, self.Y_BOTTOM)
        values = np.array([self._return_value(y_hit, v, vx) for v in self.ZONE_VY])
        edges = np.array(self.ZONE_EDGES)
        if frames <= 4 * self.plan_steps:
            return self._action_for(self._steer_to_zones(d, phase, frames, y_hit, edges,
                                                         values))
        # Far off: head for where the best plan will have the most to work with.
        near = frames - 4 * math.ceil((frames - 4 * self.plan_steps) / 4)
        return self._action_for(self._steer_ahead(d, phase, near, y_hit + self._shake, edges,
                                                  values))

    def _return_value(self, y_hit: float, vy: float, vx_in: float) -> float:
        """Worth of a return leaving `y_hit` with `vy` per step: simulate the CPU chase."""
        vx = -abs(vx_in)
        frames = int((self.X_HIT - self.X_CPU) * 4 / -vx)
        cpu = y_hit  # the CPU has been chasing the incoming ball: assume it is level
        y, vyf = y_hit, vy / 4
        lo, hi = self.Y_TOP, self.Y_BOTTOM
        for _ in range(frames):
            y += vyf
            if y < lo:
                y, vyf = 2 * lo - y, -vyf
            elif y > hi:
                y, vyf = 2 * hi - y, -vyf
            cpu += max(-self.CPU_SPEED, min(self.CPU_SPEED, y - cpu))
        gap = y - cpu
        low, high = self.CPU_WINDOW
        margin = max(low - gap, gap - high)  # > 0: the CPU misses
        win = 1.0 / (1.0 + math.exp(-margin / 1.5))
        return win + (1.0 - win) * self.RALLY_VALUE


class PongFollower(PongDemonstrator):
    """Pong the way a person holding a key plays it: keep the paddle level with the ball.

    Each step it holds the direction that brings the paddle towards `ball y - OFFSET`
    (the middle of the returns, flat) and lets go within `DEADBAND`; with no ball in play
    it waits mid-court. Weaker than the planner (it loses most games), but every action
    follows from the newest frame, so behaviour cloning can copy it: the planner's late,
    sparse taps hang on timing the frames barely show, and a BC policy trained on them
    never moves (benchmarks/bc_quality.py compares the two).
    """

    OFFSET = 7.0
    """Ball y - paddle y it aims for (the middle of the -2..16 window that returns)."""
    DEADBAND = 6.0
    """No key while the paddle is this close to where it aims."""

    def _scripted(self, ram: np.ndarray) -> int:
        d = float(ram[51])
        bx, by = float(ram[49]), float(ram[54])
        in_play = by != 0 and 0 < bx < 205
        target = _clamp(by, self.Y_TOP, self.Y_BOTTOM) - self.OFFSET if in_play \
            else self.REST_Y
        error = target - d
        if abs(error) <= self.DEADBAND:
            return self._idle
        return self._action_for(1 if error > 0 else -1)


class BreakoutDemonstrator(_RamDemonstrator):
    """Breakout from RAM.

    RAM used: 72 = paddle x (55 left .. 191 right), 99 / 101 = ball x / y (y = 0 while no
    ball is in play).

    Strategy: with no ball in play, press FIRE (or any allowed action with FIRE) to
    serve. While the ball falls, two consecutive reads give its velocity, hence the frame
    at which it reaches the paddle's row (y = 177) and its x then, folding in bounces off
    the side walls at x = 56 and 200. At that frame the ball is returned when
    `ball x - paddle x` lies in 1..17; the planner takes the plan most likely to put the
    paddle there (its middle, ball x - 9, is the target). While the ball rises the paddle
    follows it.
    """

    game = "breakout"
    right_sign = 1
    response = _PaddleResponse(
        sticky_mean=((0, 2.1, 5.9, 10.5, 15.8, 19.2, 20.9, 22.0, 22.3, 22.4, 22.4, 22.4,
                      22.4, 22.4, 22.4, 22.4),),
        sticky_std=((0.7, 1.6, 2.8, 3.4, 3.9, 4.4, 5.0, 5.5, 5.8, 6.0, 6.1, 6.1, 6.1, 6.1,
                     6.1, 6.1),),
        plain_mean=((0, 2.8, 7.2, 12.0, 17.6, 20.5, 21.4, 22.4, 22.4, 22.4, 22.4, 22.4,
                     22.4, 22.4, 22.4, 22.4),),
        plain_std=((1.0, 1.0, 1.4, 1.4, 1.6, 1.7, 2.4, 2.5, 2.6, 2.6, 2.7, 2.7, 2.7, 2.7,
                    2.7, 2.7),),
        lo=55.0,
        hi=191.0,
    )

    Y_HIT = 177.0
    """Ball y at the frame it meets the paddle."""
    X_LEFT, X_RIGHT = 56.0, 200.0
    """Ball x at which it bounces off the side walls."""
    HIT_ZONE = (0.5, 17.5)
    """Ball x - paddle x at contact for which the ball is returned."""
    CENTRE = 9.0
    """Ball x - paddle x with the ball over the paddle's middle."""

    def __init__(self, spec: EnvSpec, *, seed: int = 0, noise: float = 0.0) -> None:
        super().__init__(spec, seed=seed, noise=noise)
        fire = self.actions.pick(None, True)
        if fire is None:
            fire = self.actions.pick("RIGHT", True) or self.actions.pick("LEFT", True)
        if fire is None:
            raise EnvError(
                "the scripted breakout player needs an allowed action with FIRE to serve "
                f"the ball, but the action mask forbids them all (allowed: "
                f"{self.actions.names()})"
            )
        self._fire = fire

    def _scripted(self, ram: np.ndarray) -> int:
        d = float(ram[72])
        bx, by = float(ram[99]), float(ram[101])
        if by == 0:
            self._ball_prev = None
            return self._fire
        motion = self._ball_velocity(bx, by, 12.0, 0, self.X_LEFT, self.X_RIGHT)
        if motion is None or motion[1] <= 0 or by > self.Y_HIT:
            return self._action_for(self._steer_to(d, 0, bx - self.CENTRE))
        vx, vy = motion
        frames = max(round((self.Y_HIT - by) * 4 / vy), 0)
        x_hit = _reflect(bx + vx * frames / 4, self.X_LEFT, self.X_RIGHT)
        if frames <= 4 * self.plan_steps:
            return self._action_for(self._steer_to_zones(
                d, 0, frames, x_hit, np.array(self.HIT_ZONE), np.array([1.0])))
        return self._action_for(self._steer_to(d, 0, x_hit - self.CENTRE))


class _HumanPlayer(_RamDemonstrator):
    """Shared machinery of the "human" style: held keys, a reaction delay, visible state.

    A person presses a direction key and keeps it down for a while: every press here
    lasts at least `HOLD` agent steps (a run of the same direction, never a one-step tap).
    A person also reacts to what they saw a moment ago: each decision uses the screen as
    it was `DELAY` agent steps before (and the step before that, for the ball's motion),
    which a policy that sees the last 4 stacked frames also sees. What happened since is
    filled in the way a player knows it: from the keys they pressed, whose effect on the
    paddle follows the measured step response.

    Each step it compares every `PLAN`-step sequence of {still, forward, back} that keeps
    the hold rule (given the run in progress) and takes the first move of the best one:
    near a contact, the plan most likely to put the paddle where the ball lands well;
    with the contact further off, the plan whose resting place leaves the best of those
    (Pong) or settles nearest a target (Breakout, and a paddle waiting for the ball).
    """

    HOLD = 3
    """Fewest agent steps a direction key stays down once pressed."""
    DELAY = 2
    """Agent steps between the screen a decision uses and the step it is taken at."""
    PLAN = 8
    """Length, in agent steps, of the key sequences compared."""
    FAR_SWITCH_COST = 4.0
    """Cost, in RAM units of distance, of each key change while steering to a target."""
    LATE_COST = 0.2
    """Cost, in RAM units, of putting off a press by a step while steering to a target."""
    AHEAD_SWITCH_COST = 0.01
    """Cost, in the values of returns, of each key change while heading for a contact."""

    def __init__(self, spec: EnvSpec, *, seed: int = 0, noise: float = 0.0) -> None:
        super().__init__(spec, seed=seed, noise=noise)
        plans = np.array(list(itertools.product((0, 1, -1), repeat=self.PLAN)), dtype=float)
        keep, first_dir, first_len, first_open = [], [], [], []
        for plan in plans:
            runs: list[list[float]] = []  # [direction, length]
            for u in plan:
                if runs and runs[-1][0] == u:
                    runs[-1][1] += 1
                else:
                    runs.append([u, 1])
            inner = runs[1:-1] if len(runs) > 2 else []
            # The first run may go on from the press in progress and the last one may go
            # on after the plan; the runs between must each be long enough.
            if all(u == 0 or n >= self.HOLD for u, n in inner):
                keep.append(plan)
                first_dir.append(runs[0][0])
                first_len.append(runs[0][1])
                first_open.append(len(runs) == 1)
        self._hplans = np.array(keep)
        self._first_dir = np.array(first_dir)
        self._first_len = np.array(first_len)
        self._first_open = np.array(first_open)
        edges = np.zeros((len(self._hplans), 1))
        padded = np.hstack([edges, self._hplans, edges])  # still before and after
        self._hswitches = (np.diff(padded, axis=1) != 0).sum(axis=1)
        self._hlateness = np.abs(self._hplans) @ np.arange(self.PLAN)
        self._fresh = (self._first_dir == 0) | (self._first_len >= self.HOLD) | self._first_open
        self._spots = np.arange(math.floor(self.response.lo), math.ceil(self.response.hi) + 1,
                                dtype=float)

    # -- memory ---------------------------------------------------------------------------

    def _forget(self) -> None:
        super()._forget()
        self._seen: deque[tuple[float, ...]] = deque(maxlen=self.DELAY + 3)  # newest first
        self._taken: deque[int] = deque([0] * (self.DELAY + 4), maxlen=self.DELAY + 4)
        self._run = (0, 0)  # direction of the key down (0: none) and steps it has been down
        self._run_before = (0, 0)
        # The plan values are cached by a rounded ball position, so a hit can return the
        # value of a nearby ball: kept across games, an earlier game would change a later
        # one, and a game would play differently alone or in another process.
        self._worth: dict[tuple[Any, ...], np.ndarray] = {}

    def act(self, env: Any, observation: np.ndarray) -> int:
        self._seen.appendleft(self._look(env.unwrapped.ale.getRAM()))
        action = self._decide()
        if self.noise > 0.0 and self.rng.random() < self.noise:
            action = int(self.rng.choice(self.actions.allowed))
        self._note(action, replace=False)
        return action

    def was_taken(self, action: int) -> None:
        self._note(action, replace=True)

    def _note(self, action: int, *, replace: bool) -> None:
        u = self._direction_of(action)
        if replace:
            self._taken[0] = self._history[0] = u
            self._run = self._run_before
        else:
            self._taken.appendleft(u)
            self._history.appendleft(u)
        self._run_before = self._run
        direction, held = self._run
        self._run = (u, held + 1 if u == direction else 1)

    def _look(self, ram: np.ndarray) -> tuple[float, ...]:
        """What the screen shows, read from RAM: (paddle, ball x, ball y, frame phase)."""
        raise NotImplementedError

    def _decide(self) -> int:
        raise NotImplementedError

    def _reference(self) -> tuple[int, tuple[float, ...], list[tuple[float, ...]]]:
        """(steps since the screen the decision uses, that screen, the ones before it)."""
        lag = min(self.DELAY, len(self._seen) - 1)
        seen = list(self._seen)
        return lag, seen[lag], seen[lag + 1:]

    def _forced(self) -> int | None:
        """The direction the hold rule still requires, if a press is not yet long enough."""
        direction, held = self._run
        return direction if direction != 0 and held < self.HOLD else None

    # -- planning -------------------------------------------------------------------------

    def _allowed(self) -> np.ndarray:
        """Which plans keep the hold rule after the run in progress."""
        direction, held = self._run
        same = self._first_dir == direction
        fresh_ok = (self._first_dir == 0) | (self._first_len >= self.HOLD) | self._first_open
        if direction != 0 and held < self.HOLD:
            return same & ((held + self._first_len >= self.HOLD) | self._first_open)
        return (same & (direction != 0)) | fresh_ok

    def _paddle_at(self, lag: int, d: float, phase: int, frames: int,
                   taken: list[int] | None = None, clip: bool = True,
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the paddle `frames` frames after the screen `lag` steps
        ago (paddle `d` there) for each plan, after the keys pressed since (`taken`,
        newest first; default: the ones taken)."""
        gain, svar = self._gain[phase], self._switch_var[phase]
        last = len(gain) - 1
        full = gain[last]
        lo, hi = (self.response.lo, self.response.hi) if clip else (-np.inf, np.inf)

        def g(x: int, table: np.ndarray = gain) -> np.ndarray:
            return table[_clamp(x, 0, last)]

        taken = list(self._taken) if taken is None else taken
        since = taken[:lag][::-1]  # oldest first
        before = taken[lag:lag + 4]  # newest first
        owed = sum(u * (g(frames + 4 * j) - g(4 * j)) for j, u in enumerate(before, 1))
        owed_all = sum(u * (full - g(4 * j)) for j, u in enumerate(before, 1))
        if owed_all:
            room = _clamp(d + owed_all, lo, hi) - d
            owed *= room / owed_all
        n = len(self._hplans)
        knob = np.full(n, float(_clamp(d + owed_all, lo, hi)))
        mean = np.full(n, float(d) + owed)
        var = np.full(n, self.base_var)
        prev = np.full(n, float(before[0]) if before else 0.0)
        steps = [np.full(n, float(u)) for u in since] + list(self._hplans.T)
        for s, u in enumerate(steps):
            moved = np.clip(knob + u * full, lo, hi) - knob  # the knob stops at its ends
            knob += moved
            mean += moved / full * g(frames - 4 * s)
            var += (u - prev) ** 2 * g(frames - 4 * s, svar)
            prev = u
        var += prev**2 * g(frames - 4 * len(steps), svar)
        return np.clip(mean, lo, hi), var

    def _best(self, score: np.ndarray) -> int:
        """First move of the allowed plan with the highest score."""
        score = np.where(self._allowed(), score, -np.inf)
        return int(self._hplans[int(np.argmax(score)), 0])

    def _h_zones(self, lag: int, d: float, phase: int, frames: int, ball: float,
                 edges: np.ndarray, values: np.ndarray, miss: float = -1.0) -> int:
        mean, var = self._paddle_at(lag, d, phase, frames)
        value = self._zone_values(ball - mean, var, edges, values, miss)
        return self._best(value - 1e-3 * self._hswitches)

    def _h_ahead(self, lag: int, d: float, phase: int, frames: int, ball: float,
                 edges: np.ndarray, values: np.ndarray, miss: float = -1.0) -> int:
        """For a contact more than PLAN steps off: the first move of the plan whose
        resting place (a spread-out guess) leaves the best plans for when the contact is
        PLAN steps away."""
        near = frames - 4 * lag
        near -= 4 * math.ceil((near - 4 * self.PLAN) / 4)
        key = (round(ball * 2), near, phase, values.tobytes())
        worth = self._worth.get(key)
        if worth is None:
            still = [0] * len(self._taken)
            offset, var = self._paddle_at(0, 0.0, phase, near, still, clip=False)
            offset, var = offset[self._fresh], var[self._fresh]
            paddle = np.clip(self._spots[:, None] + offset[None, :], self.response.lo,
                             self.response.hi)
            worth = self._zone_values(ball - paddle, var[None, :], edges, values,
                                      miss).max(axis=1)
            if len(self._worth) > 512:
                self._worth.clear()
            self._worth[key] = worth
        rest, rest_var = self._paddle_at(lag, d, phase, 4 * (lag + self.PLAN) + 32)
        weight = np.exp(-0.5 * (self._spots[None, :] - rest[:, None]) ** 2 / rest_var[:, None])
        expected = (weight @ worth) / weight.sum(axis=1)
        return self._best(expected - self.AHEAD_SWITCH_COST * self._hswitches
                          - 1e-3 * self._hlateness)

    def _h_target(self, lag: int, d: float, phase: int, target: float) -> int:
        mean, _ = self._paddle_at(lag, d, phase, 4 * (lag + self.PLAN) + 32)
        cost = (np.abs(mean - target) + self.FAR_SWITCH_COST * self._hswitches
                + self.LATE_COST * self._hlateness)
        return self._best(-cost)


class PongHuman(_HumanPlayer, PongDemonstrator):
    """Pong played the way a practised person holds the keys (style "human").

    It sees what the screen showed `DELAY` steps ago: the ball's position and motion and
    its own paddle. While the ball comes in, it works out where the ball will cross the
    paddle's column; far off, it heads the paddle for the spot from which the last `PLAN`
    steps have the most to work with; in those steps it picks the held presses most likely
    to return the ball steeply past the CPU (off the paddle's edge), or safely when that is
    too unsure. While the ball travels away it waits mid-court.
    """

    RALLY_VALUE = 0.0
    """A return the CPU gets back is worth nothing here: with held keys the paddle is
    less sure of where it lands, and this keeps it going for the returns that win."""
    SHAKE_AFTER, SHAKE = 2, 12.0
    """Rallies break up sooner: after 2 returns, wait up to ±12 off the chosen spot."""

    def _look(self, ram: np.ndarray) -> tuple[float, ...]:
        return float(ram[51]), float(ram[49]), float(ram[54]), float(int(ram[8]) & 1)

    def _decide(self) -> int:
        lag, (d, bx, by, phase), older = self._reference()
        forced = self._forced()
        in_play = by != 0 and 0 < bx < 205
        motion = None
        if in_play and older and older[0][2] != 0 and 0 < older[0][1] < 205:
            v = [bx - older[0][1], by - older[0][2]]
            if abs(v[0]) <= 16 and abs(v[1]) <= 16:
                if len(older) > 1 and older[1][2] != 0:
                    last_vy = older[0][2] - older[1][2]
                    if v[1] * last_vy < 0 and abs(v[1]) < abs(last_vy) and \
                            min(by - self.Y_TOP, self.Y_BOTTOM - by) <= abs(last_vy):
                        v[1] = -last_vy
                motion = (v[0], v[1])
        if not in_play:
            self._returns, self._incoming = 0, False
        if motion is not None and motion[0] < 0 and self._incoming:
            self._returns += 1
            self._incoming = False
        frames = -1
        if motion is not None and motion[0] > 0 and bx <= self.X_HIT:
            frames = round((self.X_HIT - bx) * 4 / motion[0])
        if frames - 4 * lag < 0:  # no ball coming (or it has met the paddle by now)
            choice = self._h_target(lag, d, int(phase), self.REST_Y)
            return self._action_for(forced if forced is not None else choice)
        if not self._incoming:
            self._incoming = True
            long_rally = self._returns >= self.SHAKE_AFTER
            self._shake = self.script_rng.uniform(-self.SHAKE, self.SHAKE) if long_rally else 0.0
        vx, vy = motion  # type: ignore[misc]
        y_hit = _reflect(by + vy * frames / 4, self.Y_TOP, self.Y_BOTTOM)
        if frames - 4 * lag <= 4 * self.PLAN:
            values = np.array([self._return_value(y_hit, v, vx) for v in self.ZONE_VY])
            choice = self._h_zones(lag, d, int(phase), frames, y_hit,
                                   np.array(self.ZONE_EDGES), values)
        else:
            values = np.array([self._return_value(y_hit, v, vx) for v in self.ZONE_VY])
            choice = self._h_ahead(lag, d, int(phase), frames, y_hit + self._shake,
                                   np.array(self.ZONE_EDGES), values)
        return self._action_for(forced if forced is not None else choice)


class BreakoutHuman(_HumanPlayer, BreakoutDemonstrator):
    """Breakout played the way a practised person holds the keys (style "human").

    It sees what the screen showed `DELAY` steps ago. With no ball in play it serves;
    while the ball falls it works out where the ball will reach the paddle's row and
    heads there, in the last `PLAN` steps picking the held presses most likely to put the
    paddle under it; while the ball rises the paddle follows it.
    """

    def _look(self, ram: np.ndarray) -> tuple[float, ...]:
        return float(ram[72]), float(ram[99]), float(ram[101]), 0.0

    def _decide(self) -> int:
        lag, (d, bx, by, _), older = self._reference()
        forced = self._forced()
        if by == 0:
            return self._fire if forced is None else self._action_for(forced)
        motion = None
        if older and older[0][2] != 0:
            v = [bx - older[0][1], by - older[0][2]]
            if abs(v[0]) <= 12 and abs(v[1]) <= 12:
                if len(older) > 1 and older[1][2] != 0:
                    last_vx = older[0][1] - older[1][1]
                    if v[0] * last_vx < 0 and abs(v[0]) < abs(last_vx) and \
                            min(bx - self.X_LEFT, self.X_RIGHT - bx) <= abs(last_vx):
                        v[0] = -last_vx
                motion = (v[0], v[1])
        frames = -1
        if motion is not None and motion[1] > 0 and by <= self.Y_HIT:
            frames = round((self.Y_HIT - by) * 4 / motion[1])
        if frames - 4 * lag < 0:
            choice = self._h_target(lag, d, 0, bx - self.CENTRE)
            return self._action_for(forced if forced is not None else choice)
        vx = motion[0]  # type: ignore[index]
        x_hit = _reflect(bx + vx * frames / 4, self.X_LEFT, self.X_RIGHT)
        if frames - 4 * lag <= 4 * self.PLAN:
            choice = self._h_zones(lag, d, 0, frames, x_hit, np.array(self.HIT_ZONE),
                                   np.array([1.0]))
        else:
            choice = self._h_target(lag, d, 0, x_hit - self.CENTRE)
        return self._action_for(forced if forced is not None else choice)


SCRIPTED_STYLES: dict[str, dict[str, type[Any]]] = {
    "pong": {"planner": PongDemonstrator, "follow": PongFollower, "human": PongHuman},
    "breakout": {"planner": BreakoutDemonstrator, "human": BreakoutHuman},
    "catch": {"planner": CatchDemonstrator},
}
"""Game → style → class. "planner" plays best; "follow" (Pong) keeps level with the
ball; "human" holds each key for at least `HOLD` steps and decides from what the screen
showed `DELAY` steps before, as a practised person does, so behaviour cloning can copy it
and it still wins."""

SCRIPTED_GAMES: dict[str, type[Any]] = {
    game: styles["planner"] for game, styles in SCRIPTED_STYLES.items()
}
"""Game → scripted demonstrator class (its strongest style, "planner")."""


def make_demonstrator(spec: EnvSpec, *, seed: int = 0, noise: float = 0.0,
                      style: str = "planner") -> Any:
    """The scripted demonstrator for `spec.game` in `style`; EnvError for a game without
    one or a style it lacks."""
    styles = SCRIPTED_STYLES.get(spec.game)
    if styles is None:
        raise EnvError(
            f"no scripted demonstrator for {spec.game}; scripted games: "
            + ", ".join(SCRIPTED_GAMES)
        )
    cls = styles.get(style)
    if cls is None:
        raise EnvError(
            f"the scripted {spec.game} player has no style {style!r}; styles: "
            + ", ".join(styles)
        )
    return cls(spec, seed=seed, noise=noise)
