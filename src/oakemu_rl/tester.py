"""Stage: the tester, greedy games of an agent scored in a table, with an optional video.

`evaluate(agent, spec, config)` plays the games (`agents.play.play_games`: the evaluation
spec, whole games, seeded, every action checked against the mask). With `video`, the first
episode's RGB screen is written as a .gif (Pillow) or .mp4 (H.264 through imageio-ffmpeg)
that a person can watch.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np

from .agents import Agent
from .agents.play import EvalConfig, EvalResult, play_games
from .envs import EnvSpec, require_same_env
from .errors import ConfigError, OakEmuError
from .fsutil import atomic_write, commit, temp_beside

VIDEO_FORMATS = (".gif", ".mp4")
"""Video file extensions the tester writes."""
VIDEO_SCALE = 2
"""Each emulator pixel becomes a VIDEO_SCALE × VIDEO_SCALE block (nearest neighbour)."""
EMULATOR_HZ = 60
"""Frames per second of the emulated console; the video shows one frame per agent step."""


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


# -- results ----------------------------------------------------------------------------


def format_table(results: dict[str, EvalResult]) -> str:
    """A plain-text table with one row per named agent, so several agents compare at once.
    Each mean is quoted with its standard error (`± SE`, n/a for one game) beside the
    number of games it is the mean of."""
    header = ["agent", "games", "mean ± SE", "std", "min", "max", "mean length"]
    rows = [
        [
            name,
            str(r.episodes),
            f"{r.mean:.2f} ± " + ("n/a" if math.isnan(r.sem) else f"{r.sem:.2f}"),
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


def evaluate(agent: Agent, spec: EnvSpec, config: EvalConfig | None = None, *,
             video: Path | str | None = None, progress: bool = True) -> EvalResult:
    """Play `config.episodes` greedy games with `agent` (`play_games`) and, with `video`,
    film the first one: the file appears only once it is complete, and a failure leaves
    what was there before."""
    if video is None:
        return play_games(agent, spec, config, progress=progress)
    writer = _video_writer(check_video_path(video), spec.for_evaluation())

    def film(episode: int, env: Any) -> None:
        if episode == 0:
            writer.add(env.unwrapped.render())

    try:
        result = play_games(agent, spec, config, progress=progress, watch=film)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return result




def score_agents(config: EvalConfig, *, checkpoint: str | Path | None = None,
                 onnx: str | Path | None = None, scripted_style: str | None = None,
                 spec: EnvSpec | None = None, video: str | Path | None = None,
                 device: str = "auto", progress: bool = True, sample: bool = False
                 ) -> tuple[EnvSpec, dict[str, EvalResult]]:
    """What `oakemu test` plays: a checkpoint, an exported .onnx policy and the scripted
    demonstrator (in `scripted_style`), each on the same games, the first one filmed. A
    checkpoint or export plays its own env spec; `spec` is only for the demonstrator alone.
    `sample` makes the policies draw their actions instead of taking the argmax (the
    scripted demonstrator plays as it always does)."""
    from .agents import load_policy_agent
    from .agents.onnx import load_onnx_agent
    from .agents.scripted import make_demonstrator

    if checkpoint is None and onnx is None and scripted_style is None:
        raise OakEmuError("give a CHECKPOINT to test, --onnx MODEL, or --demonstrator scripted")
    results: dict[str, EvalResult] = {}
    played: EnvSpec | None = None
    if checkpoint is not None:
        agent, played = load_policy_agent(checkpoint, device=device, sample=sample)
        results["checkpoint"] = evaluate(agent, played, config, video=video, progress=progress)
        video = None
    if onnx is not None:
        agent, onnx_spec = load_onnx_agent(onnx, sample=sample)
        if played is not None:
            require_same_env(f"{onnx}", onnx_spec, agent.action_meanings, str(checkpoint),
                             played, agent.action_meanings,
                             hint="export the checkpoint you test", error=OakEmuError)
        played = onnx_spec
        results["onnx"] = evaluate(agent, played, config, video=video, progress=progress)
        video = None
    if scripted_style is not None:
        played = played or spec or EnvSpec()
        demonstrator = make_demonstrator(played, seed=config.seed, style=scripted_style)
        results["scripted"] = evaluate(demonstrator, played, config, video=video,
                                       progress=progress)
    return played, results
