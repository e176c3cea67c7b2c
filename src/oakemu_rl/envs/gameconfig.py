"""Game Boy game configs: the buttons an agent may press, rewards read from RAM, episode ends
and the start, one TOML file per game.

    [game]
    name = "catch"
    title = "OAKCATCH"          # the ROM header's title the config is for
    frames_per_action = 4       # emulator frames per agent step
    press_frames = 4            # frames a button is held within the step
    max_steps = 1000            # agent steps after which an episode is cut
    lives = "lives"             # optional: RAM that counts lives (episodic_life uses it)

    [symbols]                   # names for RAM addresses, usable wherever an address is
    score = 0xC000

    [actions]
    buttons = ["NOOP", "LEFT", "RIGHT"]     # NOOP first, then single buttons
    combos = [["A", "RIGHT"]]               # optional: buttons pressed together

    [[rewards]]
    address = "score"           # or addresses = [...]; each cell is `width` bytes
    width = 2
    kind = "increase"           # change | increase | bits | new_value | new_position
    weight = 1.0

    [[ends]]
    address = "game_over"
    equals = 1                  # or at_least / at_most

    [start]
    mode = "boot"               # boot | state | buttons
    boot_frames = 120           # frames run after power-on before play
    buttons = [["START", 30]]   # buttons: each pressed for a step, then N frames waited
    state = "start.state"       # state: a save state file (relative to the config)

    [screen]
    crop = [0, 0, 0, 0]         # pixels cut from the top, bottom, left, right

Reward kinds, over the term's cells: `change` is the step's change of their sum,
`increase` the same when positive, `bits` the change in how many bits are set, `new_value`
pays once per episode for each value of the first cell not seen before, `new_position` once
for each tuple of the cells (e.g. map, x, y) not visited before.
"""

from __future__ import annotations

import functools
import json
import math
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EnvError

BUTTONS = ("UP", "DOWN", "LEFT", "RIGHT", "A", "B", "START", "SELECT")
REWARD_KINDS = ("change", "increase", "bits", "new_value", "new_position")
START_MODES = ("boot", "state", "buttons")

# Where a reward or an episode end may read: the Game Boy's RAM and registers. The ROM
# ($0000-$7FFF) holds no game state, and echo RAM / the unusable page mirror others.
MEMORY_MAP = (
    (0x8000, 0x9FFF, "VRAM"),
    (0xA000, 0xBFFF, "cartridge RAM"),
    (0xC000, 0xDFFF, "WRAM"),
    (0xFE00, 0xFE9F, "OAM"),
    (0xFF00, 0xFF7F, "I/O registers"),
    (0xFF80, 0xFFFF, "HRAM"),
)
_MAP_TEXT = ", ".join(f"{name} ${lo:04X}-${hi:04X}" for lo, hi, name in MEMORY_MAP)

_SECTIONS = {
    "game": {"name", "title", "sha256", "frames_per_action", "press_frames", "max_steps",
             "lives"},
    "symbols": None,  # any names
    "actions": {"buttons", "combos"},
    "rewards": {"name", "address", "addresses", "width", "count", "endian", "kind", "weight"},
    "ends": {"address", "width", "endian", "equals", "at_least", "at_most"},
    "start": {"mode", "boot_frames", "buttons", "state", "state_sha256"},
    "screen": {"crop"},
}


class GameConfigError(EnvError):
    """A game config that cannot be used; the message names the key."""


@dataclass(frozen=True)
class Cells:
    """RAM cells a term reads: `addresses`, each `width` bytes, in `endian` order."""

    addresses: tuple[int, ...]
    width: int = 1
    endian: str = "little"

    def values(self, read: Callable[[int], int]) -> list[int]:
        out = []
        for address in self.addresses:
            raw = [read(address + i) for i in range(self.width)]
            if self.endian == "little":
                raw.reverse()
            value = 0
            for byte in raw:
                value = (value << 8) | byte
            out.append(value)
        return out


@dataclass(frozen=True)
class RewardTerm:
    cells: Cells
    kind: str
    weight: float
    name: str = ""


@dataclass(frozen=True)
class EndCondition:
    cells: Cells
    equals: int | None = None
    at_least: int | None = None
    at_most: int | None = None

    def holds(self, read: Callable[[int], int]) -> bool:
        value = self.cells.values(read)[0]
        return ((self.equals is None or value == self.equals)
                and (self.at_least is None or value >= self.at_least)
                and (self.at_most is None or value <= self.at_most))


@dataclass(frozen=True)
class GameConfig:
    """A parsed, checked game config. `to_json()` is the canonical form stored in env specs."""

    name: str
    title: str
    frames_per_action: int
    press_frames: int
    max_steps: int
    actions: tuple[tuple[str, ...], ...]
    rewards: tuple[RewardTerm, ...]
    ends: tuple[EndCondition, ...]
    start_mode: str = "boot"
    boot_frames: int = 0
    start_buttons: tuple[tuple[str, int], ...] = ()
    state_sha256: str = ""
    crop: tuple[int, int, int, int] = (0, 0, 0, 0)
    lives: Cells | None = None
    sha256: str = ""
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def meanings(self) -> tuple[str, ...]:
        return tuple("+".join(buttons) if buttons else "NOOP" for buttons in self.actions)

    def to_json(self) -> str:
        return json.dumps(self.source, sort_keys=True, separators=(",", ":"))


def _fail(key: str, message: str) -> GameConfigError:
    return GameConfigError(f"game config {key}: {message}")


def _int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, f"must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise _fail(key, f"must be from {low} to {high}, got {value}")
    return value


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(key, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _table(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(key, f"must be a table, got {type(value).__name__}")
    return value


def _check_keys(key: str, table: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        known = ", ".join(sorted(allowed))
        raise _fail(f"{key}.{unknown[0]}", f"is not a known key (known: {known})")


def _address(key: str, value: Any, symbols: dict[str, int], span: int = 1) -> int:
    if isinstance(value, str):
        if value not in symbols:
            raise _fail(key, f"names the symbol {value!r}, which [symbols] does not define")
        value = symbols[value]
    address = _int(key, value, 0, 2**32)
    last = address + span - 1
    for lo, hi, _name in MEMORY_MAP:
        if lo <= address and last <= hi:
            return address
    raise _fail(key, f"${address:04X} (+{span} bytes) is outside the Game Boy's RAM ({_MAP_TEXT})")


def _cells(key: str, table: dict[str, Any], symbols: dict[str, int]) -> Cells:
    width = _int(f"{key}.width", table.get("width", 1), 1, 4)
    endian = table.get("endian", "little")
    if endian not in ("little", "big"):
        raise _fail(f"{key}.endian", f"must be 'little' or 'big', got {endian!r}")
    if ("address" in table) == ("addresses" in table):
        raise _fail(key, "needs exactly one of address or addresses")
    if "address" in table:
        count = _int(f"{key}.count", table.get("count", 1), 1, 4096)
        start = _address(f"{key}.address", table["address"], symbols, count * width)
        addresses = tuple(start + i * width for i in range(count))
    else:
        raw = table["addresses"]
        if not isinstance(raw, list) or not raw or "count" in table:
            raise _fail(f"{key}.addresses", "must be a non-empty list (and takes no count)")
        addresses = tuple(_address(f"{key}.addresses[{i}]", a, symbols, width)
                          for i, a in enumerate(raw))
    return Cells(addresses, width, endian)


def _reward(key: str, table: dict[str, Any], symbols: dict[str, int]) -> RewardTerm:
    _check_keys(key, table, _SECTIONS["rewards"])
    kind = table.get("kind", "change")
    if kind not in REWARD_KINDS:
        raise _fail(f"{key}.kind", f"must be one of {', '.join(REWARD_KINDS)}, got {kind!r}")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise _fail(f"{key}.weight", f"must be a finite number, got {weight!r}")
    return RewardTerm(_cells(key, table, symbols), kind, float(weight), str(table.get("name", "")))


def _end(key: str, table: dict[str, Any], symbols: dict[str, int]) -> EndCondition:
    _check_keys(key, table, _SECTIONS["ends"])
    bounds = {k: _int(f"{key}.{k}", table[k], 0, 2**32 - 1)
              for k in ("equals", "at_least", "at_most") if k in table}
    if not bounds:
        raise _fail(key, "needs equals, at_least or at_most")
    cells = _cells(key, {k: v for k, v in table.items() if k not in bounds}, symbols)
    return EndCondition(cells, **bounds)


def _actions(table: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    _check_keys("actions", table, _SECTIONS["actions"])
    buttons = table.get("buttons")
    if not isinstance(buttons, list) or not buttons or buttons[0] != "NOOP":
        raise _fail("actions.buttons", "must be a list of buttons that starts with NOOP")
    actions: list[tuple[str, ...]] = [()]
    combos = table.get("combos", [])
    if not isinstance(combos, list):
        raise _fail("actions.combos", "must be a list of button lists")
    for i, entry in enumerate([[b] for b in buttons[1:]] + list(combos)):
        key = f"actions.buttons[{i + 1}]" if i < len(buttons) - 1 else \
            f"actions.combos[{i - len(buttons) + 1}]"
        if not isinstance(entry, list) or not entry:
            raise _fail(key, "must be a non-empty list of buttons")
        names = tuple(str(b).upper() for b in entry)
        bad = [b for b in names if b not in BUTTONS]
        if bad:
            raise _fail(key, f"{bad[0]} is not a Game Boy button ({', '.join(BUTTONS)})")
        if len(set(names)) != len(names) or names in actions:
            raise _fail(key, f"{'+'.join(names)} is listed twice")
        actions.append(names)
    return tuple(actions)


def _start(table: dict[str, Any], base: Path | None) -> dict[str, Any]:
    _check_keys("start", table, _SECTIONS["start"])
    mode = table.get("mode", "boot")
    if mode not in START_MODES:
        raise _fail("start.mode", f"must be one of {', '.join(START_MODES)}, got {mode!r}")
    out: dict[str, Any] = {"mode": mode,
                           "boot_frames": _int("start.boot_frames", table.get("boot_frames", 0),
                                               0, 100_000)}
    steps = table.get("buttons", [])
    if not isinstance(steps, list):
        raise _fail("start.buttons", "must be a list of [button, frames to wait] pairs")
    clean = []
    for i, step in enumerate(steps):
        if (not isinstance(step, list) or len(step) != 2 or not isinstance(step[0], str)
                or step[0].upper() not in BUTTONS):
            raise _fail(f"start.buttons[{i}]", f"must be [button, frames], got {step!r}")
        clean.append((step[0].upper(), _int(f"start.buttons[{i}][1]", step[1], 0, 100_000)))
    if mode == "buttons" and not clean:
        raise _fail("start.buttons", "is empty, and start.mode is 'buttons'")
    out["buttons"] = clean
    if mode == "state":
        out["state_sha256"] = _state_digest(table, base)
    else:
        for key in ("state", "state_sha256"):
            if key in table:
                raise _fail(f"start.{key}", f"applies only when start.mode is 'state', "
                                            f"not {mode!r}")
    return out


def _state_digest(table: dict[str, Any], base: Path | None) -> str:
    """The save state's sha256: from `state_sha256` (a stored config) or by adding the
    `state` file to the ROM store (a config read from disk)."""
    from . import roms

    if "state_sha256" in table:
        digest = _str("start.state_sha256", table["state_sha256"]).lower()
        if not roms.is_sha256(digest):
            raise _fail("start.state_sha256", "must be 64 hexadecimal digits")
        return digest
    if "state" not in table:
        raise _fail("start.state", "is missing, and start.mode is 'state'")
    path = Path(_str("start.state", table["state"])).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    return roms.add_state(path)


def _game(table: dict[str, Any], symbols: dict[str, int]) -> dict[str, Any]:
    _check_keys("game", table, _SECTIONS["game"])
    # At most 64: the env spec's frame_skip, which is set from it, allows no more.
    frames = _int("game.frames_per_action", table.get("frames_per_action", 4), 1, 64)
    press = _int("game.press_frames", table.get("press_frames", frames), 1, frames)
    out = {
        "name": _str("game.name", table.get("name")).lower().replace("-", "_").replace(" ", "_"),
        "title": _str("game.title", table.get("title")),
        "frames_per_action": frames,
        "press_frames": press,
        "max_steps": _int("game.max_steps", table.get("max_steps", 10_000), 1, 10_000_000),
        "sha256": str(table.get("sha256", "")).lower(),
    }
    if "lives" in table:
        out["lives"] = _address("game.lives", table["lives"], symbols)
    return out


def _symbols(table: dict[str, Any]) -> dict[str, int]:
    return {str(name): _int(f"symbols.{name}", value, 0, 0xFFFF) for name, value in table.items()}


def parse(data: dict[str, Any], *, base: Path | None = None) -> GameConfig:
    """Check a config's tables (TOML read, or the JSON stored in an env spec) and build it.

    Every problem raises `GameConfigError` naming the key. `base` is where relative files
    (a start state) are found.
    """
    data = _table("file", data)
    _check_keys("file", data, set(_SECTIONS))
    for name in ("game", "actions"):
        if name not in data:
            raise _fail(f"[{name}]", "is missing")
    symbols = _symbols(_table("symbols", data.get("symbols", {})))
    game = _game(_table("game", data["game"]), symbols)
    actions = _actions(_table("actions", data["actions"]))
    rewards = _records("rewards", data.get("rewards", []), lambda k, t: _reward(k, t, symbols))
    ends = _records("ends", data.get("ends", []), lambda k, t: _end(k, t, symbols))
    start = _start(_table("start", data.get("start", {})), base)
    screen = _table("screen", data.get("screen", {}))
    _check_keys("screen", screen, _SECTIONS["screen"])
    crop = screen.get("crop", [0, 0, 0, 0])
    if not isinstance(crop, list) or len(crop) != 4:
        raise _fail("screen.crop", "must be [top, bottom, left, right]")
    crop = tuple(_int(f"screen.crop[{i}]", c, 0, 70) for i, c in enumerate(crop))
    source = {k: v for k, v in data.items()}
    source["start"] = {"mode": start["mode"], "boot_frames": start["boot_frames"],
                       "buttons": [list(b) for b in start["buttons"]]}
    if start["mode"] == "state":
        source["start"]["state_sha256"] = start["state_sha256"]
    lives = game.pop("lives", None)
    return GameConfig(
        **game, actions=actions, rewards=rewards, ends=ends, start_mode=start["mode"],
        boot_frames=start["boot_frames"], start_buttons=tuple(start["buttons"]),
        state_sha256=start.get("state_sha256", ""), crop=crop,  # type: ignore[arg-type]
        lives=Cells((lives,)) if lives is not None else None, source=source)


def _records(name: str, value: Any, build: Callable[[str, dict[str, Any]], Any]) -> tuple:
    if not isinstance(value, list):
        raise _fail(name, f"must be a list of tables ([[{name}]]), got {type(value).__name__}")
    return tuple(build(f"{name}[{i}]", _table(f"{name}[{i}]", t)) for i, t in enumerate(value))


def load(path: str | Path) -> GameConfig:
    """Read and check a game config TOML file."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GameConfigError(f"game config {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise GameConfigError(f"cannot read the game config {path}: {error}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise GameConfigError(f"game config {path} is not valid TOML: {error}") from None
    try:
        return parse(data, base=path.parent)
    except GameConfigError as error:
        raise GameConfigError(f"{path}: {error}") from None


@functools.lru_cache(maxsize=64)
def from_json(text: str) -> GameConfig:
    """The config stored in an env spec (parsed once per text: env specs ask for it on
    every action-set and mask lookup, and a GameConfig is immutable)."""
    try:
        data = json.loads(text)
    except ValueError as error:
        raise GameConfigError(f"the stored game config is not valid JSON: {error}") from None
    return parse(data)


GAMES_DIR = Path(__file__).with_name("games")


@functools.cache
def shipped_games() -> dict[str, Path]:
    """The game configs that ship with the package, by name."""
    return {p.stem: p for p in sorted(GAMES_DIR.glob("*.toml"))}


class RewardTracker:
    """Turns RAM into per-step rewards for one episode (`reset`, then `step` after each
    agent step). `read(address)` returns one byte; the tracker never writes."""

    def __init__(self, terms: Sequence[RewardTerm], read: Callable[[int], int]) -> None:
        self.terms = tuple(terms)
        self.read = read
        self._last: list[Any] = []
        self._seen: list[set[Any]] = []

    def _measure(self, term: RewardTerm) -> Any:
        values = term.cells.values(self.read)
        if term.kind in ("change", "increase"):
            return sum(values)
        if term.kind == "bits":
            return sum(bin(v).count("1") for v in values)
        if term.kind == "new_value":
            return values[0]
        return tuple(values)

    def reset(self) -> None:
        self._last = [self._measure(t) for t in self.terms]
        self._seen = [{v} for v in self._last]

    def step(self) -> tuple[float, dict[str, float]]:
        """The step's reward and each named term's share."""
        total, parts = 0.0, {}
        for i, term in enumerate(self.terms):
            now = self._measure(term)
            if term.kind in ("new_value", "new_position"):
                gain = 0.0 if now in self._seen[i] else 1.0
                self._seen[i].add(now)
            else:
                gain = float(now - self._last[i])
                if term.kind == "increase":
                    gain = max(gain, 0.0)
            self._last[i] = now
            reward = term.weight * gain
            total += reward
            if term.name:
                parts[term.name] = parts.get(term.name, 0.0) + reward
        return total, parts
