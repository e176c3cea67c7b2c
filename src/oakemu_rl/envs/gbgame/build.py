"""Build the CATCH cartridge from `catch.asm`.

    python -m oakemu_rl.envs.gbgame.build --out catch.gb

`build_rom()` returns the 32 KiB image (and writes it atomically when given a path);
`symbols()` is the assembler's symbol table; `RAM` names the WRAM addresses an agent or
a reward function reads, taken from that table so they always match the source.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from ...fsutil import atomic_write
from ..roms import header_checksum
from .asm import Assembly, assemble

__all__ = [
    "RAM",
    "ROM_SIZE",
    "SOURCE",
    "build_rom",
    "global_checksum",
    "header_checksum",
    "main",
    "symbols",
]

SOURCE = Path(__file__).with_name("catch.asm")
ROM_SIZE = 0x8000  # 32 KiB, cartridge type 0 (no banking)
TITLE = b"OAKCATCH"

# Header layout (addresses in the cartridge image); `header_checksum` sums $0134..$014C
# into the byte at HEADER_CHECKSUM_AT, the check every ROM passes (envs/roms.py).
HEADER_CHECKSUM_AT = 0x014D
GLOBAL_CHECKSUM_AT = 0x014E  # two bytes, high byte first

# RAM name -> label in catch.asm.
_RAM_LABELS = {
    "score": "wScore",  # u16 little-endian: catches so far
    "score_bcd": "wScoreBCD",  # the same, BCD, low byte first (what the screen shows)
    "lives": "wLives",  # u8: 3 at the start
    "game_over": "wGameOver",  # u8: 1 once the last life is lost, else 0
    "player_x": "wPlayerX",  # u8: basket's left edge in screen pixels, 0..144
    "object_x": "wObjectX",  # u8: ball's left edge in screen pixels, 16..136
    "object_y": "wObjectY",  # u8: ball's top edge in screen pixels, 8..136
    "joypad": "wJoypad",  # u8: D-pad read this frame (bit 0 right, 1 left, 2 up, 3 down)
    "rng": "wRandom",  # u8: random generator state
    "frames": "wFrames",  # u16 little-endian: frames of play, frozen at game over
    "catches": "wCatches",  # u8: balls caught (wraps at 256)
    "misses": "wMisses",  # u8: balls missed
}

# Playfield constants from catch.asm that a scripted player needs.
_CONSTANT_LABELS = {
    "player_y": "PLAYER_Y",
    "player_width": "PLAYER_W",
    "player_max_x": "PLAYER_MAXX",
    "player_step": "PLAYER_STEP",
    "catch_y": "CATCH_Y",
    "ground_y": "GROUND_Y",
    "start_lives": "START_LIVES",
}


@functools.cache
def _assembly() -> Assembly:
    return assemble(SOURCE.read_text(encoding="ascii"), filename=SOURCE.name, rom_size=ROM_SIZE)


def symbols() -> dict[str, int]:
    """Every label and constant in catch.asm with its value (a copy)."""
    return dict(_assembly().symbols)


def global_checksum(rom: bytes | bytearray) -> int:
    """The 16-bit sum of every byte of the image except the two checksum bytes."""
    total = sum(rom) - rom[GLOBAL_CHECKSUM_AT] - rom[GLOBAL_CHECKSUM_AT + 1]
    return total & 0xFFFF


def build_rom(out: Path | str | None = None) -> bytes:
    """Assemble catch.asm into a 32 KiB cartridge with both checksums filled in.

    With `out`, also write it there (atomically: a reader sees the old file or the new).
    """
    rom = bytearray(_assembly().rom)
    rom[HEADER_CHECKSUM_AT] = header_checksum(rom)
    check = global_checksum(rom)
    rom[GLOBAL_CHECKSUM_AT] = check >> 8
    rom[GLOBAL_CHECKSUM_AT + 1] = check & 0xFF
    image = bytes(rom)
    if out is not None:
        with atomic_write(Path(out)) as handle:
            handle.write(image)
    return image


def _named(table: dict[str, str]) -> dict[str, int]:
    values = _assembly().symbols
    return {name: values[label] for name, label in table.items()}


RAM: dict[str, int] = _named(_RAM_LABELS)
"""WRAM address of each piece of game state (see the table above and README.md)."""

CONSTANTS: dict[str, int] = _named(_CONSTANT_LABELS)
"""Playfield geometry in screen pixels, from catch.asm's EQUs."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oakemu_rl.envs.gbgame.build",
        description="Assemble the CATCH Game Boy cartridge.",
    )
    parser.add_argument("--out", type=Path, required=True, help="where to write the .gb file")
    args = parser.parse_args(argv)
    image = build_rom(args.out)
    print(f"wrote {args.out} ({len(image)} bytes, {_assembly().used()} used)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
