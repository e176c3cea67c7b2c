"""`EnvSpec`: everything that decides what an observation and an action mean.

The spec is plain data. It is written into every demo file and checkpoint, so a frame
recorded today is preprocessed exactly the same way when a policy trained on it plays.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, get_type_hints

from ..configs import check_options, coerce
from ..errors import ConfigError, EnvError

BACKENDS = ("ale", "pyboy")


@dataclass(frozen=True)
class EnvSpec:
    """How a game is emulated and preprocessed. Defaults follow Machado et al. (2018)."""

    game: str = "pong"
    """The game (`oakemu envs` lists them): an Atari ROM id such as pong or breakout, or a
    Game Boy game such as catch."""
    backend: str = "auto"
    """Emulator: ale (Atari) or pyboy (Game Boy); auto picks the one the game runs on."""
    frame_skip: int = 4
    """Emulator frames per agent step. Atari: the action repeats and the last two frames are
    max-pooled. Game Boy: set by the game config's frames_per_action."""
    screen_size: int = 84
    """Observations are resized to screen_size × screen_size."""
    grayscale: bool = True
    """Observations are single-channel luminance (the only mode the stacker supports)."""
    frame_stack: int = 4
    """The policy sees this many consecutive frames; zeros stand in before an episode starts."""
    noop_max: int = 30
    """Episodes start with a random number (0..noop_max) of NOOP steps."""
    repeat_action_probability: float = 0.25
    """Sticky actions: chance the emulator repeats the previous action for a frame."""
    full_action_space: bool = False
    """Use all 18 joystick actions instead of the game's minimal set."""
    max_episode_frames: int = 108_000
    """Emulator frames after which an episode is truncated (30 minutes of play)."""
    episodic_life: bool = False
    """Training only: a lost life ends the learning episode (the game goes on)."""
    reward_clipping: bool = False
    """Training only: rewards are clipped to their sign."""
    forbidden_actions: tuple[str, ...] = ()
    """Action meanings the agent may never take, e.g. ("FIRE",); they form the action mask."""
    fire_reset: bool = False
    """Atari games that wait for FIRE to serve (Breakout): the first action of every game
    and the first after every lost life is FIRE, whatever the player chose, so a greedy
    policy never waits forever with no ball in play."""
    game_config: str = ""
    """Game Boy: a game config TOML file (buttons, RAM rewards, episode ends, start); empty
    takes the config shipped for `game`. Stored as the config itself (JSON)."""
    rom_sha256: str = ""
    """Game Boy: sha256 of the ROM the game runs on (the ROM itself is never stored); empty
    takes the built-in ROM or the one ROM in the store with the config's title."""
    rom_title: str = ""
    """Game Boy: the ROM header's title (filled in from the ROM)."""

    def __post_init__(self) -> None:
        if isinstance(self.forbidden_actions, str):
            raise EnvError("forbidden_actions must be a list of action names, not one string")
        object.__setattr__(
            self, "forbidden_actions", tuple(str(a).upper() for a in self.forbidden_actions)
        )
        if self.backend not in (*BACKENDS, "auto"):
            raise EnvError(f"unknown emulator backend {self.backend!r}; known: {BACKENDS}")
        if self.backend == "pyboy" or self.game_config or (
                self.backend == "auto" and _gameboy_name(self.game) is not None):
            from .gameboy_spec import resolve

            for name, value in resolve(self).items():
                object.__setattr__(self, name, value)
        else:
            if self.rom_sha256 or self.rom_title:
                raise EnvError("rom_sha256 and rom_title are Game Boy settings; "
                               f"{self.game} is an Atari game")
            if self.fire_reset and "FIRE" in self.forbidden_actions:
                raise EnvError("fire_reset presses FIRE, which forbidden_actions forbids; "
                               "drop one of the two")
            object.__setattr__(self, "backend", "ale")
            object.__setattr__(self, "game", canonical_game(self.game))
        # Upper bounds too: a spec read from a file must not make one step or one reset
        # run for hours, and ALE takes 32-bit frame counts.
        check_options(self, [
            ("frame_skip", 1 <= self.frame_skip <= 64, "from 1 to 64"),
            ("screen_size", 8 <= self.screen_size <= 512, "from 8 to 512"),
            ("frame_stack", 1 <= self.frame_stack <= 32, "from 1 to 32"),
            ("noop_max", 0 <= self.noop_max <= 10_000, "from 0 to 10000"),
            ("repeat_action_probability", 0.0 <= self.repeat_action_probability < 1.0,
             "in [0, 1)"),
            ("max_episode_frames", 1 <= self.max_episode_frames <= 2**31 - 1,
             "from 1 to 2**31 - 1"),
        ], section="env", error=EnvError)
        if not self.grayscale:
            raise EnvError("env spec grayscale=false is not supported yet; use grayscale frames")

    @property
    def env_id(self) -> str:
        """A readable id for logs and metadata, e.g. ALE/Pong-v5 or GB/catch."""
        if self.backend == "pyboy":
            return f"GB/{self.game}"
        return "ALE/" + "".join(part.capitalize() for part in self.game.split("_")) + "-v5"

    @property
    def gameboy_config(self) -> Any:
        """The parsed game config (`envs.gameconfig.GameConfig`) of a Game Boy spec."""
        from .gameconfig import from_json

        if self.backend != "pyboy":
            raise EnvError(f"{self.game} is not a Game Boy game")
        return from_json(self.game_config)

    @property
    def frame_shape(self) -> tuple[int, int]:
        return (self.screen_size, self.screen_size)

    @property
    def observation_shape(self) -> tuple[int, int, int]:
        return (self.frame_stack, self.screen_size, self.screen_size)

    def for_evaluation(self) -> EnvSpec:
        """The same game without the training-only switches (raw rewards, whole games)."""
        return replace(self, episodic_life=False, reward_clipping=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["forbidden_actions"] = list(self.forbidden_actions)
        data["env_id"] = self.env_id
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnvSpec:
        if not isinstance(data, dict):
            raise EnvError(f"an env spec must be a mapping, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k != "env_id"}
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise EnvError(f"unknown env spec keys: {', '.join(unknown)}")
        hints = get_type_hints(cls)
        try:
            clean = {name: coerce(f"env spec {name}", hints[name], value)
                     for name, value in data.items()}
        except ConfigError as error:
            raise EnvError(str(error)) from None
        return cls(**clean)

    @classmethod
    def from_json(cls, text: str) -> EnvSpec:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as error:
            raise EnvError(f"env spec is not valid JSON: {error}") from None
        return cls.from_dict(data)

    def same_frames_as(self, other: EnvSpec) -> bool:
        """True when both specs give the same observations and actions (the training-only
        switches may differ: they change rewards and episode ends, not frames)."""
        return self.for_evaluation() == other.for_evaluation()

    def frame_differences(self, other: EnvSpec) -> list[str]:
        """`key a vs b` for each setting in which the two specs' frames differ."""
        mine, theirs = self.for_evaluation().to_dict(), other.for_evaluation().to_dict()
        return [f"{k} {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs.get(k)]


def actions_agree(meanings: Any, mask: Any) -> bool:
    """Whether stored action meanings and mask describe one action set: a non-empty list of
    names, one bool per name, at least one action allowed (checkpoints, demo files and
    exports all store the pair)."""
    return (isinstance(meanings, list) and isinstance(mask, list) and bool(meanings)
            and len(meanings) == len(mask) and all(isinstance(m, str) for m in meanings)
            and all(isinstance(m, bool) for m in mask) and any(mask))


def require_same_env(first: str, first_spec: EnvSpec, first_meanings: Sequence[str],
                     second: str, second_spec: EnvSpec, second_meanings: Sequence[str], *,
                     hint: str, error: type[EnvError] | type[Exception] = EnvError) -> None:
    """Refuse, in one line that names both and what differs, two things (demo files,
    checkpoints, exports) whose frames or actions differ: a policy trained on one would
    see or do something else on the other."""
    differences = first_spec.frame_differences(second_spec)
    if list(first_meanings) != list(second_meanings):
        differences.append("actions " + ", ".join(first_meanings) + " vs "
                           + ", ".join(second_meanings))
    if differences:
        raise error(f"{first} and {second} were made with different env specs "
                    f"({'; '.join(differences)}); {hint}")


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def available_games() -> list[str]:
    from ale_py import roms

    return sorted(roms.get_all_rom_ids())


def _gameboy_name(name: Any) -> str | None:
    """The shipped Game Boy config `name` refers to (catch, GB/catch, pokemon-red), or None."""
    from .gameconfig import shipped_games

    if not isinstance(name, str):
        return None
    raw = name.strip()
    raw = raw[3:] if raw.upper().startswith("GB/") else raw
    key = _snake(raw).replace("-", "_").replace(" ", "_")
    return key if key in shipped_games() else None


def canonical_game(name: str) -> str:
    """Map `pong`, `Pong`, `ALE/Pong-v5`, `PongNoFrameskip-v4` or `space-invaders` to a ROM id."""
    if not isinstance(name, str) or not name.strip():
        raise EnvError("the game name is empty; `oakemu envs` lists the games")
    raw = name.strip()
    base = raw.split("/", 1)[1] if raw.upper().startswith("ALE/") else raw
    base = re.sub(r"-v\d+$", "", base)
    base = re.sub(r"NoFrameskip$|Deterministic$", "", base)
    candidate = _snake(base).replace("-", "_").replace(" ", "_")
    games = available_games()
    if candidate in games:
        return candidate
    compact = candidate.replace("_", "")
    for game in games:
        if game.replace("_", "") == compact:
            return game
    raise EnvError(f"unknown game {raw!r}; run `oakemu envs` to list the games")
