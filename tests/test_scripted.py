"""The scripted Pong and Breakout demonstrators on the real emulator (no mocks)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from oakemu_rl.agents.scripted import (
    SCRIPTED_GAMES,
    SCRIPTED_STYLES,
    BreakoutDemonstrator,
    BreakoutHuman,
    CatchDemonstrator,
    PongDemonstrator,
    PongFollower,
    PongHuman,
    make_demonstrator,
)
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings, make_env
from oakemu_rl.errors import EnvError


def play(spec: EnvSpec, agent: Any, steps: int, seed: int = 0) -> tuple[list[int], float]:
    """Actions taken and the summed reward over `steps` agent steps (resetting at game end)."""
    env = make_env(spec)
    try:
        observation, _ = env.reset(seed=seed)
        agent.reset(env, seed)
        actions, total = [], 0.0
        for _ in range(steps):
            action = agent.act(env, observation)
            actions.append(int(action))
            observation, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            if terminated or truncated:
                observation, _ = env.reset(seed=seed + 1)
                agent.reset(env, seed + 1)
        return actions, total
    finally:
        env.close()


def test_registry_and_factory() -> None:
    assert dict(SCRIPTED_GAMES) == {"pong": PongDemonstrator, "breakout": BreakoutDemonstrator,
                                    "catch": CatchDemonstrator}
    for game, cls in SCRIPTED_GAMES.items():
        agent = make_demonstrator(EnvSpec(game=game), seed=3, noise=0.1)
        assert isinstance(agent, cls)
        assert agent.kind == "scripted"


def test_unknown_game_raises() -> None:
    with pytest.raises(EnvError, match="no scripted demonstrator for space_invaders; "
                                       "scripted games: pong, breakout"):
        make_demonstrator(EnvSpec(game="space_invaders"))


def test_styles_and_unknown_style() -> None:
    assert SCRIPTED_STYLES["pong"] == {"planner": PongDemonstrator, "follow": PongFollower,
                                       "human": PongHuman}
    assert SCRIPTED_STYLES["breakout"] == {"planner": BreakoutDemonstrator,
                                           "human": BreakoutHuman}
    for game, styles in SCRIPTED_STYLES.items():
        assert styles["planner"] is SCRIPTED_GAMES[game]
    assert isinstance(make_demonstrator(EnvSpec(game="pong"), style="follow"), PongFollower)
    assert isinstance(make_demonstrator(EnvSpec(game="breakout"), style="human"),
                      BreakoutHuman)
    with pytest.raises(EnvError, match="scripted breakout player has no style 'follow'; "
                                       "styles: planner, human"):
        make_demonstrator(EnvSpec(game="breakout"), style="follow")


def test_pong_follower_keeps_level_with_the_ball() -> None:
    """The follower's paddle tracks the ball (it holds keys), unlike the planner's."""
    spec = EnvSpec(game="pong", repeat_action_probability=0.0)

    def paddle_and_ball(style: str) -> tuple[np.ndarray, float]:
        env = make_env(spec)
        agent = make_demonstrator(spec, style=style)
        try:
            observation, _ = env.reset(seed=0)
            agent.reset(env, 0)
            rows, total = [], 0.0
            for _ in range(1500):
                observation, reward, *_ = env.step(agent.act(env, observation))
                total += float(reward)
                ram = env.unwrapped.ale.getRAM()
                if ram[54] != 0 and 0 < ram[49] < 205:  # a ball in play
                    rows.append((float(ram[51]), float(ram[54])))
            return np.array(rows), total
        finally:
            env.close()

    follow, follow_total = paddle_and_ball("follow")
    planner, _ = paddle_and_ball("planner")
    follow_r = np.corrcoef(follow.T)[0, 1]
    assert follow_r > 0.8, follow_r
    assert follow_r > np.corrcoef(planner.T)[0, 1]
    assert follow_total > -15  # it returns balls: a paddle that never moves loses ~every point


def test_bad_noise_and_wrong_game_raise() -> None:
    with pytest.raises(EnvError, match="noise"):
        PongDemonstrator(EnvSpec(game="pong"), noise=1.5)
    with pytest.raises(EnvError, match="breakout"):
        PongDemonstrator(EnvSpec(game="breakout"))


@pytest.mark.parametrize("game", ["pong", "breakout"])
def test_same_seed_same_actions(game: str) -> None:
    spec = EnvSpec(game=game)
    first, _ = play(spec, make_demonstrator(spec, seed=5, noise=0.2), 300, seed=11)
    again, _ = play(spec, make_demonstrator(spec, seed=5, noise=0.2), 300, seed=11)
    assert first == again
    other, _ = play(spec, make_demonstrator(spec, seed=6, noise=0.2), 300, seed=11)
    assert other != first


def test_noise_free_play_ignores_the_agent_seed() -> None:
    spec = EnvSpec(game="pong")
    one, _ = play(spec, make_demonstrator(spec, seed=1), 200, seed=4)
    two, _ = play(spec, make_demonstrator(spec, seed=2), 200, seed=4)
    assert one == two


def test_pong_never_takes_a_forbidden_action() -> None:
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE", "RIGHTFIRE", "LEFTFIRE"))
    mask = action_mask(spec)
    actions, _ = play(spec, make_demonstrator(spec, seed=0, noise=0.3), 400)
    assert all(mask[a] for a in actions)
    meanings = action_meanings("pong")
    assert {meanings[a] for a in actions} == {"NOOP", "RIGHT", "LEFT"}


def test_full_action_space_maps_by_meaning() -> None:
    spec = EnvSpec(game="breakout", full_action_space=True, forbidden_actions=("FIRE", "NOOP"))
    mask = action_mask(spec)
    actions, total = play(spec, make_demonstrator(spec, seed=0), 400)
    assert all(mask[a] for a in actions)
    assert total > 0  # it served (with another FIRE action) and broke bricks


def test_unplayable_masks_raise() -> None:
    with pytest.raises(EnvError, match="FIRE"):
        BreakoutDemonstrator(EnvSpec(game="breakout", forbidden_actions=("FIRE",)))
    with pytest.raises(EnvError, match="RIGHT"):
        PongDemonstrator(EnvSpec(game="pong", forbidden_actions=("RIGHT", "RIGHTFIRE")))


def test_pong_wins_points() -> None:
    spec = EnvSpec(game="pong")  # sticky actions 0.25
    _, total = play(spec, make_demonstrator(spec, seed=0), 2000)
    assert total >= 2


def test_breakout_scores() -> None:
    spec = EnvSpec(game="breakout")  # sticky actions 0.25
    _, total = play(spec, make_demonstrator(spec, seed=0), 1000)
    assert total >= 20


def test_reset_starts_the_episode_afresh() -> None:
    spec = EnvSpec(game="pong")
    agent = make_demonstrator(spec, seed=0, noise=0.5)
    first, _ = play(spec, agent, 150, seed=2)
    again, _ = play(spec, agent, 150, seed=2)  # same agent object, reset in between
    assert first == again
    assert np.unique(first).size > 1


def test_relabelling_planner_remembers_the_moves_really_played(tmp_path) -> None:
    # The planner predicts its paddle from its recent moves; when another agent drives,
    # record() tells it what was played, so its memory must end with the driver's moves.
    from oakemu_rl.agents.recording import RecordConfig, record

    spec = EnvSpec(game="pong")

    class LeftThenStill:
        kind = "policy"
        plays = (3, 3, 0, 3)  # LEFT LEFT NOOP LEFT, then NOOP

        def reset(self, env: Any, seed: int) -> None:
            self.t = 0

        def act(self, env: Any, observation: np.ndarray) -> int:
            self.t += 1
            return self.plays[self.t - 1] if self.t <= len(self.plays) else 0

    planner = make_demonstrator(spec, seed=0)
    driver = LeftThenStill()
    driver.plays = (2, 2, 2, 2)  # RIGHT: the planner's history must hold +1 moves
    record(RecordConfig(out=tmp_path / "r.h5", spec=spec, episodes=1, max_steps=4,
                        progress=False), planner, driver)
    assert list(planner._history) == [planner._direction_of(2)] * 4
    record(RecordConfig(out=tmp_path / "r.h5", spec=spec, episodes=1, max_steps=4,
                        progress=False), planner, LeftThenStill())
    assert list(planner._history) == [planner._direction_of(a) for a in (3, 0, 3, 3)]


def test_relabelling_tells_the_player_the_serve_that_was_played(tmp_path) -> None:
    # With fire_reset the env plays FIRE on a game's first step whatever the driver
    # chose, so the player remembering its keys must remember FIRE (still), not the
    # driver's RIGHT, there.
    from oakemu_rl.agents.recording import RecordConfig, record

    spec = EnvSpec(game="breakout", fire_reset=True)

    class Right:
        kind = "policy"

        def reset(self, env: Any, seed: int) -> None:
            pass

        def act(self, env: Any, observation: np.ndarray) -> int:
            return 2  # RIGHT

    player = make_demonstrator(spec, seed=0, style="human")
    record(RecordConfig(out=tmp_path / "r.h5", spec=spec, episodes=1, max_steps=4,
                        progress=False), player, Right())
    right = player._direction_of(2)
    assert right != 0 and player._direction_of(1) == 0
    assert list(player._history) == [right, right, right, 0]  # newest first


# -- the "human" style ----------------------------------------------------------------------


def press_runs(directions: list[int]) -> list[tuple[int, int]]:
    """(direction, length) of each run of equal directions, in order."""
    runs: list[list[int]] = []
    for u in directions:
        if runs and runs[-1][0] == u:
            runs[-1][1] += 1
        else:
            runs.append([u, 1])
    return [(u, n) for u, n in runs]


@pytest.mark.parametrize("game", ["pong", "breakout"])
def test_human_holds_each_key_for_the_minimum(game: str) -> None:
    spec = EnvSpec(game=game)  # sticky actions 0.25
    agent = make_demonstrator(spec, seed=0, style="human")
    actions, _ = play(spec, agent, 1500)
    directions = [agent._direction_of(a) for a in actions]
    runs = press_runs(directions)[:-1]  # the last run may be cut off by the end of play
    presses = [n for u, n in runs if u != 0]
    assert {u for u, _ in runs} == {-1, 0, 1}  # it moves both ways and rests
    assert len(presses) >= 20
    assert min(presses) >= agent.HOLD >= 3, sorted(presses)[:5]
    # The planner taps: the same check fails for it.
    planner = make_demonstrator(spec, seed=0)
    taps, _ = play(spec, planner, 1500)
    assert min(n for u, n in press_runs([planner._direction_of(a) for a in taps])[:-1]
               if u != 0) < 3


class _Screen:
    """Stands in for the env: `agent.act` reads only `env.unwrapped.ale.getRAM()`."""

    def __init__(self, ram: np.ndarray) -> None:
        self.unwrapped = self
        self.ale = self
        self.ram = ram

    def getRAM(self) -> np.ndarray:  # the emulator's name
        return self.ram


# RAM bytes of what the screen shows: own paddle, ball x, ball y (see the classes).
_SHOWN = {"pong": (51, 49, 54), "breakout": (72, 99, 101)}


@pytest.mark.parametrize("game", ["pong", "breakout"])
def test_human_decides_from_what_it_saw_delay_steps_ago(game: str) -> None:
    """Whatever the screen shows in the newest DELAY steps cannot change the decisions
    of those steps; what it showed DELAY steps before does change them."""
    spec = EnvSpec(game=game)
    env = make_env(spec)
    agent = make_demonstrator(spec, seed=0, style="human")
    delay = agent.DELAY
    assert 2 <= delay <= 3
    rng = np.random.default_rng(0)
    try:
        observation, _ = env.reset(seed=0)
        agent.reset(env, 0)
        rams, actions, forks = [], [], []
        for t in range(700):
            if t % 7 == 0 and t > 40:
                forks.append((t, copy.deepcopy(agent)))
            rams.append(env.unwrapped.ale.getRAM().copy())
            action = agent.act(env, observation)
            actions.append(action)
            observation, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
    finally:
        env.close()

    def garbled(ram: np.ndarray) -> np.ndarray:
        ram = ram.copy()
        for byte in _SHOWN[game]:
            ram[byte] = rng.integers(40, 200)
        return ram

    changed = 0
    for t, fork in forks:
        if t + delay >= len(actions):
            break
        # Garble the newest `delay` screens: the same keys as the real run.
        for s in range(t, t + delay):
            assert fork.act(_Screen(garbled(rams[s])), None) == actions[s], (t, s)
        # One step later the decision rests on the first garbled screen.
        changed += fork.act(_Screen(rams[t + delay]), None) != actions[t + delay]
    assert changed >= 3, changed


def test_human_wins_pong_points() -> None:
    spec = EnvSpec(game="pong")  # sticky actions 0.25, against the built-in opponent
    env = make_env(spec)
    agent = make_demonstrator(spec, seed=0, style="human")
    won = lost = 0
    try:
        observation, _ = env.reset(seed=0)
        agent.reset(env, 0)
        for _ in range(2500):
            observation, reward, terminated, truncated, _ = env.step(
                agent.act(env, observation))
            won += reward > 0
            lost += reward < 0
            if terminated or truncated:
                break
    finally:
        env.close()
    assert won >= 4 and won > 2 * lost, (won, lost)


def test_human_pong_forgets_its_plan_values_with_each_game() -> None:
    """The human-style Pong player caches its plan values by a rounded ball position, so a
    hit may return a nearby ball's value: a cache kept across games made a game play
    differently after other games than alone (or in another process). A new game starts
    with none."""
    spec = EnvSpec(game="pong")
    agent = make_demonstrator(spec, seed=0, style="human")
    assert isinstance(agent, PongHuman)
    play(spec, agent, 1500, seed=3)
    assert agent._worth, "the game's rallies filled the cache"
    env = make_env(spec)
    try:
        agent.reset(env, 4)
    finally:
        env.close()
    assert agent._worth == {}


def test_human_breaks_breakout_bricks() -> None:
    spec = EnvSpec(game="breakout")
    _, total = play(spec, make_demonstrator(spec, seed=0, style="human"), 1000)
    assert total >= 20


@pytest.mark.parametrize("game", ["pong", "breakout"])
def test_human_noise_takes_random_actions_at_the_given_rate(game: str) -> None:
    """With noise P an action is replaced by a uniformly drawn allowed one with chance P:
    it differs from the noise-free decision (made by a noise-free copy of the agent) on
    about P * (1 - 1/allowed) of the steps; same seeds, same actions."""
    spec = EnvSpec(game=game)
    env = make_env(spec)
    agent = make_demonstrator(spec, seed=3, noise=0.3, style="human")
    allowed = int(action_mask(spec).sum())
    differ, steps = 0, 600
    try:
        observation, _ = env.reset(seed=1)
        agent.reset(env, 1)
        taken = []
        for _ in range(steps):
            calm = copy.deepcopy(agent)
            calm.noise = 0.0
            action = agent.act(env, observation)
            differ += calm.act(env, observation) != action
            taken.append(action)
            observation, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                observation, _ = env.reset(seed=2)
                agent.reset(env, 2)
    finally:
        env.close()
    expected = 0.3 * (1 - 1 / allowed)
    assert abs(differ / steps - expected) < 0.07, (differ / steps, expected)
    again, _ = play(spec, make_demonstrator(spec, seed=3, noise=0.3, style="human"), 300,
                    seed=1)
    assert again == taken[:300]
    other, _ = play(spec, make_demonstrator(spec, seed=4, noise=0.3, style="human"), 300,
                    seed=1)
    assert other != again


def test_human_keeps_the_action_mask_and_the_played_moves() -> None:
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE", "RIGHTFIRE", "LEFTFIRE"))
    mask = action_mask(spec)
    actions, _ = play(spec, make_demonstrator(spec, seed=0, noise=0.3, style="human"), 400)
    assert all(mask[a] for a in actions)
    # Relabelling: when another agent's move is played, the hold follows that move.
    agent = make_demonstrator(EnvSpec(game="pong"), seed=0, style="human")
    env = make_env(EnvSpec(game="pong"))
    try:
        observation, _ = env.reset(seed=0)
        agent.reset(env, 0)
        right = action_meanings("pong").index("RIGHT")
        agent.act(env, observation)
        agent.was_taken(right)  # a press began: the next HOLD - 1 labels keep it
        for _ in range(agent.HOLD - 1):
            observation, *_ = env.step(right)
            assert agent.act(env, observation) == right
    finally:
        env.close()
