"""The tester: greedy evaluation of an agent on whole games, with an optional video.

`evaluate(agent, spec, config)` plays `config.episodes` games on the evaluation spec (raw
game rewards, a lost life does not end the game), one env, episode i seeded with
`seed + i`, so the same agent and seed always give the same scores. Every action is
checked against the spec's action mask. With `config.video` set, the first episode's RGB
screen is written as a .gif (Pillow) or .mp4 (H.264 through imageio-ffmpeg) that a person
can watch; the file appears only once it is complete.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .agents import Agent, PolicyAgent, resolve_device
from .checkpoint import checkpoint_spec, load_checkpoint
from .envs import EnvSpec, action_mask, action_meanings, make_env
from .errors import ConfigError, OakEmuError
from .fsutil import atomic_write, commit, temp_beside
from .model import PPOModel

VIDEO_FORMATS = (".gif", ".mp4")
"""Video file extensions the tester writes."""
VIDEO_SCALE = 2
"""Each emulator pixel becomes a VIDEO_SCALE × VIDEO_SCALE block (nearest neighbour)."""
EMULATOR_HZ = 60
"""Frames per second of the emulated console; the video shows one frame per agent step."""


class AgentActionError(OakEmuError, ValueError):
    """An agent returned an action that is not a valid, allowed action index."""


def check_video_path(video: Path | str) -> Path:
    """Return `video` as a Path, or raise `ConfigError` if the tester cannot write it."""
    path = Path(video)
    if path.suffix.lower() not in VIDEO_FORMATS:
        raise ConfigError(
            f"cannot write a video to {path}: the name must end in .gif or .mp4"
        )
    if path.is_dir():
        raise ConfigError(f"cannot write a video to {path}: it is a directory")
    return path


@dataclass(frozen=True)
class EvalConfig:
    """How the tester plays. (Not `TestConfig`: pytest would try to collect that name.)"""

    episodes: int = 5
    """Games to play."""
    seed: int = 0
    """Episode i is played with seed `seed + i` (no-op starts and sticky actions)."""
    max_steps: int | None = None
    """Agent steps after which an episode is cut; None plays until the emulator ends it."""
    video: Path | None = None
    """A .gif or .mp4 file to write the first episode to; None writes no video."""
    progress: bool = True
    """Show a tqdm bar over episodes with the last score (on stderr)."""

    def __post_init__(self) -> None:
        if isinstance(self.episodes, bool) or not isinstance(self.episodes, int) \
                or self.episodes < 1:
            raise ConfigError(f"episodes must be a positive integer, got {self.episodes!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.max_steps is not None and (
            isinstance(self.max_steps, bool)
            or not isinstance(self.max_steps, int)
            or self.max_steps < 1
        ):
            raise ConfigError(
                f"max_steps must be a positive integer or None, got {self.max_steps!r}"
            )
        if self.video is not None:
            object.__setattr__(self, "video", check_video_path(self.video))


# -- results ----------------------------------------------------------------------------


def _stat(values: list[float], fn: Any) -> float:
    return float(fn(np.asarray(values, dtype=np.float64))) if values else math.nan


@dataclass
class EvalResult:
    """Scores (sum of raw game rewards) and lengths (agent steps) of the episodes played.

    The statistics are over episodes; `std` is the population standard deviation (ddof=0).
    They are NaN for a result with no episodes.
    """

    scores: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.lengths):
            raise ValueError(
                f"{len(self.scores)} scores but {len(self.lengths)} lengths; they must match"
            )

    @property
    def episodes(self) -> int:
        return len(self.scores)

    @property
    def mean(self) -> float:
        return _stat(self.scores, np.mean)

    @property
    def std(self) -> float:
        return _stat(self.scores, np.std)

    @property
    def min(self) -> float:
        return _stat(self.scores, np.min)

    @property
    def max(self) -> float:
        return _stat(self.scores, np.max)

    @property
    def mean_length(self) -> float:
        return _stat(self.lengths, np.mean)

    @property
    def std_length(self) -> float:
        return _stat(self.lengths, np.std)

    @property
    def min_length(self) -> float:
        return _stat(self.lengths, np.min)

    @property
    def max_length(self) -> float:
        return _stat(self.lengths, np.max)

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready): the per-episode lists and their statistics."""
        return {
            "episodes": self.episodes,
            "scores": [float(s) for s in self.scores],
            "lengths": [int(n) for n in self.lengths],
            "mean": self.mean,
            "std": self.std,
            "min": self.min,
            "max": self.max,
            "mean_length": self.mean_length,
            "std_length": self.std_length,
            "min_length": self.min_length,
            "max_length": self.max_length,
        }


def format_table(results: dict[str, EvalResult]) -> str:
    """A plain-text table with one row per named agent, so several agents compare at once."""
    header = ["agent", "episodes", "mean", "std", "min", "max", "mean length"]
    rows = [
        [
            name,
            str(r.episodes),
            f"{r.mean:.1f}",
            f"{r.std:.1f}",
            f"{r.min:.1f}",
            f"{r.max:.1f}",
            f"{r.mean_length:.1f}",
        ]
        for name, r in results.items()
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


# -- video --------------------------------------------------------------------------------


def _upscale(frame: np.ndarray) -> np.ndarray:
    return np.repeat(np.repeat(frame, VIDEO_SCALE, axis=0), VIDEO_SCALE, axis=1)


class _GifWriter:
    """Keeps the episode's frames in memory (about 0.25 MB per step while saving) and
    writes them at the end: GIF suits short clips; use .mp4 for whole long games."""

    def __init__(self, path: Path, fps: float) -> None:
        self.path = path
        # GIF delays are in hundredths of a second.
        self.duration_ms = max(20, round(100.0 / fps) * 10)
        self.frames: list[np.ndarray] = []

    def add(self, frame: np.ndarray) -> None:
        self.frames.append(np.ascontiguousarray(frame, dtype=np.uint8))

    def finish(self) -> None:
        from PIL import Image

        if not self.frames:
            raise OakEmuError(f"no frames to write to {self.path}")
        images = (Image.fromarray(_upscale(f)) for f in self.frames)
        first = next(images)
        with atomic_write(self.path) as handle:
            first.save(handle, format="GIF", save_all=True, append_images=images,
                       duration=self.duration_ms, loop=0)
        self.frames = []

    def abort(self) -> None:
        self.frames = []


class _Mp4Writer:
    """Streams frames to the ffmpeg binary shipped in the imageio-ffmpeg wheel (H.264)."""

    def __init__(self, path: Path, fps: float) -> None:
        self.path = path
        self.fps = fps
        self._gen: Any = None
        self._tmp: Path | None = None

    def add(self, frame: np.ndarray) -> None:
        image = np.ascontiguousarray(_upscale(frame), dtype=np.uint8)
        if self._gen is None:
            import imageio_ffmpeg

            self._tmp = temp_beside(self.path, suffix=self.path.suffix)
            height, width = image.shape[:2]
            self._gen = imageio_ffmpeg.write_frames(
                str(self._tmp),
                (width, height),
                fps=self.fps,
                quality=8,
                macro_block_size=2,  # 2x screens are even-sized: no rescaling needed
                ffmpeg_log_level="error",
                output_params=["-movflags", "+faststart"],
            )
            self._gen.send(None)
        self._gen.send(image)

    def finish(self) -> None:
        if self._gen is None or self._tmp is None:
            raise OakEmuError(f"no frames to write to {self.path}")
        gen, self._gen = self._gen, None
        try:
            gen.close()  # ffmpeg finishes the file and exits
        except BaseException:
            self.abort()
            raise
        tmp, self._tmp = self._tmp, None
        if tmp.stat().st_size == 0:
            tmp.unlink()
            raise OakEmuError(f"ffmpeg wrote nothing for {self.path}")
        commit(tmp, self.path)

    def abort(self) -> None:
        gen, self._gen = self._gen, None
        tmp, self._tmp = self._tmp, None
        if gen is not None:
            with contextlib.suppress(Exception):
                gen.close()
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _check_mp4_support() -> None:
    try:
        import imageio_ffmpeg
    except ImportError:
        raise ConfigError(
            "writing an .mp4 video needs the imageio-ffmpeg package (pip install "
            "imageio-ffmpeg); install it or ask for a .gif video instead"
        ) from None
    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError:
        raise ConfigError(
            "imageio-ffmpeg has no ffmpeg binary for this machine, so no .mp4 can be "
            "written; ask for a .gif video instead"
        ) from None


def _video_writer(path: Path, spec: EnvSpec) -> _GifWriter | _Mp4Writer:
    fps = EMULATOR_HZ / spec.frame_skip
    if path.suffix.lower() == ".mp4":
        _check_mp4_support()
        return _Mp4Writer(path, fps)
    return _GifWriter(path, fps)


# -- evaluation ---------------------------------------------------------------------------


def _checked_action(raw: Any, mask: np.ndarray, meanings: tuple[str, ...], agent: Any) -> int:
    kind = getattr(agent, "kind", type(agent).__name__)
    try:
        action = operator.index(raw)
    except TypeError:
        raise AgentActionError(
            f"the {kind} agent returned {raw!r}, which is not an action index"
        ) from None
    if not 0 <= action < len(mask):
        raise AgentActionError(
            f"the {kind} agent returned action {action}, but the game has actions "
            f"0..{len(mask) - 1}"
        )
    if not mask[action]:
        allowed = [m for m, ok in zip(meanings, mask, strict=True) if ok]
        raise AgentActionError(
            f"the {kind} agent chose the forbidden action {meanings[action]} ({action}); "
            f"the action mask allows only {', '.join(allowed)}"
        )
    return action


def evaluate(agent: Agent, spec: EnvSpec, config: EvalConfig | None = None) -> EvalResult:
    """Play `config.episodes` games with `agent` and return their scores and lengths.

    The games use `spec.for_evaluation()`: raw rewards, whole games. An action the spec's
    mask forbids (or that is out of range) raises `AgentActionError`.
    """
    config = config or EvalConfig()
    spec = spec.for_evaluation()
    mask = action_mask(spec)
    meanings = action_meanings(spec.game, spec.full_action_space)
    writer = _video_writer(config.video, spec) if config.video is not None else None
    result = EvalResult()
    env = make_env(spec, render_mode="rgb_array")
    bar = tqdm(total=config.episodes, unit="episode", disable=not config.progress,
               desc=f"evaluating {spec.game}")
    try:
        for episode in range(config.episodes):
            seed = config.seed + episode
            recording = writer if episode == 0 else None
            observation, _ = env.reset(seed=seed)
            agent.reset(env, seed)
            if recording is not None:
                recording.add(env.unwrapped.render())
            score, steps = 0.0, 0
            while config.max_steps is None or steps < config.max_steps:
                action = _checked_action(agent.act(env, observation), mask, meanings, agent)
                observation, reward, terminated, truncated, _ = env.step(action)
                score += float(reward)
                steps += 1
                if recording is not None:
                    recording.add(env.unwrapped.render())
                if terminated or truncated:
                    break
            if recording is not None:
                recording.finish()
                writer = None
            result.scores.append(score)
            result.lengths.append(steps)
            bar.set_postfix(score=f"{score:+.0f}", steps=steps)
            bar.update(1)
    finally:
        if writer is not None:
            writer.abort()
        bar.close()
        env.close()
    return result


GREEDY_ENGINES = ("auto", "torch", "onnx")


def greedy_agent(model: PPOModel, action_mask: np.ndarray, *, device: str = "auto",
                 engine: str = "auto") -> Agent:
    """An agent that plays `model` greedily over the allowed actions.

    engine "onnx" runs the policy through onnxruntime on CPU, "torch" runs the model itself
    on `device`, and "auto" takes onnxruntime when the device resolves to the CPU: at batch
    1 it played Pong at 1,412-1,531 steps/s against 740-904 for the torch model on 2 threads,
    with the same actions (benchmarks/greedy_play.py measures it). The threads are torch's
    (`torch.get_num_threads()`), so a caller that limits torch limits this too.
    """
    if engine not in GREEDY_ENGINES:
        raise ConfigError(f"unknown greedy engine {engine!r} (choose from "
                          f"{', '.join(GREEDY_ENGINES)})")
    torch_device = resolve_device(device)
    mask = np.asarray(action_mask, dtype=bool)
    if engine == "onnx" or (engine == "auto" and torch_device.type == "cpu"):
        from .export import OnnxPolicyAgent

        return OnnxPolicyAgent.from_model(model, mask, threads=torch.get_num_threads())
    return PolicyAgent(model, mask, greedy=True, device=torch_device)


def load_policy_agent(
    checkpoint_path: str | Path, device: str = "auto", *, engine: str = "auto"
) -> tuple[Agent, EnvSpec]:
    """A greedy agent for the checkpoint's model and mask (`greedy_agent`), and the
    checkpoint's spec."""
    path = Path(checkpoint_path)
    checkpoint = load_checkpoint(path)
    spec = checkpoint_spec(checkpoint, path)
    torch_device = resolve_device(device)
    model = checkpoint.build_model(torch_device)
    agent = greedy_agent(model, np.asarray(checkpoint.action_mask, dtype=bool),
                         device=device, engine=engine)
    return agent, spec
