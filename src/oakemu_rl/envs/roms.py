"""Game Boy ROMs and save states: checked once, then found again by their sha256.

A user's ROM is never stored in a demo file or checkpoint, only its sha256 and header
title. `--rom PATH` checks the file and copies it into the ROM store
(`$OAKEMU_ROM_DIR`, by default `~/.local/share/oakemu-rl/roms`), so later commands that
start from a checkpoint find it by its digest. The project's own CATCH cartridge is built
from its source whenever it is needed and never needs the store.

Save states are kept the same way. A state the project writes starts with a line naming
the ROM it was taken on, so loading it on another ROM is refused. A bare emulator state
names no ROM and the emulator's format holds nothing to tell one game from another: it is
refused only when it does not load or leaves bytes over.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from ..errors import EnvError
from ..fsutil import atomic_write

LOGO_AT = 0x0104
# The first half of the logo bitmap every cartridge carries at $0104: what every Game Boy's
# boot ROM checks before it runs a cartridge (the colour models check only this half).
LOGO_HEAD = bytes.fromhex("CEED6666CC0D000B03730083000C000D0008111F8889000E")
TITLE_AT, TITLE_END = 0x0134, 0x0144
HEADER_CHECKSUM_AT = 0x014D
STATE_MAGIC = b"OAKEMU-STATE "


class RomError(EnvError):
    """A file that is not a usable Game Boy ROM or save state."""


def store_dir() -> Path:
    root = os.environ.get("OAKEMU_ROM_DIR")
    if root:
        return Path(root).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "oakemu-rl" / "roms"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_sha256(text: str) -> bool:
    """Whether `text` is a lowercase hexadecimal sha256 digest."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def header_checksum(rom: bytes | bytearray) -> int:
    """The byte at $014D: over $0134..$014C (title to version), x = x - byte - 1 (mod 256)."""
    value = 0
    for byte in rom[TITLE_AT:HEADER_CHECKSUM_AT]:
        value = (value - byte - 1) & 0xFF
    return value


def check_rom(data: bytes, name: str) -> str:
    """The ROM's header title; `RomError` in one line when `data` is not a Game Boy ROM."""
    if len(data) < 0x8000 or len(data) % 0x4000 or len(data) > 8 * 1024 * 1024:
        raise RomError(f"{name} is not a Game Boy ROM: {len(data):,} bytes, where a cartridge "
                       "image is a multiple of 16 KiB from 32 KiB to 8 MiB")
    if data[LOGO_AT:LOGO_AT + len(LOGO_HEAD)] != LOGO_HEAD:
        raise RomError(f"{name} is not a Game Boy ROM: it lacks the logo every cartridge "
                       f"carries at ${LOGO_AT:04X}")
    if header_checksum(data) != data[HEADER_CHECKSUM_AT]:
        raise RomError(f"{name} is not a valid Game Boy ROM: its header checksum is "
                       f"${data[HEADER_CHECKSUM_AT]:02X}, the header sums to "
                       f"${header_checksum(data):02X} (a damaged or patched file)")
    raw = data[TITLE_AT:TITLE_END].split(b"\x00", 1)[0]
    # Colour cartridges use the title's last bytes for flags; keep the printable part.
    title = "".join(chr(b) for b in raw if 0x20 <= b < 0x7F).strip()
    return title


def _builtin() -> dict[str, bytes]:
    from .gbgame import build_rom

    rom = build_rom()
    return {sha256(rom): rom}


@functools.cache
def builtin_roms() -> dict[str, bytes]:
    """The ROMs the project builds itself, by sha256."""
    return _builtin()


def add_rom(path: str | Path) -> tuple[str, str]:
    """Check a ROM file and keep a copy in the store; its (sha256, title)."""
    path = Path(path).expanduser()
    data = _read(path, "ROM")
    title = check_rom(data, str(path))
    digest = sha256(data)
    if digest not in builtin_roms():
        _keep(data, store_dir() / f"{digest}.gb", path)
    return digest, title


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise RomError(f"{what} {path} does not exist") from None
    except OSError as error:
        raise RomError(f"cannot read the {what} {path}: {error}") from None


def _keep(data: bytes, target: Path, source: Path) -> None:
    """Write a copy into the store (atomically) unless it is there already."""
    if target.exists():
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(target) as handle:
            handle.write(data)
    except OSError as error:
        raise RomError(f"cannot keep a copy of {source} in {target.parent}: {error}") from None


def find_rom(digest: str) -> bytes | None:
    if digest in builtin_roms():
        return builtin_roms()[digest]
    path = store_dir() / f"{digest}.gb"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if sha256(data) == digest else None


_TITLES: dict[str, str] = {}  # sha256 -> header title: a digest's content never changes


def title_of(digest: str) -> str | None:
    """The header title of the ROM with this sha256, or None when it is not here."""
    if digest not in _TITLES:
        data = find_rom(digest)
        if data is None:
            return None
        try:
            _TITLES[digest] = check_rom(data, digest)
        except RomError:
            return None
    return _TITLES[digest]


def stored_titles() -> dict[str, str]:
    """sha256 → header title of every ROM the store and the project have."""
    titles = {digest: check_rom(rom, "built-in") for digest, rom in builtin_roms().items()}
    folder = store_dir()
    if folder.is_dir():
        for path in sorted(folder.glob("*.gb")):
            try:
                titles[path.stem] = check_rom(path.read_bytes(), str(path))
            except (OSError, RomError):
                continue
    return titles


def rom_for(digest: str, game: str) -> bytes:
    """The ROM with this sha256, or one line saying how to provide it."""
    data = find_rom(digest)
    if data is None:
        raise RomError(f"the ROM for {game} (sha256 {digest[:12]}…) is not on this machine; "
                       "add it once with `oakemu envs --rom PATH` (ROMs are never downloaded "
                       "or shipped)")
    return data


# -- save states -----------------------------------------------------------------------


def state_bytes(rom_sha256: str, state: bytes) -> bytes:
    """A save state as the project writes it: a line naming the ROM, then the state."""
    return STATE_MAGIC + json.dumps({"rom_sha256": rom_sha256}).encode() + b"\n" + state


def split_state(data: bytes, name: str) -> tuple[str | None, bytes]:
    """(ROM sha256 or None for a bare emulator state, emulator state)."""
    if not data.startswith(STATE_MAGIC):
        return None, data
    head, _, body = data[len(STATE_MAGIC):].partition(b"\n")
    try:
        digest = json.loads(head)["rom_sha256"]
    except (ValueError, KeyError, TypeError):
        raise RomError(f"{name} is not a valid save state: its header is damaged") from None
    return str(digest), body


def add_state(path: str | Path) -> str:
    """Keep a copy of a save state file in the store; its sha256."""
    path = Path(path).expanduser()
    data = _read(path, "save state")
    if len(data) < 64:
        raise RomError(f"{path} is not a save state ({len(data)} bytes)")
    split_state(data, str(path))
    digest = sha256(data)
    _keep(data, store_dir() / "states" / f"{digest}.state", path)
    return digest


def state_for(digest: str, game: str) -> bytes:
    path = store_dir() / "states" / f"{digest}.state"
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    if sha256(data) != digest:
        raise RomError(f"the start state of {game} (sha256 {digest[:12]}…) is not on this "
                       "machine; pass the game config that names it with --game-config")
    return data
