"""The scripted Pong and Breakout demonstrators on the real emulator (no mocks)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from oakemu_rl.agents.scripted import (
    SCRIPTED_GAMES,
    SCRIPTED_STYLES,
    BreakoutDemonstrator,
    PongDemonstrator,
    PongFollower,
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
    assert dict(SCRIPTED_GAMES) == {"pong": PongDemonstrator, "breakout": BreakoutDemonstrator}
    for game, cls in SCRIPTED_GAMES.items():
        agent = make_demonstrator(EnvSpec(game=game), seed=3, noise=0.1)
        assert isinstance(agent, cls)
        assert agent.kind == "scripted"


def test_unknown_game_raises() -> None:
    with pytest.raises(EnvError, match="no scripted demonstrator for space_invaders; "
                                       "scripted games: pong, breakout"):
        make_demonstrator(EnvSpec(game="space_invaders"))


def test_styles_and_unknown_style() -> None:
    assert SCRIPTED_STYLES["pong"] == {"planner": PongDemonstrator, "follow": PongFollower}
    for game, styles in SCRIPTED_STYLES.items():
        assert styles["planner"] is SCRIPTED_GAMES[game]
    assert isinstance(make_demonstrator(EnvSpec(game="pong"), style="follow"), PongFollower)
    with pytest.raises(EnvError, match="scripted breakout player has no style 'follow'; "
                                       "styles: planner"):
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
