"""Shared builders of the files tests feed the stages: checkpoints and demo files.

Import them (`from builders import write_checkpoint`) or take the fixtures in conftest.py
that wrap them. Every builder writes a real file through the product's own writers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from oakemu_rl import PPOModel, PPOModelConfiguration
from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
from oakemu_rl.demos import DemoWriter, EpisodeBuffer
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings

SMALL = PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(32,))
"""A small trunk that fits 84x84 and 42x42 observations and trains in seconds."""


def write_checkpoint(path: Path, spec: EnvSpec | None = None, *, stage: str = "bc",
                     model: PPOModel | None = None, config: PPOModelConfiguration = SMALL,
                     seed: int = 0, steps: dict[str, int] | None = None,
                     parent: Checkpoint | None = None, inputs: list[Path] = ()) -> Path:
    """A checkpoint of `model` (default: a fresh seeded model of `config`) for `spec`."""
    spec = spec or EnvSpec(game="pong")
    meanings = list(action_meanings(spec.game, spec.full_action_space))
    if model is None:
        torch.manual_seed(seed)
        model = PPOModel(spec.observation_shape, len(meanings), config)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_checkpoint(path, Checkpoint.from_model(
        model, stage=stage, action_meanings=meanings,
        action_mask=action_mask(spec).tolist(), env_spec=spec.to_dict(), steps=steps,
        parent=parent, inputs=list(inputs)))


def write_demo_file(path: Path, episodes: list[EpisodeBuffer], spec: EnvSpec | None = None, *,
                    recorder: str = "scripted", first_seed: int = 0) -> Path:
    """A demo file holding `episodes`, seeded first_seed, first_seed + 1, ..."""
    path.parent.mkdir(parents=True, exist_ok=True)
    DemoWriter(path, spec or EnvSpec(game="pong")).write_episodes(
        [(e, recorder, first_seed + i) for i, e in enumerate(episodes)])
    return path


def random_episode(length: int, spec: EnvSpec | None = None, *, seed: int = 0,
                   actions: tuple[int, ...] = (0, 2, 3)) -> EpisodeBuffer:
    """`length` steps of random frames and actions drawn from `actions`, ending terminated."""
    spec = spec or EnvSpec(game="pong")
    rng = np.random.default_rng(seed)
    buffer = EpisodeBuffer()
    for t in range(length):
        frame = rng.integers(0, 255, spec.frame_shape, dtype=np.uint8)
        buffer.add(frame, int(rng.choice(actions)), 0.0, t == length - 1, False)
    return buffer


def record_scripted(path: Path, spec: EnvSpec | None = None, *, episodes: int = 1,
                    max_steps: int = 40, style: str = "planner", seed: int = 0) -> Path:
    """A demo file recorded by the scripted demonstrator in the real emulator."""
    from oakemu_rl.agents.recording import RecordConfig, record
    from oakemu_rl.agents.scripted import make_demonstrator

    spec = spec or EnvSpec(game="pong")
    record(RecordConfig(out=path, spec=spec, episodes=episodes, seed=seed,
                        max_steps=max_steps, progress=False),
           make_demonstrator(spec, seed=seed, style=style))
    return path
