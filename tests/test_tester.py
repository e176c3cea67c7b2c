"""The tester on the real emulator: checkpoints, masks, determinism, videos, result tables."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from builders import write_checkpoint
from PIL import Image

from oakemu_rl.agents import PolicyAgent, greedy_agent, load_policy_agent
from oakemu_rl.agents.onnx import OnnxPolicyAgent
from oakemu_rl.agents.play import (
    BATCH_GAMES,
    AgentActionError,
    EvalConfig,
    EvalResult,
    play_games,
)
from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
from oakemu_rl.envs import EnvSpec, action_mask, make_env
from oakemu_rl.errors import CheckpointError, ConfigError
from oakemu_rl.export import collect_observations
from oakemu_rl.model import PPOModel, PPOModelConfiguration
from oakemu_rl.tester import EMULATOR_HZ, evaluate, format_table

FIRE = 1  # Pong's minimal actions: NOOP, FIRE, RIGHT, LEFT, RIGHTFIRE, LEFTFIRE


class Recording:
    """Wraps an agent and keeps every action it returns, episode by episode."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.kind = agent.kind
        self.episodes: list[list[int]] = []

    def reset(self, env: Any, seed: int) -> None:
        self.episodes.append([])
        self.agent.reset(env, seed)

    def act(self, env: Any, observation: np.ndarray) -> int:
        action = self.agent.act(env, observation)
        self.episodes[-1].append(int(action))
        return action


class Constant:
    kind = "scripted"

    def __init__(self, action: Any) -> None:
        self.action = action

    def reset(self, env: Any, seed: int) -> None:
        pass

    def act(self, env: Any, observation: np.ndarray) -> Any:
        return self.action


class CrashAfter:
    kind = "scripted"

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.count = 0

    def reset(self, env: Any, seed: int) -> None:
        pass

    def act(self, env: Any, observation: np.ndarray) -> int:
        self.count += 1
        if self.count > self.steps:
            raise RuntimeError("agent crashed")
        return 0


def _save(tmp_path: Path, spec: EnvSpec, model: PPOModel | None = None) -> Path:
    return write_checkpoint(tmp_path / "agent.pt", spec, stage="scratch", model=model,
                            config=PPOModelConfiguration())


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


@pytest.mark.parametrize(("engine", "kind"), [("auto", OnnxPolicyAgent), ("onnx", OnnxPolicyAgent),
                                            ("torch", PolicyAgent)])
def test_checkpoint_agent_plays_n_episodes_deterministically(
    tmp_path: Path, engine: str, kind: type
) -> None:
    spec = EnvSpec(game="pong")
    path = _save(tmp_path, spec)
    agent, loaded_spec = load_policy_agent(path, device="cpu", engine=engine)
    assert isinstance(agent, kind)
    assert loaded_spec == spec

    config = EvalConfig(episodes=3, max_steps=40, seed=7)
    first = Recording(agent)
    result = evaluate(first, loaded_spec, config)
    assert len(result.scores) == len(result.lengths) == 3
    assert result.lengths == [40, 40, 40]  # Pong cannot end within 40 steps
    assert [len(actions) for actions in first.episodes] == [40, 40, 40]

    again_agent, _ = load_policy_agent(path, device="cpu", engine=engine)
    again = Recording(again_agent)
    repeat = evaluate(again, loaded_spec, config)
    assert repeat.scores == result.scores
    assert repeat.lengths == result.lengths
    assert again.episodes == first.episodes


def test_masked_action_is_never_taken(tmp_path: Path) -> None:
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE",))
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, 6)
    with torch.no_grad():
        model.policy_head.bias[FIRE] = 100.0
    path = _save(tmp_path, spec, model)
    agent, loaded_spec = load_policy_agent(path, device="cpu")

    # Without the mask the model would always fire: the test can fail.
    env = make_env(loaded_spec)
    observation, _ = env.reset(seed=0)
    env.close()
    assert PolicyAgent(model, None).act(None, observation) == FIRE

    recording = Recording(agent)
    evaluate(recording, loaded_spec, EvalConfig(episodes=2, max_steps=30))
    played = [a for episode in recording.episodes for a in episode]
    assert len(played) == 60
    assert FIRE not in played


def test_greedy_engines_play_the_same_actions() -> None:
    """onnxruntime (the CPU default) and the torch model choose alike on a real game, for a
    model whose choices vary; then training the model does not reach the onnx agent."""
    spec = EnvSpec(game="pong")
    mask = action_mask(spec)
    model = _varied_model(spec)
    config = EvalConfig(episodes=1, max_steps=300, seed=4)
    played = {}
    for engine in ("onnx", "torch"):
        recording = Recording(greedy_agent(model, mask, device="cpu", engine=engine))
        evaluate(recording, spec, config, progress=False)
        played[engine] = recording.episodes[0]
    counts = sorted(played["torch"].count(a) for a in set(played["torch"]))
    assert len(counts) >= 4 and counts[-2] >= 30  # not a constant policy
    assert played["onnx"] == played["torch"]

    frozen = greedy_agent(model, mask, device="cpu", engine="onnx")
    env = make_env(spec)
    observation, _ = env.reset(seed=0)
    env.close()
    before = frozen.logits(observation[None])
    with torch.no_grad():
        model.policy_head.bias += 10.0
    assert np.array_equal(frozen.logits(observation[None]), before)
    with pytest.raises(ConfigError, match="unknown greedy engine"):
        greedy_agent(model, mask, engine="fast")


class Together:
    """Wraps a greedy policy agent: keeps the size of every batch it chooses for, and
    refuses to choose one game's action alone."""

    kind = "policy"
    plays_batches = True

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.batches: list[int] = []
        self.seeds: list[int] = []

    def reset(self, env: Any, seed: int) -> None:
        self.seeds.append(seed)
        self.agent.reset(env, seed)

    def act_batch(self, observations: np.ndarray) -> np.ndarray:
        self.batches.append(len(observations))
        return self.agent.act_batch(observations)

    def act(self, env: Any, observation: np.ndarray) -> int:
        raise AssertionError("games played together choose their actions in batches")


def _varied_model(spec: EnvSpec) -> PPOModel:
    """A model whose greedy choices vary on the game's real frames."""
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, int(action_mask(spec).size))
    frames = torch.as_tensor(np.stack(collect_observations(spec, 64, seed=1,
                                                           mask=action_mask(spec))))
    with torch.no_grad():  # large weights, logits centred on real frames: choices vary
        torch.nn.init.orthogonal_(model.policy_head.weight, gain=100.0)
        model.policy_head.bias -= model.get_logits(frames).mean(0)
    return model


@pytest.mark.parametrize("engine", ["onnx", "torch"])
def test_greedy_games_played_together_are_the_games_played_in_turn(engine: str) -> None:
    """A greedy policy plays its games 8 at a time, one forward pass per step for all of
    them, and each game's score and length are those of the same game played alone: the
    order of the seeds is kept while games of different lengths end at different times."""
    spec = EnvSpec(game="breakout")
    agent = greedy_agent(_varied_model(spec), action_mask(spec), device="cpu", engine=engine)
    assert agent.plays_batches
    config = EvalConfig(episodes=10, max_steps=600, seed=4)
    together = Together(agent)
    result = play_games(together, spec, config, progress=False)
    in_turn = play_games(Recording(agent), spec, config, progress=False)
    assert (result.scores, result.lengths) == (in_turn.scores, in_turn.lengths)
    assert len(set(result.lengths)) > 1 and len(set(result.scores)) > 1  # the games differ
    assert together.batches[0] == BATCH_GAMES == 8
    assert together.batches[-1] < BATCH_GAMES  # the last games finish without the others
    assert sorted(together.seeds) == list(config.seeds)
    assert sum(together.batches) == sum(result.lengths)


def test_sampling_and_filmed_games_are_played_in_turn() -> None:
    """Drawn actions follow each game's own generator, and a film follows one game at a
    time: neither plays games together."""
    spec = EnvSpec(game="pong")
    model = _varied_model(spec)
    for engine in ("onnx", "torch"):
        assert not greedy_agent(model, action_mask(spec), device="cpu", engine=engine,
                                sample=True).plays_batches
    seen: list[int] = []
    together = Together(greedy_agent(model, action_mask(spec), device="cpu"))
    with pytest.raises(AssertionError, match="choose their actions in batches"):
        play_games(together, spec, EvalConfig(episodes=2, max_steps=5), progress=False,
                   watch=lambda episode, env: seen.append(episode))
    assert seen == [0]


@pytest.mark.parametrize("engine", ["onnx", "torch"])
def test_sampled_play_draws_from_the_masked_policy_and_replays_by_seed(
    tmp_path: Path, engine: str
) -> None:
    """`sample=True` draws each action from the softmax over the allowed actions: a policy
    whose probabilities are set by its bias alone plays them in proportion, never the
    forbidden one however likely the logits make it, and the same game seeds replay the
    same draws while other seeds draw otherwise."""
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE",))
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, 6)
    # NOOP, FIRE, RIGHT, LEFT, RIGHTFIRE, LEFTFIRE: FIRE is the likeliest and forbidden
    wanted = np.array([0.5, 0.0, 0.3, 0.2, 0.0, 0.0])
    with torch.no_grad():
        model.policy_head.weight.zero_()
        model.policy_head.bias.copy_(torch.tensor([np.log(0.5), 3.0, np.log(0.3),
                                                   np.log(0.2), -30.0, -30.0]))
    path = _save(tmp_path, spec, model)
    config = EvalConfig(episodes=2, max_steps=600, seed=11)

    def play(sample: bool, seed: int = config.seed) -> list[list[int]]:
        agent, loaded = load_policy_agent(path, device="cpu", engine=engine, sample=sample)
        recording = Recording(agent)
        evaluate(recording, loaded, dataclasses.replace(config, seed=seed), progress=False)
        return recording.episodes

    greedy = play(False)
    assert {a for episode in greedy for a in episode} == {0}  # argmax of the allowed ones

    sampled = play(True)
    actions = np.array([a for episode in sampled for a in episode])
    frequencies = np.bincount(actions, minlength=6) / actions.size
    assert actions.size == 1200 and frequencies[1] == 0.0
    # 1200 draws: each frequency within about 4 standard errors of its probability
    assert np.abs(frequencies - wanted).max() < 0.06, frequencies
    assert play(True) == sampled
    assert play(True, seed=config.seed + 5) != sampled


def test_oakemu_test_sample_plays_the_checkpoint_and_its_export_by_their_draws(
    tmp_path: Path
) -> None:
    """`oakemu test --sample` reaches both players: a policy that never moves when greedy
    moves on about half its steps when sampled, which plays other games than the greedy
    ones, and a rerun plays the same game again."""
    from click.testing import CliRunner

    from oakemu_rl.agents.onnx import load_onnx_agent
    from oakemu_rl.cli import cli
    from oakemu_rl.export import export_onnx

    right = 2  # Pong's RIGHT moves the paddle (FIRE alone would not change the game)
    spec = EnvSpec(game="pong")
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, 6)
    with torch.no_grad():  # NOOP 0.55, RIGHT 0.45: greedy never moves
        model.policy_head.weight.zero_()
        model.policy_head.bias.copy_(torch.tensor([0.2, -30.0, 0.0, -30.0, -30.0, -30.0]))
    path = _save(tmp_path, spec, model)
    export_onnx(path, tmp_path / "policy.onnx", verify_frames=8)
    args = ["test", str(path), "--onnx", str(tmp_path / "policy.onnx"), "--episodes", "1",
            "--max-steps", "400", "--seed", "3"]
    greedy = CliRunner().invoke(cli, args)
    assert greedy.exit_code == 0, greedy.output
    assert "ALE/Pong-v5, greedy, 1 episode(s), seed 3" in greedy.stdout.splitlines()
    sampled = CliRunner().invoke(cli, [*args, "--sample"])
    assert sampled.exit_code == 0, sampled.output
    assert "ALE/Pong-v5, sampled, 1 episode(s), seed 3" in sampled.stdout.splitlines()
    # Both lose every point at the same pace, so the film shows whether the paddle moved.
    for player in ([str(path)], ["--onnx", str(tmp_path / "policy.onnx")]):
        films = []
        for n, extra in enumerate(([], ["--sample"], ["--sample"])):
            video = tmp_path / f"{n}.gif"
            result = CliRunner().invoke(cli, ["test", *player, "--episodes", "1",
                                              "--max-steps", "120", "--seed", "3",
                                              "--video", str(video), *extra])
            assert result.exit_code == 0, result.output
            films.append(video.read_bytes())
        assert films[1] == films[2] and films[1] != films[0], player

    for sample, moved in ((False, (0, 0)), (True, (120, 280))):
        players = [load_policy_agent(path, device="cpu", sample=sample)[0],
                   load_onnx_agent(tmp_path / "policy.onnx", sample=sample)[0]]
        for agent in players:
            recording = Recording(agent)
            evaluate(recording, spec, EvalConfig(episodes=1, max_steps=400, seed=3),
                     progress=False)
            assert moved[0] <= recording.episodes[0].count(right) <= moved[1], sample


@pytest.mark.parametrize(
    ("action", "message"),
    [(FIRE, "forbidden action FIRE"), (99, "actions 0..5"), ("left", "not an action index")],
)
def test_agent_returning_a_bad_action_makes_evaluate_raise(action: Any, message: str) -> None:
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE",))
    with pytest.raises(AgentActionError, match=message):
        evaluate(Constant(action), spec, EvalConfig(episodes=1, max_steps=10))


def test_numpy_integer_actions_are_accepted() -> None:
    result = evaluate(Constant(np.int64(3)), EnvSpec(game="pong"),
                      EvalConfig(episodes=1, max_steps=5))
    assert result.lengths == [5]


def test_gif_video_of_the_first_episode(tmp_path: Path) -> None:
    spec = EnvSpec(game="pong")
    video = tmp_path / "videos" / "pong.gif"
    result = evaluate(Constant(3), spec, EvalConfig(episodes=2, max_steps=30, seed=4),
                      video=video)
    assert result.lengths == [30, 30]  # both games are played, only the first is filmed
    assert _leftovers(video.parent) == []
    with Image.open(video) as gif:
        assert gif.format == "GIF"
        assert gif.n_frames > 1
        assert gif.size == (320, 420)  # 160x210 screen, upscaled 2x
        first = np.asarray(gif.convert("RGB"))
        # Pillow merges identical neighbouring frames and adds up their delays, so the
        # total delay counts the frames written: the reset screen and one per step of
        # the first episode (31), not those of both episodes (62).
        delays = []
        for index in range(gif.n_frames):
            gif.seek(index)
            delays.append(gif.info["duration"])
        last = np.asarray(gif.convert("RGB"))
    env = make_env(spec.for_evaluation(), render_mode="rgb_array")
    env.reset(seed=4)
    screen = env.unwrapped.render()
    for _ in range(30):
        env.step(3)
    end_of_first = env.unwrapped.render()
    env.close()
    np.testing.assert_array_equal(first, screen.repeat(2, axis=0).repeat(2, axis=1))
    np.testing.assert_array_equal(last, end_of_first.repeat(2, axis=0).repeat(2, axis=1))
    frame_ms = round(100 * spec.frame_skip / EMULATOR_HZ) * 10  # GIF delays: 1/100 s
    assert sum(delays) == 31 * frame_ms


def test_play_games_lets_watch_see_every_reset_and_step() -> None:
    agent = CrashAfter(100)  # plays NOOP and counts its steps
    seen: list[tuple[int, int, tuple[int, ...]]] = []

    def watch(episode: int, env: Any) -> None:
        seen.append((episode, agent.count, env.unwrapped.render().shape))

    result = play_games(agent, EnvSpec(game="pong"), EvalConfig(episodes=2, max_steps=7),
                        progress=False, watch=watch)
    assert result.lengths == [7, 7]
    assert len(seen) == 2 + 14  # one call per reset and one per step
    screen = (210, 160, 3)
    assert seen == [(0, n, screen) for n in range(8)] + [(1, n, screen) for n in range(7, 15)]


def test_mp4_video(tmp_path: Path) -> None:
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    video = tmp_path / "pong.MP4"
    evaluate(Constant(2), EnvSpec(game="pong"), EvalConfig(episodes=2, max_steps=25),
             video=video)
    assert _leftovers(tmp_path) == []
    reader = imageio_ffmpeg.read_frames(str(video))
    meta = next(reader)
    frames = sum(1 for _ in reader)
    assert meta["codec"] == "h264"
    assert tuple(meta["size"]) == (320, 420)
    assert meta["fps"] == pytest.approx(15.0)
    assert frames == 26  # the reset screen and one per step


def test_mp4_without_imageio_ffmpeg_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import now fails
    video = tmp_path / "pong.mp4"
    with pytest.raises(ConfigError, match=r"imageio-ffmpeg.*\.gif"):
        evaluate(Constant(0), EnvSpec(game="pong"), EvalConfig(episodes=1, max_steps=5),
                 video=video)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".gif", ".mp4"])
def test_a_crash_leaves_no_half_written_video(tmp_path: Path, suffix: str) -> None:
    if suffix == ".mp4":
        pytest.importorskip("imageio_ffmpeg")
    video = tmp_path / f"pong{suffix}"
    video.write_bytes(b"previous video")
    with pytest.raises(RuntimeError, match="agent crashed"):
        evaluate(CrashAfter(10), EnvSpec(game="pong"),
                 EvalConfig(episodes=1, max_steps=30), video=video)
    assert video.read_bytes() == b"previous video"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["pong.avi", "pong", "pong.gif.txt"])
def test_bad_video_extension_is_a_config_error(tmp_path: Path, name: str) -> None:
    agent = CrashAfter(0)  # the path is refused before any game is played
    with pytest.raises(ConfigError, match=r"\.gif or \.mp4"):
        evaluate(agent, EnvSpec(game="pong"), EvalConfig(episodes=1, max_steps=5),
                 video=tmp_path / name)
    assert agent.count == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs", [{"episodes": 0}, {"episodes": 1.5}, {"seed": -1}, {"max_steps": 0}]
)
def test_bad_config_values_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        EvalConfig(**kwargs)


def test_progress_bar_shows_the_last_score(capsys: pytest.CaptureFixture[str]) -> None:
    evaluate(Constant(0), EnvSpec(game="pong"), EvalConfig(episodes=2, max_steps=5),
             progress=True)
    err = capsys.readouterr().err
    assert "2/2" in err and "score=" in err


def test_checkpoint_for_other_actions_is_refused(tmp_path: Path) -> None:
    spec = EnvSpec(game="pong")
    model = PPOModel(spec.observation_shape, 4)
    checkpoint = Checkpoint.from_model(
        model, stage="scratch", action_meanings=["NOOP", "FIRE", "RIGHT", "LEFT"],
        action_mask=[True] * 4, env_spec=spec.to_dict(),
    )
    path = save_checkpoint(tmp_path / "other.pt", checkpoint)
    with pytest.raises(CheckpointError, match="actions"):
        load_policy_agent(path, device="cpu")


def test_eval_result_statistics() -> None:
    result = EvalResult(scores=[1.0, -2.0, 3.0, 6.0], lengths=[10, 20, 30, 40])
    assert result.episodes == 4
    assert result.mean == 2.0
    assert result.std == pytest.approx(math.sqrt(8.5))  # deviations -1, -4, 1, 4
    assert (result.min, result.max) == (-2.0, 6.0)
    assert result.mean_length == 25.0
    assert result.std_length == pytest.approx(math.sqrt(125.0))
    assert (result.min_length, result.max_length) == (10, 40)
    data = result.to_dict()
    assert data["scores"] == [1.0, -2.0, 3.0, 6.0]
    assert data["lengths"] == [10, 20, 30, 40]
    assert data["mean"] == 2.0 and data["max"] == 6.0 and data["mean_length"] == 25.0
    assert math.isnan(EvalResult().mean)
    with pytest.raises(ValueError):
        EvalResult(scores=[1.0], lengths=[])


def test_format_table_has_a_row_per_agent() -> None:
    table = format_table({
        "checkpoint": EvalResult(scores=[1.0, -2.0, 3.0, 6.0], lengths=[10, 20, 30, 40]),
        "scripted": EvalResult(scores=[-21.0], lengths=[764]),
    })
    lines = table.splitlines()
    assert lines[0].split() == ["agent", "games", "mean", "±", "SE", "std", "min", "max",
                                "mean", "length"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    # each mean with its standard error (sample std / √4 = 3.3665 / 2) and its games
    assert rows["checkpoint"] == ["4", "2.00", "±", "1.68", "2.9", "-2.0", "6.0", "25.0"]
    assert rows["scripted"] == ["1", "-21.00", "±", "n/a", "0.0", "-21.0", "-21.0", "764.0"]


def test_sem_is_the_standard_error_of_the_mean() -> None:
    # scores 1, -2, 3, 6: mean 2, squared deviations 1 + 16 + 1 + 16 = 34, sample variance
    # 34 / 3, so SE = sqrt(34 / 3) / sqrt(4) = 1.68325...
    result = EvalResult(scores=[1.0, -2.0, 3.0, 6.0], lengths=[10, 20, 30, 40])
    assert result.sem == pytest.approx(1.6832508230603465, abs=1e-12)
    assert result.to_dict()["sem"] == result.sem
    assert result.summary() == "+2.00 ± 1.68 (4 games)"
    assert math.isnan(EvalResult(scores=[5.0], lengths=[1]).sem)
    assert EvalResult(scores=[5.0], lengths=[1]).summary() == "+5.00 (1 game, no SE)"
    assert math.isnan(EvalResult().sem)
