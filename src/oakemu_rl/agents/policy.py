"""Playing a trained policy: from a checkpoint (or a live model) to a greedy agent.

The tester, the recorder (`record --policy`), PPO's evaluation games and the relabelling
rounds all get their policy players here, so the masked argmax and the choice of engine
(onnxruntime on the CPU, the torch model on a GPU) are made in one place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..checkpoint import checkpoint_spec, load_checkpoint
from ..envs import EnvSpec
from ..errors import ConfigError
from ..model import PPOModel
from ..runtime import resolve_device
from .base import Agent, PolicyAgent

GREEDY_ENGINES = ("auto", "torch", "onnx")


def greedy_agent(model: PPOModel, action_mask: np.ndarray, *, device: str = "auto",
                 engine: str = "auto", sample: bool = False) -> Agent:
    """An agent that plays `model` greedily over the allowed actions, or with `sample` draws
    each action from the policy (seeded by each game's seed: the same games, the same
    draws with one engine; the two engines draw from different generators).

    engine "onnx" runs the policy through onnxruntime on CPU, "torch" runs the model itself
    on `device`, and "auto" takes onnxruntime when the device resolves to the CPU: one
    batch-1 forward pass per emulator step is where eager torch is slowest, and onnxruntime
    plays faster with the same actions (benchmarks/greedy_play.py; docs/results.md, "Greedy
    play speed"). The threads are torch's (`torch.get_num_threads()`), so a caller that
    limits torch limits this too.
    """
    if engine not in GREEDY_ENGINES:
        raise ConfigError(f"unknown greedy engine {engine!r} (choose from "
                          f"{', '.join(GREEDY_ENGINES)})")
    torch_device = resolve_device(device)
    mask = np.asarray(action_mask, dtype=bool)
    if engine == "onnx" or (engine == "auto" and torch_device.type == "cpu"):
        from .onnx import OnnxPolicyAgent

        return OnnxPolicyAgent.from_model(model, mask, threads=torch.get_num_threads(),
                                          sample=sample)
    return PolicyAgent(model, mask, greedy=not sample, device=torch_device)


def load_policy_agent(
    checkpoint_path: str | Path, device: str = "auto", *, engine: str = "auto",
    sample: bool = False
) -> tuple[Agent, EnvSpec]:
    """A greedy (or, with `sample`, sampling) agent for the checkpoint's model and mask
    (`greedy_agent`), and the checkpoint's spec."""
    path = Path(checkpoint_path)
    checkpoint = load_checkpoint(path)
    spec = checkpoint_spec(checkpoint, path)
    torch_device = resolve_device(device)
    model = checkpoint.build_model(torch_device)
    agent = greedy_agent(model, np.asarray(checkpoint.action_mask, dtype=bool),
                         device=device, engine=engine, sample=sample)
    return agent, spec
