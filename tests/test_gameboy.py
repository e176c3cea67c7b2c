"""The Game Boy backend on the real emulator (PyBoy, headless): frames, RAM rewards and
episode ends from game configs, config errors, save states, worker-process vector envs,
the ROM store and the env spec. No mocks; CATCH (built from the project's own source) is
the ROM, and other ROMs are variants of it with a changed header.

Every test gets a fresh, empty ROM store (conftest's `rom_store`).
"""

from __future__ import annotations

import copy
import io
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from oakemu_rl.agents.scripted_catch import CatchDemonstrator
from oakemu_rl.cli import cli
from oakemu_rl.envs import (
    EnvSpec,
    action_mask,
    action_meanings,
    gameboy,
    gameconfig,
    make_env,
    make_vector_env,
    roms,
)
from oakemu_rl.envs.gameconfig import (
    Cells,
    EndCondition,
    GameConfigError,
    RewardTerm,
    RewardTracker,
)
from oakemu_rl.envs.gbgame import build
from oakemu_rl.envs.gbgame.build import CONSTANTS, RAM, build_rom
from oakemu_rl.errors import EnvError

CATCH_TOML = gameconfig.shipped_games()["catch"]
POKEMON_TOML = gameconfig.shipped_games()["pokemon_red"]
# Deterministic emulation: no random NOOPs at the start, no sticky actions.
DET = {"noop_max": 0, "repeat_action_probability": 0.0}
NOOP, LEFT, RIGHT = 0, 1, 2
STEP_PIXELS = CONSTANTS["player_step"] * 4  # basket pixels per agent step (4 frames held)


def ram(env, name: str) -> int:
    return env.unwrapped.memory(RAM[name])


def ram16(env, name: str) -> int:
    return ram(env, name) | env.unwrapped.memory(RAM[name] + 1) << 8


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text


def user_config(tmp_path: Path, *, name: str = "mycatch", max_steps: int = 600,
                rewards: str = "", ends: str = '[[ends]]\naddress = "game_over"\nequals = 1\n',
                start: str = '[start]\nmode = "boot"\nboot_frames = 80\n') -> Path:
    """A catch config of one's own, written as TOML (what --game-config reads)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[game]
name = "{name}"
title = "OAKCATCH"
frames_per_action = 4
max_steps = {max_steps}
lives = "lives"

[symbols]
score = 0x{RAM["score"]:04X}
lives = 0x{RAM["lives"]:04X}
game_over = 0x{RAM["game_over"]:04X}
misses = 0x{RAM["misses"]:04X}
player_x = 0x{RAM["player_x"]:04X}

[actions]
buttons = ["NOOP", "LEFT", "RIGHT"]

{rewards}
{ends}
{start}
""")
    return path


def variant_rom(title: bytes = b"OAKCATCX", *, same_header: bool = False) -> bytes:
    """CATCH with another header title (header checksum fixed), or with the same header and
    other global checksum bytes (same title, another sha256)."""
    rom = bytearray(build_rom())
    if same_header:
        rom[build.GLOBAL_CHECKSUM_AT] ^= 0xFF
        return bytes(rom)
    rom[0x134:0x134 + 16] = title.ljust(16, b"\x00")
    rom[build.HEADER_CHECKSUM_AT] = build.header_checksum(rom)
    return bytes(rom)


def emulator_state(env) -> bytes:
    out = io.BytesIO()
    env.unwrapped.emulator.save_state(out)
    return out.getvalue()


def play(env, actions) -> tuple[list[np.ndarray], list[list[int]]]:
    """Step `actions`; each step's observation and (player_x, object_x, object_y, score)."""
    frames, rams = [], []
    for action in actions:
        obs, *_ = env.step(action)
        frames.append(obs)
        rams.append([ram(env, k) for k in ("player_x", "object_x", "object_y", "score")])
    return frames, rams


# -- 1. frames follow the buttons ---------------------------------------------------------


def test_holding_right_or_left_moves_the_basket_and_changes_the_frames():
    spec = EnvSpec(game="catch", **DET)
    starts, finals, xs = [], {}, {}
    for action in (RIGHT, LEFT):
        env = make_env(spec)
        obs, _ = env.reset(seed=7)
        starts.append(obs)
        x0 = ram(env, "player_x")
        for _ in range(4):
            obs, *_ = env.step(action)
        finals[action], xs[action] = obs, (x0, ram(env, "player_x"))
        env.close()
    assert np.array_equal(starts[0], starts[1]), "one seed, one start"
    assert xs[RIGHT] == (72, 72 + 4 * STEP_PIXELS)
    assert xs[LEFT] == (72, 72 - 4 * STEP_PIXELS)
    assert finals[RIGHT].shape == (4, 84, 84) and finals[RIGHT].dtype == np.uint8
    assert not np.array_equal(finals[RIGHT][-1], finals[LEFT][-1])
    # The newest frame moved on from the one before (the basket is drawn where RAM says).
    assert not np.array_equal(finals[RIGHT][-1], finals[RIGHT][-2])


def test_reset_stack_and_render():
    env = make_env(EnvSpec(game="catch", **DET))
    obs, info = env.reset(seed=0)
    assert not obs[:-1].any() and obs[-1].any()
    assert info == {"lives": CONSTANTS["start_lives"]}
    screen = env.render()
    assert screen.shape == (144, 160, 3) and screen.dtype == np.uint8 and screen.any()
    with pytest.raises(EnvError, match="out of range"):
        env.step(3)
    env.close()


# -- 2. rewards and episode ends follow the config ------------------------------------------


def test_scripted_games_reward_sum_is_catches_minus_misses():
    spec = EnvSpec(game="catch", noop_max=0, repeat_action_probability=0.25)
    env = make_env(spec)
    player = CatchDemonstrator(spec, seed=1, noise=0.7)
    obs, info = env.reset(seed=1)
    player.reset(env, 1)
    total, steps, done = 0.0, 0, False
    while not done:
        obs, reward, terminated, truncated, info = env.step(player.act(env, obs))
        total += reward
        steps += 1
        done = terminated or truncated
        assert info["lives"] == ram(env, "lives")
    catches, misses = ram16(env, "score"), ram(env, "misses")
    assert catches > 0 and misses > 0, "the noisy player should both catch and miss"
    assert total == catches - misses
    assert truncated != terminated
    assert terminated == (ram(env, "game_over") == 1)
    assert steps == 600 or terminated  # catch.toml: max_steps = 600
    env.close()


def test_a_noop_player_loses_and_the_episode_ends_when_game_over_is_set():
    env = make_env(EnvSpec(game="catch", **DET))
    env.reset(seed=0)
    total, steps = 0.0, 0
    while True:
        _obs, reward, terminated, truncated, info = env.step(NOOP)
        total += reward
        steps += 1
        assert not truncated
        assert terminated == (ram(env, "game_over") == 1)
        if terminated:
            break
        assert steps < 600
    assert ram(env, "misses") == CONSTANTS["start_lives"]
    assert info["lives"] == 0
    assert total == ram16(env, "score") - CONSTANTS["start_lives"]
    env.close()


def test_max_steps_and_max_episode_frames_truncate(tmp_path):
    env = make_env(EnvSpec(game_config=str(user_config(tmp_path, max_steps=7)), **DET))
    env.reset(seed=0)
    ends = [env.step(RIGHT)[2:4] for _ in range(7)]
    assert ends == [(False, False)] * 6 + [(False, True)]
    env.close()
    env = make_env(EnvSpec(game="catch", max_episode_frames=5 * 4, **DET))
    env.reset(seed=0)
    ends = [env.step(LEFT)[2:4] for _ in range(5)]
    assert ends == [(False, False)] * 4 + [(False, True)]
    env.close()


def test_a_user_config_changes_the_rewards(tmp_path):
    rewards = """
[[rewards]]
address = "score"
width = 2
kind = "increase"
weight = 10.0

[[rewards]]
address = "misses"
kind = "change"
weight = -0.5

[[rewards]]
address = "player_x"
kind = "new_value"
weight = 0.25
"""
    spec = EnvSpec(game_config=str(user_config(tmp_path, rewards=rewards)), **DET)
    assert spec.game == "mycatch" and spec.env_id == "GB/mycatch"
    env = make_env(spec)
    env.reset(seed=2)
    seen = {ram(env, "player_x")}
    score0, misses0 = ram16(env, "score"), ram(env, "misses")
    rng = np.random.default_rng(0)
    total = expected_x = 0.0
    for _ in range(120):
        _obs, reward, terminated, truncated, _info = env.step(int(rng.integers(0, 3)))
        x = ram(env, "player_x")
        expected_x += 0.25 * (x not in seen)
        seen.add(x)
        total += reward
        if terminated or truncated:
            break
    catches, misses = ram16(env, "score") - score0, ram(env, "misses") - misses0
    assert misses > 0 and len(seen) > 3
    assert total == pytest.approx(10.0 * catches - 0.5 * misses + expected_x)
    env.close()


def test_reward_clipping_gives_the_sign(tmp_path):
    rewards = '[[rewards]]\naddress = "misses"\nkind = "increase"\nweight = -7.0\n'
    spec = EnvSpec(game_config=str(user_config(tmp_path, rewards=rewards)),
                   reward_clipping=True, **DET)
    env = make_env(spec)
    env.reset(seed=0)
    rewards_seen = {env.step(NOOP)[1] for _ in range(120)}
    assert rewards_seen == {0.0, -1.0}
    env.close()


# -- 3. RewardTracker on synthetic memory --------------------------------------------------


def tracker(memory: bytearray, *terms: RewardTerm) -> RewardTracker:
    track = RewardTracker(terms, memory.__getitem__)
    track.reset()
    return track


def term(addresses, kind, weight=1.0, width=1, endian="little", name="") -> RewardTerm:
    return RewardTerm(Cells(tuple(addresses), width, endian), kind, weight, name)


def test_tracker_change_and_increase():
    memory = bytearray(0x10000)
    track = tracker(memory, term([0xC000], "change", name="c"),
                    term([0xC001], "increase", weight=2.0, name="i"))
    memory[0xC000], memory[0xC001] = 5, 3
    assert track.step() == (11.0, {"c": 5.0, "i": 6.0})
    memory[0xC000], memory[0xC001] = 2, 1  # drops: change pays it, increase does not
    assert track.step() == (-3.0, {"c": -3.0, "i": 0.0})
    memory[0xC001] = 4  # increase is measured from the last value, not the best
    assert track.step() == (6.0, {"c": 0.0, "i": 6.0})
    assert track.step() == (0.0, {"c": 0.0, "i": 0.0})


def test_tracker_width_two_in_both_byte_orders():
    memory = bytearray(0x10000)
    little = term([0xC010], "change", width=2, endian="little")
    big = term([0xC010], "change", width=2, endian="big")
    assert little.cells.values(memory.__getitem__) == [0]
    memory[0xC010], memory[0xC011] = 0x34, 0x12
    assert little.cells.values(memory.__getitem__) == [0x1234]
    assert big.cells.values(memory.__getitem__) == [0x3412]
    memory[:] = bytes(0x10000)
    track = tracker(memory, little)
    memory[0xC010] = 0xFF
    assert track.step()[0] == 255
    memory[0xC010], memory[0xC011] = 0x00, 0x01  # a carry into the high byte: +1, not -255
    assert track.step()[0] == 1
    track = tracker(memory, big)  # big endian reads $00 $01 as $0001
    memory[0xC010] = 0x02  # $0201: +$0200
    assert track.step()[0] == 0x0200
    assert big.cells.values(memory.__getitem__) == [0x0201]


def test_tracker_bits_over_a_counted_range_and_an_address_list():
    memory = bytearray(0x10000)
    config = gameconfig.parse({
        "game": {"name": "t", "title": "T"}, "actions": {"buttons": ["NOOP"]},
        "rewards": [{"address": 0xD000, "count": 4, "kind": "bits", "weight": 0.5},
                    {"addresses": [0xD100, 0xD180], "kind": "change"}]})
    flags, listed = config.rewards
    assert flags.cells.addresses == (0xD000, 0xD001, 0xD002, 0xD003)
    assert listed.cells.addresses == (0xD100, 0xD180)
    track = tracker(memory, *config.rewards)
    memory[0xD000] = 0b1011  # 3 bits
    memory[0xD003] = 0x80  # 1 bit, last cell of the range
    memory[0xD004] = 0xFF  # past the range: not counted
    assert track.step()[0] == 0.5 * 4
    memory[0xD000] = 0b0001  # 2 bits cleared
    memory[0xD100], memory[0xD180] = 3, 4  # the list's cells add up
    assert track.step()[0] == 0.5 * -2 + 7
    memory[0xD101] = 9  # between the listed cells: not read
    assert track.step()[0] == 0


def test_tracker_new_value_and_new_position_pay_once_per_episode():
    memory = bytearray(0x10000)
    track = tracker(memory, term([0xC020], "new_value", name="v"),
                    term([0xC030, 0xC031, 0xC032], "new_position", weight=0.5, name="p"))
    rewards = []
    for value, position in [(0, (0, 0, 0)), (1, (0, 1, 0)), (1, (0, 1, 0)), (2, (1, 1, 0)),
                            (0, (0, 0, 0)), (1, (0, 1, 1)), (2, (0, 0, 1))]:
        memory[0xC020] = value
        memory[0xC030:0xC033] = bytes(position)
        rewards.append(track.step()[1])
    assert [r["v"] for r in rewards] == [0, 1, 0, 1, 0, 0, 0]
    assert [r["p"] for r in rewards] == [0, 0.5, 0, 0.5, 0, 0.5, 0.5]
    track.reset()  # a new episode: only where it starts counts as seen
    memory[0xC020] = 1
    assert track.step()[1]["v"] == 1


def test_pokemon_red_config_parses_and_rewards_badges_levels_events_and_maps():
    config = gameconfig.load(POKEMON_TOML)
    assert (config.name, config.title) == ("pokemon_red", "POKEMON RED")
    assert (config.frames_per_action, config.press_frames) == (24, 8)
    assert config.meanings == ("NOOP", "DOWN", "LEFT", "RIGHT", "UP", "A", "B", "START")
    assert config.start_mode == "buttons" and config.start_buttons[0] == ("START", 120)
    assert [t.name for t in config.rewards] == ["badges", "levels", "events", "exploration"]
    events = config.rewards[2].cells.addresses
    assert (events[0], events[-1], len(events)) == (0xD747, 0xD87E, 312)
    memory = bytearray(0x10000)
    memory[0xD18C] = 5  # the starter at level 5
    memory[0xD35E], memory[0xD362], memory[0xD361] = 38, 3, 6  # map, x, y: the bedroom
    track = RewardTracker(config.rewards, memory.__getitem__)
    track.reset()
    assert track.step() == (0.0, {"badges": 0.0, "levels": 0.0, "events": 0.0,
                                  "exploration": 0.0})
    memory[0xD356] = 0b11  # two badges
    memory[0xD18C] = 7  # +2 levels
    memory[0xD1B8] = 3  # a second party member at level 3
    memory[0xD747] = 0b100  # one event at the first flag byte
    memory[0xD87E] = 0x80  # one at the last
    memory[0xD362] = 4  # one tile right
    total, parts = track.step()
    assert parts == {"badges": 20.0, "levels": 5.0, "events": 4.0, "exploration": 0.05}
    assert total == pytest.approx(29.05)
    memory[0xD362] = 3  # back to the starting tile: seen, no reward
    memory[0xD18C] = 6  # a level lower (a swap): increase does not punish
    assert track.step()[1] == {"badges": 0.0, "levels": 0.0, "events": 0.0,
                               "exploration": 0.0}
    memory[0xD35E] = 0  # same x, y on another map is a new position
    assert track.step()[1]["exploration"] == 0.05


def test_end_conditions():
    memory = bytearray(0x10000)
    read = memory.__getitem__
    equals = EndCondition(Cells((0xC005,)), equals=1)
    window = EndCondition(Cells((0xC000,), width=2), at_least=0x0100, at_most=0x0200)
    assert not equals.holds(read) and not window.holds(read)
    memory[0xC005], memory[0xC001] = 1, 0x01
    assert equals.holds(read) and window.holds(read)
    memory[0xC000] = 0x01  # $0101
    assert window.holds(read)
    memory[0xC001] = 0x02  # $0201
    assert not window.holds(read)


# -- 4. config errors name the key -----------------------------------------------------------


def _base() -> dict:
    return tomllib.loads(CATCH_TOML.read_text())


def _set(path: str, value):
    """A mutation setting a nested key, e.g. 'rewards.0.address'."""
    def mutate(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return mutate


_DELETE = object()


def _both(first, second):
    def mutate(data: dict) -> None:
        first(data)
        second(data)
    return mutate

CONFIG_ERRORS = [
    (_set("rewards.0.adress", 0xC000), "rewards[0].adress", "not a known key"),
    (_set("game.speed", 2), "game.speed", "not a known key"),
    (_set("extras", {}), "file.extras", "not a known key"),
    (_set("start.state_file", "x"), "start.state_file", "not a known key"),
    (_set("rewards.0.address", 0x0100), "rewards[0].address", "outside the Game Boy's RAM"),
    (_set("rewards.1.address", 0xE000), "rewards[1].address", "outside the Game Boy's RAM"),
    (_set("rewards.1.address", 0xFEA0), "rewards[1].address", "outside"),
    (_set("rewards.0.address", 0xDFFF), "rewards[0].address", "+2 bytes"),  # width 2
    (_both(_set("rewards.1.address", 0xDFF0), _set("rewards.1.count", 17)),
     "rewards[1].address", "$DFF0 (+17 bytes) is outside"),  # runs past $DFFF
    (_both(_set("rewards.1.address", _DELETE), _set("rewards.1.addresses", [0xC000, 0xE000])),
     "rewards[1].addresses[1]", "outside"),
    (_set("ends.0.address", 0x7FFF), "ends[0].address", "outside"),
    (_set("game.lives", 0x4000), "game.lives", "outside"),
    (_set("rewards.0.address", "scroe"), "rewards[0].address", "'scroe'"),
    (_set("rewards.0.kind", "delta"), "rewards[0].kind", "must be one of"),
    (_set("rewards.0.weight", "high"), "rewards[0].weight", "finite number"),
    (_set("rewards.0.width", 5), "rewards[0].width", "from 1 to 4"),
    (_set("rewards.0.endian", "middle"), "rewards[0].endian", "'little' or 'big'"),
    (_set("rewards.0.addresses", ["score"]), "rewards[0]", "exactly one of address"),
    (_set("rewards", {"address": "score"}), "rewards", "list of tables"),
    (_set("game.frames_per_action", "4"), "game.frames_per_action", "whole number"),
    (_set("game.frames_per_action", 100), "game.frames_per_action", "from 1 to 64"),
    (_set("game.press_frames", 5), "game.press_frames", "from 1 to 4"),
    (_set("game.max_steps", 0), "game.max_steps", "from 1"),
    (_set("game.name", 5), "game.name", "non-empty string"),
    (_set("symbols.score", "C000"), "symbols.score", "whole number"),
    (_set("ends.0.equals", _DELETE), "ends[0]", "needs equals"),
    (_set("actions.buttons", ["LEFT", "RIGHT"]), "actions.buttons", "starts with NOOP"),
    (_set("actions.buttons", ["NOOP", "LEFT", "JUMP"]), "actions.buttons[2]", "JUMP"),
    (_set("actions.buttons", ["NOOP", "LEFT", "LEFT"]), "actions.buttons[2]", "twice"),
    (_set("actions.combos", [["A", "Z"]]), "actions.combos[0]", "Z is not a Game Boy button"),
    (_set("actions", _DELETE), "[actions]", "is missing"),
    (_set("start.mode", "warp"), "start.mode", "must be one of"),
    (_set("start.buttons", [["PAUSE", 10]]), "start.buttons[0]", "[button, frames]"),
    (_set("start.mode", "state"), "start.state", "is missing"),
    (_both(_set("start.mode", "state"), _set("start.state_sha256", "abc")),
     "start.state_sha256", "64 hexadecimal"),
    (_set("screen", {"crop": [1, 2]}), "screen.crop", "[top, bottom, left, right]"),
]


@pytest.mark.parametrize(("mutate", "key", "says"), CONFIG_ERRORS,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(CONFIG_ERRORS)])
def test_config_errors_name_the_key(mutate, key, says):
    data = _base()
    mutate(data)
    with pytest.raises(GameConfigError) as caught:
        gameconfig.parse(data)
    text = one_line(caught.value)
    assert text.startswith(f"game config {key}:"), text
    assert says in text


def test_a_bad_config_file_is_refused_with_its_path_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(CATCH_TOML.read_text().replace('address = "misses"', "address = 0xE000"))
    with pytest.raises(GameConfigError) as caught:
        EnvSpec(game_config=str(bad))
    text = one_line(caught.value)
    assert str(bad) in text and "rewards[1].address" in text and "$E000" in text
    bad.write_text("[game\nname = 1")
    with pytest.raises(GameConfigError, match="not valid TOML"):
        EnvSpec(game_config=str(bad))
    with pytest.raises(GameConfigError, match="does not exist"):
        EnvSpec(game_config=str(tmp_path / "missing.toml"))
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(GameConfigError, match="cannot read"):
        EnvSpec(game_config=str(bad))


def test_env_spec_settings_that_belong_to_the_config_are_refused():
    with pytest.raises(EnvError, match="frames_per_action = 4"):
        EnvSpec(game="catch", frame_skip=8)
    with pytest.raises(EnvError, match="full_action_space is an Atari setting"):
        EnvSpec(game="catch", full_action_space=True)
    with pytest.raises(EnvError, match="64 hexadecimal"):
        EnvSpec(game="catch", rom_sha256="abc")
    with pytest.raises(EnvError, match="cannot forbid JUMP"):
        make_env(EnvSpec(game="catch", forbidden_actions=("JUMP",)))


# -- 5. save states -------------------------------------------------------------------------


def test_a_save_state_round_trips_frames_and_ram():
    spec = EnvSpec(game="catch", **DET)
    env = make_env(spec)
    env.reset(seed=0)
    play(env, [RIGHT] * 3)
    state = roms.state_bytes(spec.rom_sha256, emulator_state(env))
    # Ends with NOOP: no release of RIGHT is pending when the state is loaded back.
    actions = [LEFT, LEFT, NOOP, RIGHT, NOOP, NOOP, LEFT, RIGHT, NOOP] * 3
    frames, rams = play(env, actions)
    gameboy._load_state(env.unwrapped.emulator, state, spec)
    again, rams_again = play(env, actions)
    assert rams_again == rams
    for a, b in zip(frames[4:], again[4:], strict=True):  # stacks of frames after the load
        assert np.array_equal(a, b)
    assert len({tuple(r) for r in rams}) > 5, "the game moved on between the frames"
    env.close()


def test_a_config_that_starts_from_a_state_file(tmp_path):
    spec = EnvSpec(game="catch", **DET)
    env = make_env(spec)
    env.reset(seed=0)
    play(env, [RIGHT] * 10)  # basket at the right edge, a state boot never reaches
    assert ram(env, "player_x") == CONSTANTS["player_max_x"]
    (tmp_path / "right.state").write_bytes(roms.state_bytes(spec.rom_sha256,
                                                            emulator_state(env)))
    env.close()
    start = '[start]\nmode = "state"\nstate = "right.state"\n'
    path = user_config(tmp_path, name="from_state", start=start)
    state_spec = EnvSpec(game_config=str(path), **DET)
    assert state_spec.gameboy_config.start_mode == "state"
    assert '"state_sha256"' in state_spec.game_config and "right.state" not in \
        state_spec.game_config  # the spec names the state by digest, never by path
    env = make_env(state_spec)
    for seed in (0, 1):
        env.reset(seed=seed)
        assert ram(env, "player_x") == CONSTANTS["player_max_x"]
        env.step(LEFT)
        assert ram(env, "player_x") == CONSTANTS["player_max_x"] - STEP_PIXELS
    env.close()
    # The spec alone finds the state again (in the store), as a checkpoint's spec would
    # in a new process (whose cache of start states is empty).
    gameboy._START_CACHE.clear()
    again = make_env(EnvSpec.from_json(state_spec.to_json()))
    again.reset(seed=0)
    assert ram(again, "player_x") == CONSTANTS["player_max_x"]
    again.close()


def test_a_state_saved_on_another_rom_is_refused(tmp_path):
    other = tmp_path / "other.gb"
    other.write_bytes(variant_rom(b"OAKCATCX"))
    other_sha, title = roms.add_rom(other)
    assert title == "OAKCATCX"
    catch = EnvSpec(game="catch", **DET)
    env = make_env(catch)
    env.reset(seed=0)
    (tmp_path / "foreign.state").write_bytes(roms.state_bytes(other_sha, emulator_state(env)))
    env.close()
    start = '[start]\nmode = "state"\nstate = "foreign.state"\n'
    env = make_env(EnvSpec(game_config=str(user_config(tmp_path, start=start)), **DET))
    with pytest.raises(roms.RomError) as caught:
        env.reset(seed=0)
    text = one_line(caught.value)
    assert "saved on another ROM" in text and other_sha[:12] in text
    env.close()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "trailing", "header"])
def test_a_damaged_state_is_refused(tmp_path, damage):
    spec = EnvSpec(game="catch", **DET)
    env = make_env(spec)
    env.reset(seed=0)
    body = emulator_state(env)
    env.close()
    data = {
        "truncated": roms.state_bytes(spec.rom_sha256, body[: len(body) // 3]),
        "garbage": roms.state_bytes(spec.rom_sha256,
                                    np.random.default_rng(0).bytes(len(body))),
        "trailing": roms.state_bytes(spec.rom_sha256, body + b"\x00junk"),
        "header": roms.STATE_MAGIC + b"{not json\n" + body,
    }[damage]
    (tmp_path / "bad.state").write_bytes(data)
    config = user_config(tmp_path, start='[start]\nmode = "state"\nstate = "bad.state"\n')
    with pytest.raises(roms.RomError) as caught:
        make_env(EnvSpec(game_config=str(config), **DET)).reset(seed=0)
    text = one_line(caught.value)
    assert ("damaged" if damage == "header" else "start state of mycatch") in text
    (tmp_path / "tiny.state").write_bytes(b"OAK")
    config = user_config(tmp_path, start='[start]\nmode = "state"\nstate = "tiny.state"\n')
    with pytest.raises(roms.RomError, match="is not a save state"):
        EnvSpec(game_config=str(config))
    config = user_config(tmp_path, start='[start]\nmode = "state"\nstate = "none.state"\n')
    with pytest.raises(roms.RomError, match="does not exist"):
        EnvSpec(game_config=str(config))


def test_a_state_missing_from_the_store_says_how_to_get_it():
    data = tomllib.loads(CATCH_TOML.read_text())
    data["start"] = {"mode": "state", "state_sha256": "ab" * 32}
    spec = EnvSpec(game_config=gameconfig.parse(data).to_json(), **DET)
    env = make_env(spec)
    with pytest.raises(roms.RomError) as caught:
        env.reset(seed=0)
    assert "--game-config" in one_line(caught.value)
    env.close()


# -- 6. worker envs agree with the single env ------------------------------------------------


@pytest.mark.parametrize("same_step_reset", [False, True])
def test_vector_env_matches_single_envs_seed_for_seed(same_step_reset):
    # Random NOOPs and sticky actions on, so each seed plays differently; 10-step episodes
    # so that the resets inside the run are compared too.
    spec = EnvSpec(game="catch", noop_max=8, repeat_action_probability=0.25,
                   max_episode_frames=40)
    n, seed, steps = 2, 11, 25
    actions = np.random.default_rng(0).integers(0, 3, size=(steps, n))
    vector = make_vector_env(spec, n, same_step_reset=same_step_reset)
    try:
        obs, info = vector.reset(seed=seed)
        assert obs.shape == (n, 4, 84, 84) and obs.dtype == np.uint8
        vector_run = [(obs.copy(), None, None, None, info["lives"].copy(), None)]
        for t in range(steps):
            obs, reward, terminated, truncated, info = vector.step(actions[t])
            if "final_obs" in info:
                assert same_step_reset and info["final_obs"].shape == obs.shape
            vector_run.append((obs.copy(), reward.copy(), terminated.copy(), truncated.copy(),
                               info["lives"].copy(),
                               info["final_obs"].copy() if "final_obs" in info else None))
    finally:
        vector.close()
    resets = 0
    for i in range(n):
        env = make_env(spec)
        obs, info = env.reset(seed=seed + i)
        assert np.array_equal(vector_run[0][0][i], obs), f"env {i}'s first observation"
        assert vector_run[0][4][i] == info["lives"]
        done = False
        for t in range(steps):
            final = None
            if done and not same_step_reset:  # next-step mode: this step only resets
                obs, info = env.reset()
                reward, terminated, truncated = 0.0, False, False
                resets += 1
            else:
                obs, reward, terminated, truncated, info = env.step(int(actions[t, i]))
            done = terminated or truncated
            if done and same_step_reset:
                final = obs
                obs, info = env.reset()
                resets += 1
            v_obs, v_reward, v_term, v_trunc, v_lives, v_final = vector_run[t + 1]
            assert np.array_equal(v_obs[i], obs), f"env {i} step {t}"
            assert (v_reward[i], v_term[i], v_trunc[i], v_lives[i]) == (
                reward, terminated, truncated, info["lives"]), f"env {i} step {t}"
            if final is not None:
                assert v_final is not None, f"env {i} step {t}: no final_obs"
                assert np.array_equal(v_final[i], final), f"env {i} step {t} final_obs"
            elif v_final is not None:
                assert not v_final[i].any(), f"env {i} step {t}: a final_obs for no end"
        env.close()
    assert resets >= 2 * n, "the run should cross episode ends"
    assert not np.array_equal(vector_run[5][0][0], vector_run[5][0][1])


# -- 7. ROMs ---------------------------------------------------------------------------------


def _not_roms(tmp_path: Path) -> dict[str, Path]:
    import h5py

    files = {}
    rng = np.random.default_rng(0)
    for name, data in [("random.bin", rng.bytes(0x8000)), ("tiny.gb", b"\x00" * 100),
                       ("text.gb", b"not a rom\n" * 50), ("odd_size.gb", build_rom()[:0x7000]),
                       ("zeros.gb", bytes(0x8000))]:
        (tmp_path / name).write_bytes(data)
        files[name] = tmp_path / name
    with h5py.File(tmp_path / "demos.h5", "w") as handle:
        handle.create_dataset("x", data=np.zeros(4096, dtype=np.uint8))
    files["demos.h5"] = tmp_path / "demos.h5"
    rom = bytearray(build_rom())
    rom[0x134] ^= 0x01  # the title changed, the header checksum not fixed
    (tmp_path / "bad_checksum.gb").write_bytes(rom)
    files["bad_checksum.gb"] = tmp_path / "bad_checksum.gb"
    return files


def test_check_rom_refuses_what_is_not_a_rom_in_one_line(tmp_path, rom_store):
    for name, path in _not_roms(tmp_path).items():
        with pytest.raises(roms.RomError) as caught:
            roms.add_rom(path)
        text = one_line(caught.value)
        assert str(path) in text, name
        assert ("header checksum" if name == "bad_checksum.gb" else "not a Game Boy ROM") \
            in text, (name, text)
    assert not list(rom_store.rglob("*.gb")), "nothing refused is kept"
    with pytest.raises(roms.RomError, match="does not exist"):
        roms.add_rom(tmp_path / "missing.gb")
    with pytest.raises(roms.RomError, match="cannot read"):
        roms.add_rom(tmp_path)
    assert roms.check_rom(build_rom(), "catch") == "OAKCATCH"


def test_random_files_with_a_lucky_header_checksum_are_still_not_roms():
    """1 in 256 random files has a matching header checksum byte; the logo must decide."""
    rng = np.random.default_rng(1)
    data = bytearray(rng.bytes(0x8000))
    data[roms.HEADER_CHECKSUM_AT] = roms.header_checksum(data)
    with pytest.raises(roms.RomError, match="not a Game Boy ROM"):
        roms.check_rom(bytes(data), "lucky.bin")


def test_a_game_without_its_rom_says_to_pass_it():
    with pytest.raises(roms.RomError) as caught:
        EnvSpec(game="pokemon_red")
    text = one_line(caught.value)
    assert "--rom PATH" in text and "POKEMON RED" in text
    with pytest.raises(EnvError, match="oakemu envs"):
        EnvSpec(game="pokemon_blue", backend="pyboy")


def test_add_rom_and_oakemu_envs_rom(tmp_path, rom_store):
    rom = tmp_path / "catch.gb"
    build_rom(rom)
    digest, title = roms.add_rom(rom)
    assert (digest, title) == (roms.sha256(build_rom()), "OAKCATCH")
    assert not list(rom_store.rglob("*.gb")), "the built-in ROM needs no copy"
    other = tmp_path / "other.gb"
    other.write_bytes(variant_rom(b"OAKCATCX"))
    result = CliRunner().invoke(cli, ["envs", "--rom", str(other)])
    assert result.exit_code == 0, result.output
    assert "'OAKCATCX'" in result.output
    stored = rom_store / f"{roms.sha256(other.read_bytes())}.gb"
    assert stored.read_bytes() == other.read_bytes()
    rows = dict(line.split(None, 1) for line in result.output.splitlines()[1:])
    assert rows["catch"].strip() == "Game Boy"
    assert rows["pokemon_red"].strip() == "Game Boy, needs --rom PATH"
    assert rows["pong"].strip() == "Atari"
    # The stored ROM runs by its sha256 under a config made for its title.
    path = tmp_path / "x.toml"
    path.write_text(CATCH_TOML.read_text().replace('"OAKCATCH"', '"OAKCATCX"')
                    .replace('name = "catch"', 'name = "catchx"'))
    env = make_env(EnvSpec(game_config=str(path), **DET))
    env.reset(seed=0)
    assert env.step(RIGHT)[0].shape == (4, 84, 84)
    env.close()
    # A ROM of another title under the catch config is refused.
    with pytest.raises(roms.RomError, match="titled 'OAKCATCX'"):
        EnvSpec(game="catch", rom_sha256=roms.sha256(other.read_bytes()))


@pytest.mark.parametrize("name", ["random.bin", "bad_checksum.gb", "demos.h5", "missing.gb"])
def test_oakemu_envs_refuses_a_bad_rom_in_one_error_line(tmp_path, name):
    _not_roms(tmp_path)
    result = CliRunner().invoke(cli, ["envs", "--rom", str(tmp_path / name)])
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and result.output.strip().splitlines()[-1] == errors[0]
    assert "Traceback" not in result.output and name in errors[0]


def test_a_spec_whose_rom_is_not_here_says_to_pass_it(tmp_path):
    # Another machine's catch build: same title, another sha256 (the one here is a third).
    here = tmp_path / "here.gb"
    here.write_bytes(variant_rom(same_header=True))
    roms.add_rom(here)
    elsewhere = roms.sha256(variant_rom(same_header=True) + bytes(0x4000))
    spec = EnvSpec(game="catch", rom_sha256=elsewhere)
    assert spec.rom_title == "OAKCATCH" and spec.rom_sha256 == elsewhere
    with pytest.raises(roms.RomError) as caught:
        make_env(spec)
    text = one_line(caught.value)
    assert "not on this machine" in text and "--rom PATH" in text and elsewhere[:12] in text
    # Two ROMs titled OAKCATCH (the built-in one and the copy) and no digest: the game the
    # project builds runs on the ROM it builds.
    assert EnvSpec(game="catch").rom_sha256 in roms.builtin_roms()


# -- 8. the spec ------------------------------------------------------------------------------


def test_catch_spec_round_trips_and_stores_the_rom_and_config():
    spec = EnvSpec(game="catch")
    assert spec.backend == "pyboy" and spec.env_id == "GB/catch"
    assert spec.rom_sha256 == roms.sha256(build_rom()) and spec.rom_title == "OAKCATCH"
    assert spec.frame_skip == 4 == spec.gameboy_config.frames_per_action
    assert spec.gameboy_config == gameconfig.load(CATCH_TOML)
    assert spec.game_config == gameconfig.load(CATCH_TOML).to_json()
    assert EnvSpec.from_json(spec.to_json()) == spec
    assert EnvSpec(game="GB/catch") == spec == EnvSpec(game="Catch")
    assert action_meanings(spec) == ("NOOP", "LEFT", "RIGHT")
    assert action_mask(EnvSpec(game="catch", forbidden_actions=("LEFT",))).tolist() == [
        True, False, True]


def test_a_user_config_spec_round_trips_and_takes_frame_skip_from_it(tmp_path):
    path = user_config(tmp_path, rewards='[[rewards]]\naddress = "score"\nwidth = 2\n')
    path.write_text(path.read_text().replace("frames_per_action = 4",
                                             "frames_per_action = 6\npress_frames = 2"))
    spec = EnvSpec(game_config=str(path))
    assert spec.frame_skip == 6 and spec.game == "mycatch"
    assert spec.game_config.startswith("{") and str(path) not in spec.game_config
    path.unlink()  # a stored spec never needs the file again
    again = EnvSpec.from_json(spec.to_json())
    assert again == spec and again.gameboy_config.press_frames == 2
    assert EnvSpec(game_config=spec.game_config) == spec


def test_catch_toml_symbols_are_the_assemblers():
    symbols = tomllib.loads(CATCH_TOML.read_text())["symbols"]
    assert {name: symbols[name] for name in ("score", "lives", "game_over", "misses")} == {
        name: RAM[name] for name in ("score", "lives", "game_over", "misses")}
    assert gameconfig.load(CATCH_TOML).title == build.TITLE.decode()


def test_configs_are_equal_by_value_not_by_source():
    data = _base()
    first, second = gameconfig.parse(copy.deepcopy(data)), gameconfig.parse(data)
    assert first == second and first.to_json() == second.to_json()
    assert gameconfig.from_json(first.to_json()) == first


def test_a_start_state_outside_state_mode_is_refused(tmp_path):
    text = CATCH_TOML.read_text().replace('mode = "boot"', 'mode = "boot"\nstate = "x.state"')
    path = tmp_path / "catch.toml"
    path.write_text(text)
    with pytest.raises(GameConfigError, match=r"start\.state: applies only when start\.mode"):
        gameconfig.load(path)


def test_appending_with_a_rom_of_another_sha256_is_refused(tmp_path):
    from oakemu_rl.agents.recording import RecordConfig, record
    from oakemu_rl.errors import OakEmuError

    out = tmp_path / "demos.h5"
    spec = EnvSpec(game="catch")
    record(RecordConfig(out=out, spec=spec, episodes=1, max_steps=20, progress=False),
           CatchDemonstrator(spec))
    variant = bytearray(build_rom())
    variant[0x7FF0] ^= 0xFF  # same title and header, other bytes
    (tmp_path / "variant.gb").write_bytes(bytes(variant))
    digest, _ = roms.add_rom(tmp_path / "variant.gb")
    other = EnvSpec(game="catch", rom_sha256=digest)
    with pytest.raises(OakEmuError) as caught:
        record(RecordConfig(out=out, spec=other, episodes=1, max_steps=20, progress=False),
               CatchDemonstrator(other))
    assert "rom_sha256" in one_line(caught.value)
    from oakemu_rl.demos import validate_demo_file

    with validate_demo_file(out) as demo:  # the first episode is untouched
        assert len(demo.episodes) == 1
