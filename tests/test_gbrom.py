"""The CATCH cartridge: our SM83 assembler, the ROM it builds, and the game running on the
real emulator (headless, no mocks)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest

from oakemu_rl.envs.gbgame import build
from oakemu_rl.envs.gbgame.asm import AsmError, assemble
from oakemu_rl.envs.gbgame.build import CONSTANTS, RAM, build_rom, symbols

# The 48-byte logo bitmap every cartridge carries at $0104 (from the hardware docs).
LOGO = bytes.fromhex(
    "CEED6666CC0D000B03730083000C000D0008111F8889000EDCCC6EE6DDDDD999BBBB67636E0EECCCDDDC999FBBB9333E"
)


def code(body: str, org: int = 0x0200) -> bytes:
    """Assemble `body` at `org` and return the bytes it produced."""
    result = assemble(f'SECTION "t", ROM0[${org:04X}]\n{body}\n', rom_size=0x8000)
    (_name, _kind, start, end) = result.sections[0]
    return result.rom[start:end]


# ---------------------------------------------------------------------------------------
# Assembler
# ---------------------------------------------------------------------------------------

# Each line and the bytes the SM83 opcode table gives for it (written out by hand).
ENCODINGS = [
    ("nop", "00"),
    ("ld a, $12", "3E 12"),
    ("ld b, c", "41"),
    ("ld [hl], a", "77"),
    ("ld [hl], $FF", "36 FF"),
    ("ld a, [hl+]", "2A"),
    ("ld [hl-], a", "32"),
    ("ld a, [de]", "1A"),
    ("ld [bc], a", "02"),
    ("ld hl, $C000", "21 00 C0"),
    ("ld sp, $FFFE", "31 FE FF"),
    ("ld [$C005], a", "EA 05 C0"),
    ("ld a, [$C005]", "FA 05 C0"),
    ("ld [$C100], sp", "08 00 C1"),
    ("ldh [$FF40], a", "E0 40"),
    ("ldh a, [$44]", "F0 44"),
    ("ld [c], a", "E2"),
    ("ld a, [$FF00+c]", "F2"),
    ("ld hl, sp+2", "F8 02"),
    ("ld hl, sp-2", "F8 FE"),
    ("ld sp, hl", "F9"),
    ("push af", "F5"),
    ("pop bc", "C1"),
    ("inc [hl]", "34"),
    ("inc hl", "23"),
    ("dec de", "1B"),
    ("dec a", "3D"),
    ("add hl, de", "19"),
    ("add sp, -2", "E8 FE"),
    ("add a, b", "80"),
    ("add 7", "C6 07"),
    ("adc 1", "CE 01"),
    ("sub [hl]", "96"),
    ("sbc a, e", "9B"),
    ("and $0F", "E6 0F"),
    ("xor a", "AF"),
    ("or c", "B1"),
    ("cp 144", "FE 90"),
    ("jp $0150", "C3 50 01"),
    ("jp nz, $1234", "C2 34 12"),
    ("jp c, $1234", "DA 34 12"),
    ("jp hl", "E9"),
    ("call $0200", "CD 00 02"),
    ("call c, $0200", "DC 00 02"),
    ("ret", "C9"),
    ("ret nc", "D0"),
    ("ret z", "C8"),
    ("reti", "D9"),
    ("rst $38", "FF"),
    ("swap a", "CB 37"),
    ("bit 7, h", "CB 7C"),
    ("res 0, [hl]", "CB 86"),
    ("set 3, e", "CB DB"),
    ("srl b", "CB 38"),
    ("rl c", "CB 11"),
    ("halt", "76"),
    ("stop", "10 00"),
    ("di", "F3"),
    ("ei", "FB"),
    ("daa", "27"),
    ("cpl", "2F"),
    ("rlca", "07"),
]


@pytest.mark.parametrize(("line", "expected"), ENCODINGS)
def test_encodes_documented_bytes(line: str, expected: str) -> None:
    assert code(f"    {line}").hex(" ").upper() == expected


def test_labels_jumps_data_and_expressions() -> None:
    source = """
X       EQU (3 + 4) * 2 << 1        ; 28
Y       EQU $F0 | %1010 & $0F       ; & binds tighter than |: $FA
DEF Z   EQU -1 & $FF
Top:    nop                         ; $0200
        jr z, .skip                 ; $0201: forward, +1
        nop                         ; $0203
.skip:  jr Top                      ; $0204: back to $0200 is -6
        dw Top, $BEEF               ; $0206
        db LOW(Top + 1), HIGH(Top), %101, 'A', "hi", X, Y, Z
        ds 3, $AA
        jr @                        ; a jump to itself
        ld a, Top.skip - Top        ; a local label from outside its scope
"""
    result = assemble(f'SECTION "t", ROM0[$0200]\n{source}', rom_size=0x8000)
    assert result.symbols["X"] == 28
    assert result.symbols["Y"] == 0xFA
    assert result.symbols["Z"] == 0xFF
    assert result.symbols["Top.skip"] == 0x0204
    expected = "00 28 01 00 18 FA 00 02 EF BE 01 02 05 41 68 69 1C FA FF AA AA AA 18 FE 3E 04"
    assert result.rom[0x200 : 0x200 + 26].hex(" ").upper() == expected


def test_ram_sections_only_reserve_space() -> None:
    result = assemble(
        'SECTION "vars", WRAM0[$C000]\nwA: ds 2\nwB: ds 1\n'
        'SECTION "more", WRAM0\nwC: ds 1\n'
        'SECTION "code", ROM0[$0150]\n ld a, [wC]\n',
        rom_size=0x8000,
    )
    assert (result.symbols["wA"], result.symbols["wB"], result.symbols["wC"]) == (
        0xC000,
        0xC002,
        0xC003,
    )
    assert result.rom[0x150:0x153] == bytes([0xFA, 0x03, 0xC0])
    assert not any(result.rom[:0x150])  # reserving RAM wrote nothing into the image


def _mnemonic_source(name: str) -> str | None:
    """The emulator's decode-table name for an opcode ("LD (a16),A") in our syntax."""
    if not name or name.startswith("PREFIX") or "illegal" in name.lower():
        return None
    text = name.lower().replace("stop 0", "stop")
    text = re.sub(r"rst (\w\w)h", r"rst $\1", text)
    text = text.replace("(", "[").replace(")", "]").replace("jp [hl]", "jp hl")
    text = text.replace("d16", "$1234").replace("a16", "$1234").replace("d8", "$56")
    text = text.replace("[a8]", "[$ff56]").replace("sp+r8", "sp+5").replace("sp,r8", "sp,5")
    text = text.replace("r8", "@+7")  # relative jumps: a target just ahead
    return text.replace(",", ", ")


def test_every_opcode_agrees_with_the_emulators_decode_table() -> None:
    """Assemble each of the 500 documented instructions from the emulator's own opcode
    names and check the opcode byte and the length."""
    opcodes = pytest.importorskip("pyboy.core.opcodes")
    names = list(opcodes.CPU_COMMANDS)
    assert len(names) == 512
    checked = 0
    for number, name in enumerate(names):
        source = _mnemonic_source(name)
        if source is None:
            continue
        out = code(f"    {source}")
        prefix = [] if number < 0x100 else [0xCB]
        assert list(out[: len(prefix) + 1]) == [*prefix, number & 0xFF], (name, source)
        if prefix:
            length = 2
        elif any(tag in name for tag in ("d16", "a16")):
            length = 3
        elif any(tag in name for tag in ("d8", "a8", "r8")) or name.startswith("STOP"):
            length = 2
        else:
            length = 1
        assert len(out) == length, (name, source, out.hex())
        checked += 1
    assert checked == 500  # 245 base opcodes (11 are unused, one is the prefix) + 256 CB


BAD_SOURCES = [
    ("    nop\n    mov a, b", 3, "unknown mnemonic 'mov'"),
    ("    ld [bc], b", 2, "bad operands for ld"),
    ("    jp Nowhere", 2, "undefined symbol Nowhere"),
    ("Top:\n    jr Far\n    ds 200\nFar:\n    nop", 3, "relative jump"),
    ("    db 256", 2, "does not fit in a byte"),
    ("    ld a, 300", 2, "out of range"),
    ("    bit 8, a", 2, "bit number 8 out of range"),
    ("    rst $09", 2, "rst vector"),
    ("    ld [hl], [hl]", 2, "does not exist"),
    (".loop:\n    nop", 2, "local label .loop before any global label"),
    ("A1:\n    nop\nA1:\n    nop", 4, "A1 is defined twice"),
    ("    ld a, (1 + ", 2, "ends too early"),
    ('    nop\nSECTION "x", ROM0[$0200]\n    nop', 4, "overlaps bytes from line 2"),
    ('SECTION "w", WRAM0[$C000]\n    nop', 3, "RAM sections only take labels and ds"),
    ("N EQU Later + 1\nLater EQU 3", 2, "undefined symbol Later"),
]


@pytest.mark.parametrize(("body", "line", "reason"), BAD_SOURCES)
def test_bad_source_is_refused_naming_the_line(body: str, line: int, reason: str) -> None:
    source = f'SECTION "t", ROM0[$0200]\n{body}\n'
    with pytest.raises(AsmError) as caught:
        assemble(source, filename="t.asm", rom_size=0x8000)
    assert caught.value.line == line
    assert str(caught.value).startswith(f"t.asm:{line}: ")
    assert reason in str(caught.value)


# ---------------------------------------------------------------------------------------
# The cartridge
# ---------------------------------------------------------------------------------------


def test_rom_header_and_checksums() -> None:
    rom = build_rom()
    assert len(rom) == 0x8000
    assert rom[0x100:0x104] == bytes([0x00, 0xC3]) + symbols()["Start"].to_bytes(2, "little")
    assert rom[0x104:0x134] == LOGO
    assert rom[0x134:0x144] == b"OAKCATCH" + bytes(8)
    assert (rom[0x147], rom[0x148], rom[0x149]) == (0, 0, 0)  # ROM only, 32 KiB, no RAM
    check = 0
    for byte in rom[0x134:0x14D]:
        check = (check - byte - 1) & 0xFF
    assert rom[0x14D] == check
    total = (sum(rom[:0x14E]) + sum(rom[0x150:])) & 0xFFFF
    assert rom[0x14E:0x150] == total.to_bytes(2, "big")


def test_build_is_deterministic_and_writes_atomically(tmp_path: Path) -> None:
    first = build_rom()
    build._assembly.cache_clear()  # assemble again from the source, not from the cache
    assert build_rom() == first
    out = tmp_path / "roms" / "catch.gb"
    assert build.main(["--out", str(out)]) == 0
    assert out.read_bytes() == first
    assert [p.name for p in out.parent.iterdir()] == ["catch.gb"]  # no temporary left


def test_ram_map_comes_from_the_source() -> None:
    table = symbols()
    assert RAM["score"] == table["wScore"]
    assert RAM["lives"] == table["wLives"]
    assert RAM["game_over"] == table["wGameOver"]
    assert RAM["player_x"] == table["wPlayerX"]
    assert RAM["object_x"] == table["wObjectX"]
    assert RAM["object_y"] == table["wObjectY"]
    assert len(set(RAM.values())) == len(RAM)
    assert all(0xC000 <= address < 0xE000 for address in RAM.values())
    assert CONSTANTS["player_max_x"] == 160 - CONSTANTS["player_width"]


# ---------------------------------------------------------------------------------------
# On the emulator
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rom_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gb") / "catch.gb"
    build_rom(path)
    return path


class Game:
    """The emulator running CATCH, with the few calls the tests need."""

    def __init__(self, path: Path) -> None:
        pyboy = pytest.importorskip("pyboy")
        self.emu = pyboy.PyBoy(str(path), window="null", sound_emulated=False)
        self.emu.set_emulation_speed(0)  # the default (1) is real time, even headless
        self.held: set[str] = set()

    def ram(self, name: str) -> int:
        return self.emu.memory[RAM[name]]

    def ram16(self, name: str) -> int:
        return self.emu.memory[RAM[name]] | self.emu.memory[RAM[name] + 1] << 8

    def state(self) -> bytes:
        return bytes(self.emu.memory[RAM["score"] : RAM["misses"] + 1])

    def hold(self, *buttons: str) -> None:
        for button in self.held - set(buttons):
            self.emu.button_release(button)
        for button in set(buttons) - self.held:
            self.emu.button_press(button)
        self.held = set(buttons)

    def run(self, frames: int, render: bool = False) -> None:
        self.emu.tick(frames, render)

    def screen(self) -> np.ndarray:
        self.emu.tick(1, True)
        return self.emu.screen.ndarray[:, :, :3].copy()

    def boot(self) -> Game:
        """Run until the game has set itself up (lives = 3)."""
        for _ in range(300):
            self.run(1)
            if self.ram("lives") == CONSTANTS["start_lives"]:
                return self
        raise AssertionError("the game did not start within 300 frames")

    def chase(self) -> None:
        """One frame of the scripted player: steer the basket under the ball."""
        target = self.ram("object_x") + 4 - CONSTANTS["player_width"] // 2
        x = self.ram("player_x")
        if x < target - 1:
            self.hold("right")
        elif x > target + 1:
            self.hold("left")
        else:
            self.hold()
        self.run(1)

    def close(self) -> None:
        self.emu.stop(save=False)


@pytest.fixture
def game(rom_path: Path):
    running = Game(rom_path)
    yield running
    running.close()


def basket_columns(screen: np.ndarray) -> np.ndarray:
    """Screen columns with dark pixels in the basket's rows."""
    y = CONSTANTS["player_y"]
    rows = screen[y : y + 8].min(axis=2)
    return np.flatnonzero((rows < 128).any(axis=0))


def test_emulator_boots_the_cartridge(game: Game) -> None:
    assert game.emu.cartridge_title == "OAKCATCH"
    game.boot()
    assert game.ram("game_over") == 0
    assert game.ram("score") == 0
    assert game.ram("player_x") == symbols()["START_X"]
    y = game.ram("object_y")
    game.run(5)
    assert game.ram("object_y") == y + 5  # one pixel a frame
    assert game.ram("frames") > 0


def test_holding_right_moves_the_basket_right(game: Game) -> None:
    game.boot()
    start_x = game.ram("player_x")
    saved = io.BytesIO()
    game.emu.save_state(saved)

    game.hold("right")
    game.run(10)
    step = CONSTANTS["player_step"]
    assert game.ram("player_x") == start_x + 10 * step
    game.run(60)
    assert game.ram("player_x") == CONSTANTS["player_max_x"]  # stops at the right edge
    right = game.screen()

    saved.seek(0)
    game.emu.load_state(saved)
    game.hold("left")
    game.run(70)
    assert game.ram("player_x") == 0
    left = game.screen()

    assert not np.array_equal(left, right)
    right_cols, left_cols = basket_columns(right), basket_columns(left)
    assert right_cols.min() >= CONSTANTS["player_max_x"] - step
    assert left_cols.max() < CONSTANTS["player_width"] + step
    assert len(right_cols) >= 12 and len(left_cols) >= 12


def test_scripted_player_scores(game: Game) -> None:
    game.boot()
    for _ in range(2000):
        game.chase()
    score = game.ram16("score")
    assert score >= 12  # a ball takes ~115 frames from spawn to catch
    assert game.ram("catches") == score
    assert game.ram("lives") == CONSTANTS["start_lives"]
    assert game.ram("misses") == 0
    bcd = game.ram("score_bcd")
    assert (bcd >> 4) * 10 + (bcd & 0xF) == score  # the displayed digits agree


def test_idle_player_loses_every_life_then_the_game_stops(game: Game) -> None:
    game.boot()
    game.hold("left")  # park the basket at x = 0, where no ball ever falls
    lives_seen = [game.ram("lives")]
    for _ in range(600):
        game.run(1)
        if game.ram("lives") != lives_seen[-1]:
            lives_seen.append(game.ram("lives"))
        if game.ram("game_over"):
            break
    assert game.ram("game_over") == 1
    assert lives_seen == [3, 2, 1, 0]
    assert game.ram("score") == 0 and game.ram("misses") == 3
    # three falls of (GROUND_Y - SPAWN_Y) frames each
    assert game.ram16("frames") == 3 * (CONSTANTS["ground_y"] - symbols()["SPAWN_Y"])

    game.run(2)  # let the last picture (ball hidden, lives 0) reach the screen
    frozen = game.state()
    before = game.screen()
    game.hold("right")
    game.run(60)
    after = game.screen()
    assert game.state()[: RAM["joypad"] - RAM["score"]] == frozen[: RAM["joypad"] - RAM["score"]]
    assert game.state()[RAM["frames"] - RAM["score"] :] == frozen[RAM["frames"] - RAM["score"] :]
    assert np.array_equal(before, after)


def test_doing_nothing_reaches_game_over(game: Game) -> None:
    game.boot()
    for _ in range(40):  # at most 40 balls of ~130 frames each
        game.run(130)
        if game.ram("game_over"):
            break
    assert game.ram("game_over") == 1
    assert game.ram("lives") == 0


def _play(game: Game, frames: int) -> list[bytes]:
    """A fixed input script: chase the ball, but run away from it for the last half second
    of every three (so it both catches and misses)."""
    trace = []
    for frame in range(frames):
        if frame % 180 >= 150:
            game.hold("left" if game.ram("object_x") > game.ram("player_x") else "right")
            game.run(1)
        else:
            game.chase()
        trace.append(game.state())
    return trace


def test_save_state_round_trip(game: Game) -> None:
    game.boot()
    _play(game, 100)
    saved = io.BytesIO()
    game.emu.save_state(saved)
    held = set(game.held)

    first = _play(game, 400)
    first_screen = game.screen()
    saved.seek(0)
    game.emu.load_state(saved)
    game.hold(*held)
    second = _play(game, 400)
    assert second == first
    assert np.array_equal(game.screen(), first_screen)
    assert len({row[RAM["object_x"] - RAM["score"]] for row in first}) > 1  # balls moved on


def _spawned_columns(trace: list[bytes]) -> list[int]:
    """The column (ball x) of each ball, in the order they appeared."""
    x_at, y_at = RAM["object_x"] - RAM["score"], RAM["object_y"] - RAM["score"]
    return [row[x_at] for row in trace if row[y_at] == symbols()["SPAWN_Y"]]


def test_same_inputs_same_game_different_inputs_different_balls(rom_path: Path) -> None:
    games = [Game(rom_path).boot() for _ in range(3)]
    try:
        chased = [_play(games[0], 1500), _play(games[1], 1500)]
        assert chased[0] == chased[1]  # same inputs from power-on: the same game
        idle = []
        for _ in range(1500):
            games[2].run(1)
            idle.append(games[2].state())
        balls, idle_balls = _spawned_columns(chased[0]), _spawned_columns(idle)
        assert len(balls) >= 10 and len(idle_balls) >= 3
        assert balls[1:4] != idle_balls[1:4]  # other inputs: other balls
        assert len(set(balls)) >= 5  # the balls do not keep to a few columns
    finally:
        for each in games:
            each.close()
