"""Agents: anything that picks an action for a single env — a policy, a script, a person.

The recorder and the tester drive every kind the same way:
`agent.reset(env, seed)` at each episode start, then `agent.act(env, observation)` per step,
where `observation` is the stacked (frame_stack, size, size) uint8 frame and `env` the
single env from `oakemu_rl.envs.make_env` (its `.unwrapped.ale` gives RAM to scripts).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from .model import PPOModel


class Agent(Protocol):
    kind: str
    """Recorder kind written into demo files: "human", "scripted" or "policy" (an episode
    another agent drove while this one labelled is "relabelled")."""

    def reset(self, env: Any, seed: int) -> None: ...

    def act(self, env: Any, observation: np.ndarray) -> int: ...


SEED_MAX = 2**30 - 1
"""Largest seed an option takes: the emulators add episode, env and update numbers to it,
and ALE seeds are 32-bit."""


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA when present, else CPU; otherwise cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from .errors import ConfigError

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown --device {name!r}; use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is available")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name} names a GPU this machine does not have "
                          f"({torch.cuda.device_count()} found)")
    return device


PRECISIONS = ("auto", "fp32", "bf16")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `--precision` (None: plain fp32). `auto` takes bf16 on a CUDA
    GPU that supports it and fp32 on the CPU: on a CPU with AVX512-BF16, bf16 autocast ran
    BC at 1.6x the samples/s of fp32 but needed about that many more epochs for the same
    validation loss (10 bf16 epochs ended at 0.158, fp32 passed that after 6-7 and ended at
    0.137 on the same demo files). `bf16` insists on it."""
    from .errors import ConfigError

    if precision not in PRECISIONS:
        raise ConfigError(f"unknown --precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return None
    gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "auto":
        return torch.bfloat16 if gpu_bf16 else None
    if device.type == "cuda" and not gpu_bf16:
        raise ConfigError("--precision bf16 was asked for but this GPU has no bfloat16 support")
    return torch.bfloat16


class PolicyAgent:
    """Plays a `PPOModel`: greedy (argmax of the masked logits) or sampled."""

    kind = "policy"

    def __init__(
        self,
        model: PPOModel,
        action_mask: np.ndarray | torch.Tensor | None = None,
        *,
        greedy: bool = True,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.mask = (
            None
            if action_mask is None
            else torch.as_tensor(np.asarray(action_mask, dtype=bool), device=self.device)
        )
        self.greedy = greedy
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def reset(self, env: Any, seed: int) -> None:
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def act(self, env: Any, observation: np.ndarray) -> int:
        x = torch.as_tensor(observation, device=self.device).unsqueeze(0)
        logits = self.model.masked_logits(self.model.get_logits(x), self.mask)
        if self.greedy:
            return int(logits.argmax(-1).item())
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


class RandomAgent:
    """Uniform over the allowed actions: the bottom of the random-to-demonstrator scale."""

    kind = "policy"

    def __init__(self, mask: np.ndarray) -> None:
        self.allowed = np.flatnonzero(np.asarray(mask, dtype=bool))
        if self.allowed.size == 0:
            raise ValueError("the action mask allows no action")
        self.rng = np.random.default_rng(0)

    def reset(self, env: Any, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def act(self, env: Any, observation: np.ndarray) -> int:
        return int(self.rng.choice(self.allowed))
