"""EnvSpec as data, action masks, and the two emulator paths agreeing frame for frame.

Everything here runs the real emulator (ale-py); no test takes more than a second or two.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from oakemu_rl.envs import (
    EnvSpec,
    FrameStack,
    action_mask,
    action_meanings,
    available_games,
    canonical_game,
    make_env,
    make_vector_env,
)
from oakemu_rl.errors import EnvError, OakEmuError

PONG_MEANINGS = ("NOOP", "FIRE", "RIGHT", "LEFT", "RIGHTFIRE", "LEFTFIRE")
# Deterministic emulation: both paths then see exactly the same frames.
DETERMINISTIC = {"noop_max": 0, "repeat_action_probability": 0.0}


def assert_reset_stack(obs: np.ndarray, k: int = 4, size: int = 84) -> None:
    """A stack at an episode's first step: zeros everywhere except the newest frame."""
    assert obs.shape == (k, size, size)
    assert obs.dtype == np.uint8
    assert not obs[:-1].any(), "frames before the episode's first frame must be zero"
    assert obs[-1].any(), "the newest frame is a real screen"


# -- EnvSpec: values -----------------------------------------------------------------


def test_defaults_follow_machado_et_al():
    spec = EnvSpec()
    assert spec.game == "pong"
    assert spec.backend == "ale"
    assert spec.frame_skip == 4
    assert spec.screen_size == 84
    assert spec.grayscale is True
    assert spec.frame_stack == 4
    assert spec.noop_max == 30
    assert spec.repeat_action_probability == 0.25
    assert spec.full_action_space is False
    assert spec.max_episode_frames == 108_000
    assert spec.episodic_life is False
    assert spec.reward_clipping is False
    assert spec.forbidden_actions == ()
    assert spec.fire_reset is False
    assert spec.frame_shape == (84, 84)
    assert spec.observation_shape == (4, 84, 84)
    assert spec.env_id == "ALE/Pong-v5"


def test_spec_is_frozen_and_hashable():
    spec = EnvSpec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.frame_skip = 2  # type: ignore[misc]
    assert hash(spec) == hash(EnvSpec())
    assert len({EnvSpec(), EnvSpec(game="Pong"), EnvSpec(game="breakout")}) == 2


def test_shapes_follow_the_spec():
    spec = EnvSpec(screen_size=64, frame_stack=2)
    assert spec.frame_shape == (64, 64)
    assert spec.observation_shape == (2, 64, 64)


@pytest.mark.parametrize(
    ("game", "env_id"),
    [("pong", "ALE/Pong-v5"), ("space_invaders", "ALE/SpaceInvaders-v5"),
     ("breakout", "ALE/Breakout-v5")],
)
def test_env_id(game, env_id):
    assert EnvSpec(game=game).env_id == env_id


def test_forbidden_actions_are_upper_cased_tuples():
    spec = EnvSpec(forbidden_actions=["fire", "RightFire"])  # type: ignore[arg-type]
    assert spec.forbidden_actions == ("FIRE", "RIGHTFIRE")


SPECS = [
    EnvSpec(),
    EnvSpec(game="breakout", frame_skip=2, screen_size=64, frame_stack=2, noop_max=0,
            repeat_action_probability=0.0, full_action_space=True, max_episode_frames=1000,
            episodic_life=True, reward_clipping=True, forbidden_actions=("FIRE", "UP")),
    EnvSpec(game="space_invaders", forbidden_actions=("FIRE",)),
    EnvSpec(game="breakout", fire_reset=True),
]


@pytest.mark.parametrize("spec", SPECS,
                         ids=["default", "everything-changed", "invaders", "fire-reset"])
def test_json_and_dict_round_trip(spec):
    text = spec.to_json()
    assert EnvSpec.from_json(text) == spec
    assert EnvSpec.from_dict(spec.to_dict()) == spec
    data = json.loads(text)
    assert data == spec.to_dict()
    assert data["env_id"] == spec.env_id
    assert data["forbidden_actions"] == list(spec.forbidden_actions)
    assert list(data) == sorted(data), "to_json sorts its keys (stable metadata)"
    # the dict must be plain JSON data (it is stored in HDF5 attributes and checkpoints)
    assert json.loads(json.dumps(spec.to_dict())) == spec.to_dict()


def test_from_dict_fills_defaults_and_ignores_env_id():
    assert EnvSpec.from_dict({}) == EnvSpec()
    assert EnvSpec.from_dict({"game": "Breakout", "env_id": "whatever"}) == EnvSpec(
        game="breakout"
    )


def test_from_dict_accepts_an_integer_for_a_float():
    spec = EnvSpec.from_dict({"repeat_action_probability": 0})
    assert spec.repeat_action_probability == 0.0
    assert isinstance(spec.repeat_action_probability, float)


@pytest.mark.parametrize("key", ["frameskip", "sticky", "Game", ""])
def test_from_dict_unknown_key_is_named(key):
    with pytest.raises(EnvError, match="unknown env spec key") as info:
        EnvSpec.from_dict({key: 4, "game": "pong"})
    assert repr(key)[1:-1] in str(info.value)


def test_from_dict_names_every_unknown_key():
    with pytest.raises(EnvError) as info:
        EnvSpec.from_dict({"zeta": 1, "alpha": 2})
    assert "alpha" in str(info.value)
    assert "zeta" in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("frame_skip", "4"),
        ("frame_skip", 4.0),
        ("frame_skip", True),
        ("frame_skip", None),
        ("screen_size", [84]),
        ("noop_max", 1.5),
        ("max_episode_frames", "108000"),
        ("episodic_life", 1),
        ("episodic_life", "yes"),
        ("reward_clipping", None),
        ("full_action_space", 0),
        ("grayscale", "true"),
        ("repeat_action_probability", "0.25"),
        ("repeat_action_probability", True),
        ("repeat_action_probability", None),
        ("game", 3),
        ("game", None),
        ("backend", ["ale"]),
        ("forbidden_actions", "FIRE"),
        ("forbidden_actions", [1]),
        ("forbidden_actions", None),
        ("forbidden_actions", {"FIRE": True}),
    ],
)
def test_from_dict_wrong_type_is_named(key, value):
    with pytest.raises(EnvError) as info:
        EnvSpec.from_dict({key: value})
    assert key in str(info.value)


@pytest.mark.parametrize("data", [[], "pong", 3, None, ["game", "pong"]])
def test_from_dict_needs_a_mapping(data):
    with pytest.raises(EnvError, match="mapping"):
        EnvSpec.from_dict(data)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "{", "not json", "{'game': 'pong'}", "[1, 2]", "null",
                                  '"pong"'])
def test_from_json_rejects_bad_text(text):
    with pytest.raises(EnvError):
        EnvSpec.from_json(text)


def test_from_json_rejects_a_non_string():
    with pytest.raises(EnvError):
        EnvSpec.from_json(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("frame_skip", 0),
        ("frame_skip", -4),
        ("screen_size", 7),
        ("screen_size", 513),
        ("frame_stack", 0),
        ("frame_stack", 33),
        ("noop_max", -1),
        ("repeat_action_probability", -0.01),
        ("repeat_action_probability", 1.0),
        ("repeat_action_probability", math.nan),
        ("max_episode_frames", 0),
    ],
)
def test_out_of_range_values(key, value):
    with pytest.raises(EnvError, match=f"{key}=.*out of range"):
        EnvSpec(**{key: value})
    with pytest.raises(EnvError, match=key):
        EnvSpec.from_dict({key: value})


@pytest.mark.parametrize(
    ("key", "value"),
    [("frame_skip", 1), ("screen_size", 8), ("screen_size", 512), ("frame_stack", 1),
     ("frame_stack", 32), ("noop_max", 0), ("repeat_action_probability", 0.0),
     ("repeat_action_probability", 0.999), ("max_episode_frames", 1)],
)
def test_boundary_values_are_accepted(key, value):
    assert getattr(EnvSpec(**{key: value}), key) == value


def test_unknown_backend_and_colour_frames_are_refused():
    with pytest.raises(EnvError, match="backend"):
        EnvSpec(backend="gym")
    with pytest.raises(EnvError, match="grayscale"):
        EnvSpec(grayscale=False)


def test_env_errors_are_user_errors():
    assert issubclass(EnvError, OakEmuError)


def test_for_evaluation_turns_off_training_switches():
    train = EnvSpec(game="breakout", episodic_life=True, reward_clipping=True,
                    repeat_action_probability=0.1, forbidden_actions=("FIRE",))
    evaluation = train.for_evaluation()
    assert evaluation.episodic_life is False
    assert evaluation.reward_clipping is False
    assert evaluation == dataclasses.replace(train, episodic_life=False, reward_clipping=False)
    assert train.episodic_life is True, "the original spec is unchanged"
    assert evaluation.for_evaluation() == evaluation
    assert train.same_frames_as(evaluation)
    assert evaluation.same_frames_as(train)
    assert not train.same_frames_as(dataclasses.replace(train, repeat_action_probability=0.0))
    assert not train.same_frames_as(dataclasses.replace(train, game="pong"))


# -- game names ------------------------------------------------------------------------


def test_available_games():
    games = available_games()
    atari = [game for game, where in games if where == "Atari"]
    assert atari == sorted(atari)
    assert {"pong", "breakout", "space_invaders"} <= set(atari)
    gameboy = dict((game, where) for game, where in games if where.startswith("Game Boy"))
    assert gameboy["catch"] == "Game Boy"  # built from the project's source
    assert set(gameboy) >= {"catch", "pokemon_red"}


@pytest.mark.parametrize(
    ("name", "game"),
    [
        ("pong", "pong"),
        ("Pong", "pong"),
        ("PONG", "pong"),
        ("  pong ", "pong"),
        ("ALE/Pong-v5", "pong"),
        ("ale/Pong-v5", "pong"),
        ("PongNoFrameskip-v4", "pong"),
        ("PongDeterministic-v4", "pong"),
        ("Pong-v0", "pong"),
        ("space-invaders", "space_invaders"),
        ("space_invaders", "space_invaders"),
        ("SpaceInvaders", "space_invaders"),
        ("spaceinvaders", "space_invaders"),
        ("Space Invaders", "space_invaders"),
        ("ALE/SpaceInvaders-v5", "space_invaders"),
        ("SpaceInvadersNoFrameskip-v4", "space_invaders"),
        ("BreakoutNoFrameskip-v4", "breakout"),
    ],
)
def test_canonical_game_names(name, game):
    assert canonical_game(name) == game
    assert EnvSpec(game=name).game == game
    assert EnvSpec.from_dict({"game": name}).game == game


@pytest.mark.parametrize("name", ["notagame", "ALE/Zelda-v5", "pongg", "", "   ", "ALE/"])
def test_unknown_game_points_at_oakemu_envs(name):
    with pytest.raises(EnvError, match="`oakemu envs`"):
        canonical_game(name)
    with pytest.raises(EnvError, match="`oakemu envs`"):
        EnvSpec(game=name)


def test_unknown_game_is_named():
    with pytest.raises(EnvError, match="'Zelda'"):
        EnvSpec.from_dict({"game": "Zelda"})


# -- action meanings and masks ---------------------------------------------------------


def test_action_meanings():
    assert action_meanings("pong") == PONG_MEANINGS
    full = action_meanings("pong", True)
    assert len(full) == 18
    assert full[:2] == ("NOOP", "FIRE")
    assert set(PONG_MEANINGS) <= set(full)


def test_mask_without_forbidden_actions_allows_everything():
    mask = action_mask(EnvSpec())
    assert mask.dtype == np.bool_
    assert mask.shape == (6,)
    assert mask.all()


@pytest.mark.parametrize("full", [False, True])
def test_forbid_fire_variants(full):
    meanings = action_meanings("pong", full)
    fire = tuple(m for m in meanings if "FIRE" in m)
    spec = EnvSpec(game="pong", full_action_space=full, forbidden_actions=fire)
    mask = action_mask(spec)
    assert mask.shape == (len(meanings),)
    assert mask.dtype == np.bool_
    for meaning, allowed in zip(meanings, mask, strict=True):
        assert allowed == ("FIRE" not in meaning), meaning
    if not full:
        assert mask.tolist() == [True, False, True, True, False, False]


def test_forbid_only_fire_by_meaning_lower_case():
    mask = action_mask(EnvSpec(forbidden_actions=("fire",)))
    assert dict(zip(PONG_MEANINGS, mask.tolist(), strict=True)) == {
        "NOOP": True, "FIRE": False, "RIGHT": True, "LEFT": True, "RIGHTFIRE": True,
        "LEFTFIRE": True,
    }


@pytest.mark.parametrize("bad", [("JUMP",), ("UP",), ("FIRE", "DOWNFIRE")])
def test_forbidding_an_unknown_meaning(bad):
    spec = EnvSpec(forbidden_actions=bad)
    with pytest.raises(EnvError) as info:
        action_mask(spec)
    message = str(info.value)
    assert bad[-1] in message
    assert "LEFTFIRE" in message, "the error lists the game's actions"
    with pytest.raises(EnvError):
        make_env(spec)
    with pytest.raises(EnvError):
        make_vector_env(spec, 1)


def test_forbidding_every_action():
    spec = EnvSpec(forbidden_actions=PONG_MEANINGS)
    with pytest.raises(EnvError, match="every action"):
        action_mask(spec)
    with pytest.raises(EnvError, match="every action"):
        make_env(spec)
    with pytest.raises(EnvError, match="every action"):
        make_vector_env(spec, 2)


# -- the single env ----------------------------------------------------------------------


def test_make_env_observations_and_zero_padding():
    env = make_env(EnvSpec(**DETERMINISTIC))
    try:
        assert isinstance(env, FrameStack)
        assert env.observation_space.shape == (4, 84, 84)
        assert env.observation_space.dtype == np.uint8
        assert env.action_space.n == 6
        obs, _ = env.reset(seed=0)
        assert_reset_stack(obs)
        assert env.observation_space.contains(obs)
        previous = obs
        for t in range(1, 6):
            obs, *_ = env.step(0)
            assert obs.shape == (4, 84, 84)
            assert obs.dtype == np.uint8
            real = min(t + 1, 4)
            assert not obs[: 4 - real].any(), f"step {t}: only {real} real frames yet"
            assert all(obs[i].any() for i in range(4 - real, 4))
            np.testing.assert_array_equal(obs[:-1], previous[1:])
            previous = obs
        # a new episode starts from zeros again
        obs, _ = env.reset(seed=1)
        assert_reset_stack(obs)
        # the observation is a copy, not the stacker's buffer
        obs[:] = 7
        obs2, *_ = env.step(0)
        assert not obs2[:2].any()
    finally:
        env.close()


def test_make_env_reward_clipping_and_episodic_life():
    actions = np.random.default_rng(3).integers(6, size=120)

    def rewards(clip: bool) -> set[float]:
        env = make_env(EnvSpec(game="space_invaders", reward_clipping=clip, **DETERMINISTIC))
        env.reset(seed=0)
        seen = {float(env.step(int(a))[1]) for a in actions}
        env.close()
        return seen

    raw, clipped = rewards(False), rewards(True)
    assert max(raw) > 1, f"space invaders scores more than 1 per hit: {raw}"
    assert clipped <= {-1.0, 0.0, 1.0}
    assert 1.0 in clipped

    def lives_at_first_end(episodic: bool) -> tuple[int, int]:
        env = make_env(EnvSpec(game="breakout", episodic_life=episodic, **DETERMINISTIC))
        env.reset(seed=0)
        rng = np.random.default_rng(0)
        for t in range(2000):
            _, _, terminated, truncated, info = env.step(int(rng.integers(4)))
            if terminated or truncated:
                env.close()
                return t, int(info["lives"])
        raise AssertionError("no episode end in 2000 random steps of breakout")

    t_life, lives_life = lives_at_first_end(True)
    t_game, lives_game = lives_at_first_end(False)
    assert lives_life == 4, "episodic_life ends the episode at the first lost life"
    assert lives_game == 0
    assert t_life < t_game


# -- fire_reset --------------------------------------------------------------------------

BREAKOUT_MOVES = (0, 2, 3)  # NOOP, RIGHT, LEFT: never FIRE


def test_fire_reset_serves_every_ball_on_the_single_env():
    """A player that never presses FIRE waits forever in Breakout; with fire_reset each of
    its five balls is served, falls past the paddle, and the game ends."""
    def play(fire_reset: bool) -> tuple[int, int, bool]:
        env = make_env(EnvSpec(game="breakout", fire_reset=fire_reset))
        try:
            _, info = env.reset(seed=0)
            assert info["lives"] == 5
            for t in range(1500):
                _, _, terminated, truncated, info = env.step(0)
                if terminated or truncated:
                    return t, int(info["lives"]), terminated
            return t, int(info["lives"]), False
        finally:
            env.close()

    assert play(False) == (1499, 5, False), "without FIRE no ball is ever served"
    steps, lives, terminated = play(True)
    assert terminated and lives == 0
    assert steps < 400, f"five served balls should fall within 400 steps, took {steps}"


@pytest.mark.parametrize("same_step_reset", [True, False], ids=["same-step", "next-step"])
def test_fire_reset_serves_every_ball_on_the_vector_env(same_step_reset):
    """The same on each sub-env of the vector env, over several games in both reset modes:
    the first action of every new game is FIRE too."""
    def games_ended(fire_reset: bool) -> np.ndarray:
        venv = make_vector_env(EnvSpec(game="breakout", fire_reset=fire_reset), 2,
                               same_step_reset=same_step_reset)
        try:
            venv.reset(seed=0)
            ends = np.zeros(2, dtype=int)
            for _ in range(1200):
                _, _, terminated, truncated, _ = venv.step(np.zeros(2, dtype=np.int64))
                ends += terminated | truncated
            return ends
        finally:
            venv.close()

    assert games_ended(False).tolist() == [0, 0]
    assert (games_ended(True) >= 3).all(), "every game's five balls are served"


def test_fire_reset_replaces_only_the_serving_actions():
    """fire_reset plays exactly as a player that presses FIRE itself on a game's first step
    and on the first step after each lost life, and otherwise moves as told: the frames of
    the two agree step for step over a whole game of random moves."""
    spec = EnvSpec(game="breakout", **DETERMINISTIC)
    served, plain = make_env(dataclasses.replace(spec, fire_reset=True)), make_env(spec)
    try:
        obs, info = served.reset(seed=0)
        plain_obs, _ = plain.reset(seed=0)
        np.testing.assert_array_equal(obs, plain_obs)
        serve, lives, lost = True, info["lives"], 0
        rng = np.random.default_rng(4)
        for t in range(3000):
            action = int(rng.choice(BREAKOUT_MOVES))
            obs, reward, terminated, _, info = served.step(action)
            plain_obs, plain_reward, plain_terminated, _, _ = plain.step(1 if serve else action)
            np.testing.assert_array_equal(obs, plain_obs, err_msg=f"step {t}")
            assert (reward, terminated) == (plain_reward, plain_terminated)
            serve, lost = info["lives"] < lives, lost + (info["lives"] < lives)
            lives = info["lives"]
            if terminated:
                break
        assert terminated and lost == 5, f"a whole game of five balls, got {lost} in {t} steps"
    finally:
        served.close()
        plain.close()


def test_fire_reset_is_refused_where_it_cannot_apply():
    with pytest.raises(EnvError, match="no FIRE action"):
        make_env(EnvSpec(game="freeway", fire_reset=True))
    with pytest.raises(EnvError, match="no FIRE action"):
        make_vector_env(EnvSpec(game="freeway", fire_reset=True), 1)
    with pytest.raises(EnvError, match="forbidden_actions forbids"):
        EnvSpec(game="breakout", fire_reset=True, forbidden_actions=("FIRE",))


# -- the two paths agree -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("game", "max_frames", "steps", "action_seed", "min_ends"),
    [
        # random breakout loses its 5 lives in 130-200 steps: real terminations
        ("breakout", 108_000, 460, 2, 2),
        # a short frame limit (50 agent steps): several truncations
        ("pong", 200, 160, 0, 3),
    ],
    ids=["breakout-terminated", "pong-truncated"],
)
def test_single_and_vector_env_agree_frame_for_frame(game, max_frames, steps, action_seed,
                                                     min_ends):
    spec = EnvSpec(game=game, max_episode_frames=max_frames, **DETERMINISTIC)
    env = make_env(spec)
    venv = make_vector_env(spec, 1)
    try:
        n = env.action_space.n
        assert venv.single_action_space.n == n
        rng = np.random.default_rng(action_seed)
        obs, _ = env.reset(seed=123)
        vobs, _ = venv.reset(seed=123)
        assert vobs.shape == (1, 4, 84, 84)
        assert vobs.dtype == np.uint8
        assert_reset_stack(obs)
        np.testing.assert_array_equal(obs, vobs[0])
        ends = 0
        finished = False  # the vector env resets a finished env on the next step call
        for t in range(steps):
            action = int(rng.integers(n))
            if finished:
                # ale-py ignores this step's action and returns the new episode's first
                # observation with reward 0 and no episode end
                obs, _ = env.reset(seed=t)
                reward, terminated, truncated = 0.0, False, False
                assert_reset_stack(obs)
            else:
                obs, reward, terminated, truncated, _ = env.step(action)
            vobs, vreward, vterminated, vtruncated, _ = venv.step(np.array([action]))
            assert vobs.shape == (1, 4, 84, 84)
            assert vobs.dtype == np.uint8
            where = f"step {t} (after {ends} episode ends)"
            np.testing.assert_array_equal(obs, vobs[0], err_msg=where)
            assert float(vreward[0]) == reward, where
            assert bool(vterminated[0]) == terminated, where
            assert bool(vtruncated[0]) == truncated, where
            finished = terminated or truncated
            if finished:
                ends += 1
                assert obs[:-1].any(), "a stack at an episode's end is all real frames"
        assert ends >= min_ends, f"only {ends} episode ends in {steps} steps"
    finally:
        env.close()
        venv.close()


# -- the vector env ------------------------------------------------------------------------


def test_vector_env_shapes():
    venv = make_vector_env(EnvSpec(), 2)
    try:
        obs, _ = venv.reset(seed=0)
        assert obs.shape == (2, 4, 84, 84)
        assert obs.dtype == np.uint8
        for i in range(2):
            assert_reset_stack(obs[i])
        for _ in range(5):
            obs, reward, terminated, truncated, _ = venv.step(np.array([0, 1]))
            assert obs.shape == (2, 4, 84, 84)
            assert obs.dtype == np.uint8
            assert reward.shape == terminated.shape == truncated.shape == (2,)
        assert all(obs[i, j].any() for i in range(2) for j in range(4))
    finally:
        venv.close()


def test_vector_env_needs_one_env():
    for n in (0, -1):
        with pytest.raises(EnvError, match="at least 1"):
            make_vector_env(EnvSpec(), n)


def test_vector_env_reward_clipping_is_passed_through():
    actions = np.random.default_rng(5).integers(6, size=(120, 2))

    def rewards(clip: bool) -> set[float]:
        spec = EnvSpec(game="space_invaders", reward_clipping=clip, **DETERMINISTIC)
        venv = make_vector_env(spec, 2)
        venv.reset(seed=0)
        seen: set[float] = set()
        for a in actions:
            seen |= {float(r) for r in venv.step(a)[1]}
        venv.close()
        return seen

    raw, clipped = rewards(False), rewards(True)
    assert max(raw) > 1, f"space invaders scores more than 1 per hit: {raw}"
    assert clipped <= {-1.0, 0.0, 1.0}
    assert 1.0 in clipped


def test_vector_env_episodic_life_is_passed_through():
    def lives_at_first_end(episodic: bool) -> list[int]:
        venv = make_vector_env(EnvSpec(game="breakout", episodic_life=episodic,
                                       **DETERMINISTIC), 2)
        venv.reset(seed=0)
        rng = np.random.default_rng(1)
        try:
            for _ in range(2000):
                _, _, terminated, truncated, info = venv.step(rng.integers(4, size=2))
                done = terminated | truncated
                if done.any():
                    return [int(v) for v in np.asarray(info["lives"])[done]]
        finally:
            venv.close()
        raise AssertionError("no episode end in 2000 random steps of breakout")

    assert all(lives == 4 for lives in lives_at_first_end(True))
    assert all(lives == 0 for lives in lives_at_first_end(False))
