"""How an `EnvSpec` for a Game Boy game is completed: the game config read and stored as
JSON, the ROM found by digest or title, frames per step taken from the config."""

from __future__ import annotations

from typing import Any

from ..errors import EnvError
from . import gameconfig, roms


def _config(spec: Any) -> gameconfig.GameConfig:
    text = spec.game_config.strip()
    if text.startswith("{"):
        return gameconfig.from_json(text)
    if text:
        return gameconfig.load(text)
    from .spec import _gameboy_name

    name = _gameboy_name(spec.game)
    if name is None:
        raise EnvError(f"unknown game {spec.game!r}; run `oakemu envs` to list the games, or "
                       "pass a Game Boy game config with --game-config FILE")
    return gameconfig.load(gameconfig.shipped_games()[name])


def _rom_by_title(config: gameconfig.GameConfig) -> str:
    """The sha256 of the one ROM here whose header title is the config's."""
    matches = sorted(d for d, title in roms.stored_titles().items() if title == config.title)
    built = [d for d in matches if d in roms.builtin_roms()]
    matches = built or matches  # a game the project builds runs on the ROM it builds
    if not matches:
        raise roms.RomError(
            f"{config.name} needs its ROM (header title {config.title!r}), which is not on "
            "this machine: pass it once with --rom PATH (ROMs are never downloaded)")
    if len(matches) > 1:
        raise roms.RomError(f"several ROMs titled {config.title!r} are in {roms.store_dir()}; "
                            "pass the one to use with --rom PATH")
    return matches[0]


def _rom(spec: Any, config: gameconfig.GameConfig) -> tuple[str, str]:
    """(sha256, title) of the ROM the spec runs on. A spec that names its ROM reads that
    one ROM's title (once per process), not the whole store: specs are rebuilt often."""
    digest = (spec.rom_sha256 or config.sha256).lower() or _rom_by_title(config)
    if not roms.is_sha256(digest):
        raise EnvError(f"env spec rom_sha256 must be 64 hexadecimal digits, got {digest!r}")
    title = roms.title_of(digest)
    if title is not None and title != config.title:
        raise roms.RomError(f"the ROM {digest[:12]}… is titled {title!r}, and the {config.name} "
                            f"config is for {config.title!r}; pass that game's ROM")
    return digest, title or spec.rom_title or config.title


def resolve(spec: Any) -> dict[str, Any]:
    """The fields a Game Boy spec gets (backend, game, game_config, rom_sha256, rom_title,
    frame_skip), or an `EnvError` naming what is wrong."""
    config = _config(spec)
    if spec.frame_skip not in (4, config.frames_per_action):
        raise EnvError(f"env frame_skip is set by the game config for Game Boy games "
                       f"({config.name}: frames_per_action = {config.frames_per_action}); "
                       "change it there")
    if spec.full_action_space:
        raise EnvError("full_action_space is an Atari setting; a Game Boy game's buttons "
                       "come from its game config")
    if spec.fire_reset:
        raise EnvError("fire_reset is an Atari setting; a Game Boy game's start comes from "
                       "its game config")
    digest, title = _rom(spec, config)
    return {"backend": "pyboy", "game": config.name, "game_config": config.to_json(),
            "rom_sha256": digest, "rom_title": title, "frame_skip": config.frames_per_action}
