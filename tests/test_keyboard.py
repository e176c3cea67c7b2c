"""The keyboard recorder, driven by scripted key events under SDL's dummy video driver.

Every test plays the real emulator into a real HDF5 file. Events are handed to the agent
as `event_script={tick: [events]}`; without a pause, tick N is the session's step N.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pygame = pytest.importorskip("pygame")

from oakemu_rl.agents.keyboard import (  # noqa: E402
    KeyboardAgent,
    _key_table,
    check_display,
    key_map_text,
)
from oakemu_rl.agents.recording import RecordConfig, record  # noqa: E402
from oakemu_rl.demos import validate_demo_file  # noqa: E402
from oakemu_rl.envs import EnvSpec, action_meanings  # noqa: E402
from oakemu_rl.errors import OakEmuError  # noqa: E402

FAST = 1000.0  # steps per second: the tests should not wait like a person


@pytest.fixture
def dummy_video(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    yield
    pygame.display.quit()


def down(key: int) -> pygame.event.Event:
    return pygame.event.Event(pygame.KEYDOWN, key=key)


def up(key: int) -> pygame.event.Event:
    return pygame.event.Event(pygame.KEYUP, key=key)


def tap(key: int) -> list[pygame.event.Event]:
    return [down(key), up(key)]


def pong_action(meaning: str) -> int:
    return action_meanings("pong").index(meaning)


def run(tmp_path: Path, script: dict, *, spec: EnvSpec | None = None, episodes: int = 1,
        max_steps: int = 200):
    spec = spec or EnvSpec(game="pong")
    out = tmp_path / "demo.h5"
    agent = KeyboardAgent(spec, fps=FAST, scale=1, event_script=script)
    with agent:
        result = record(RecordConfig(out=out, spec=spec, episodes=episodes,
                                     max_steps=max_steps, progress=False), agent)
        caption = pygame.display.get_caption()[0]
    return agent, result, out, caption


def actions_of(path: Path) -> list[np.ndarray]:
    with validate_demo_file(path) as demo:
        return [demo.read(i, "actions") for i in range(len(demo.episodes))]


def test_held_keys_become_the_recorded_actions(dummy_video, tmp_path: Path) -> None:
    script = {
        10: [down(pygame.K_UP)], 50: [up(pygame.K_UP)],
        60: [down(pygame.K_DOWN)], 80: [up(pygame.K_DOWN)],
        100: [down(pygame.K_UP), down(pygame.K_SPACE)],
        120: [up(pygame.K_UP), up(pygame.K_SPACE)],
        130: [down(pygame.K_UP), down(pygame.K_DOWN)],  # opposite arrows cancel
        140: [up(pygame.K_UP), up(pygame.K_DOWN)],
    }
    agent, result, out, caption = run(tmp_path, script)
    [actions] = actions_of(out)
    assert len(actions) == 200 and agent.steps == 200
    expected = np.full(200, pong_action("NOOP"))
    expected[10:50] = pong_action("RIGHT")  # Pong's paddle goes up on RIGHT
    expected[60:80] = pong_action("LEFT")
    expected[100:120] = pong_action("RIGHTFIRE")
    assert actions.tolist() == expected.tolist()
    with validate_demo_file(out) as demo:
        [info] = demo.episodes
        assert info.recorder == "human" and info.truncated
        assert agent.score == pytest.approx(info.episode_return)
    assert result.episodes[0]["length"] == 200
    for text in ("pong", "episode 1", "score", "steps/s"):
        assert text in caption


def test_backspace_discards_the_episode(dummy_video, tmp_path: Path) -> None:
    script = {0: [down(pygame.K_UP)], 3: [up(pygame.K_UP)], 5: tap(pygame.K_BACKSPACE)}
    agent, result, out, _ = run(tmp_path, script, episodes=2, max_steps=30)
    assert result.discarded == 1 and not result.stopped
    episodes = actions_of(out)
    assert [len(a) for a in episodes] == [30, 30]
    # The UP presses belonged to the thrown-away attempt only.
    assert all((a == pong_action("NOOP")).all() for a in episodes)
    assert agent.steps == 5 + 60 and agent.episode == 3 and agent.discarded == 1


@pytest.mark.parametrize("stop", ["escape", "close"])
def test_escape_or_closing_stops_and_keeps_finished_episodes(
    dummy_video, tmp_path: Path, stop: str
) -> None:
    event = down(pygame.K_ESCAPE) if stop == "escape" else pygame.event.Event(pygame.QUIT)
    agent, result, out, _ = run(tmp_path, {30: [event]}, episodes=3, max_steps=20)
    assert result.stopped and len(result.episodes) == 1
    with validate_demo_file(out) as demo:
        assert [e.length for e in demo.episodes] == [20]
        assert demo.episodes[0].recorder == "human"
    assert agent.steps == 30  # 20 kept, 10 of the unfinished second episode dropped


def test_forbidden_actions_are_never_recorded(dummy_video, tmp_path: Path) -> None:
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE", "RIGHTFIRE", "LEFTFIRE"))
    script = {0: [down(pygame.K_SPACE)], 10: [down(pygame.K_UP)], 20: [up(pygame.K_UP)],
              25: [down(pygame.K_DOWN)]}
    _, _, out, _ = run(tmp_path, script, spec=spec, max_steps=40)
    [actions] = actions_of(out)
    meanings = [action_meanings("pong")[a] for a in actions]
    assert not {"FIRE", "RIGHTFIRE", "LEFTFIRE"} & set(meanings)
    assert meanings == ["NOOP"] * 10 + ["RIGHT"] * 10 + ["NOOP"] * 5 + ["LEFT"] * 15
    with validate_demo_file(out) as demo:
        assert demo.action_mask[actions].all()


def test_pause_takes_no_steps(dummy_video, tmp_path: Path) -> None:
    # P at tick 5 pauses inside step 5; ticks 6..12 are paused refreshes (UP is pressed
    # meanwhile); P at tick 12 resumes, and step 5 then goes ahead with UP held.
    script = {5: tap(pygame.K_p), 8: [down(pygame.K_UP)], 12: tap(pygame.K_p)}
    agent, _, out, _ = run(tmp_path, script, max_steps=20)
    [actions] = actions_of(out)
    assert len(actions) == 20 and agent.steps == 20
    assert agent.tick == 20 + 7  # seven paused ticks, no steps taken during them
    assert actions.tolist() == [pong_action("NOOP")] * 5 + [pong_action("RIGHT")] * 15
    assert not agent.paused


def test_plus_and_minus_change_speed(dummy_video, tmp_path: Path) -> None:
    script = {1: tap(pygame.K_PLUS), 2: tap(pygame.K_KP_PLUS), 3: tap(pygame.K_MINUS),
              4: tap(pygame.K_KP_MINUS), 5: tap(pygame.K_KP_MINUS)}
    agent, _, _, caption = run(tmp_path, script, max_steps=10)
    assert agent.fps == pytest.approx(FAST * 0.75)
    assert "0.75x" in caption


def test_key_table_picks_the_best_allowed_meaning() -> None:
    def action(game: str, arrows: set[str], fire: bool, **spec: object) -> str:
        table = _key_table(EnvSpec(game=game, **spec))
        return action_meanings(game)[table[(frozenset(arrows), fire)]]

    assert action("seaquest", {"UP", "RIGHT"}, True) == "UPRIGHTFIRE"
    assert action("breakout", {"UP", "RIGHT"}, False) == "RIGHT"  # no UPRIGHT: drop UP
    assert action("breakout", {"LEFT"}, True) == "LEFT"  # no LEFTFIRE
    assert action("freeway", set(), True) == "NOOP"  # no FIRE at all
    assert action("pong", {"LEFT"}, False) == "NOOP"  # side arrows unused in Pong
    assert action("pong", {"DOWN"}, True) == "LEFTFIRE"
    # NOOP forbidden: the nearest allowed action stands in when nothing is held.
    assert action("breakout", set(), False, forbidden_actions=("NOOP",)) != "NOOP"


def test_key_map_text_describes_the_game() -> None:
    text = key_map_text(EnvSpec(game="pong"))
    assert "pong" in text and "up arrow        -> RIGHT" in text
    assert "up+space=RIGHTFIRE" in text
    for control in ("P pause", "BACKSPACE", "ESC", "+/-"):
        assert control in text
    forbidden = key_map_text(EnvSpec(game="pong", forbidden_actions=("FIRE",)))
    assert "forbidden: FIRE" in forbidden


def test_check_display_without_a_display(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.platform", "linux")
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(OakEmuError, match="no display found"):
        check_display()
    agent = KeyboardAgent(EnvSpec(game="pong"))
    with pytest.raises(OakEmuError, match="no display found"):
        agent.reset(None, 0)
    agent.close()


def test_check_display_when_pygame_cannot_open_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDL_VIDEODRIVER", "no_such_driver")
    with pytest.raises(OakEmuError, match="cannot open a window"):
        check_display()
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    check_display()  # the dummy driver opens (invisible) windows
    assert not pygame.display.get_init()


# -- the Game Boy ---------------------------------------------------------------------


def test_gameboy_keys_press_the_game_buttons(dummy_video, tmp_path: Path) -> None:
    spec = EnvSpec(game="catch", repeat_action_probability=0.0, noop_max=0)
    script = {5: [down(pygame.K_RIGHT)], 15: [up(pygame.K_RIGHT)],
              20: [down(pygame.K_LEFT), down(pygame.K_RIGHT)],  # opposite arrows cancel
              25: [up(pygame.K_LEFT), up(pygame.K_RIGHT)], 30: [down(pygame.K_LEFT)]}
    agent, result, out, caption = run(tmp_path, script, spec=spec, max_steps=40)
    [actions] = actions_of(out)
    expected = np.zeros(40, dtype=int)  # NOOP LEFT RIGHT
    expected[5:15] = 2
    expected[30:] = 1
    assert actions.tolist() == expected.tolist()
    assert (agent.width, agent.height) == (160, 144)
    assert "catch" in caption and result.episodes[0]["length"] == 40


def test_gameboy_window_is_scaled_and_the_game_runs_at_its_speed(dummy_video) -> None:
    spec = EnvSpec(game="catch")
    agent = KeyboardAgent(spec, scale=3)
    assert agent.fps == pytest.approx(60 / 4)  # 60 frames a second, 4 frames a step
    from oakemu_rl.envs import make_env

    env = make_env(spec)
    try:
        observation, _ = env.reset(seed=0)
        with agent:
            agent.reset(env, 0)
            agent.act(env, observation)
            width, height = pygame.display.get_surface().get_size()
        assert width == 160 * 3 and height >= 144 * 3
    finally:
        env.close()


def test_gameboy_key_map_names_every_button() -> None:
    from oakemu_rl.agents.keyboard import gameboy_action

    spec = EnvSpec(game="catch")
    text = key_map_text(spec)
    for line in ("left arrow      -> LEFT", "right arrow     -> RIGHT", "X               -> A",
                 "Z               -> B", "ENTER           -> START"):
        assert line in text
    assert "A  (not an action of this game)" in text  # catch has no A
    assert gameboy_action(frozenset({"RIGHT", "A"}), spec) == 2  # RIGHT kept, A dropped
    assert gameboy_action(frozenset({"LEFT", "RIGHT"}), spec) == 0
