"""The agent protocol and the plain agents: a torch policy and a uniform random player."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from ..model import PPOModel


class DiscardEpisode(Exception):
    """Raised by an agent's `act` to throw away the episode in progress and start over."""


class StopRecording(Exception):
    """Raised by an agent's `act` to end the session; finished episodes are kept."""


class Agent(Protocol):
    kind: str
    """Recorder kind written into demo files: "human", "scripted" or "policy" (an episode
    another agent drove while this one labelled is "relabelled")."""

    def reset(self, env: Any, seed: int) -> None: ...

    def act(self, env: Any, observation: np.ndarray) -> int: ...


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

    @property
    def plays_batches(self) -> bool:
        """Greedy play keeps no state between steps, so games can share forward passes."""
        return self.greedy

    @property
    def portable(self) -> bool:
        """`play_games` may play a CPU model in other processes (a GPU's stays here)."""
        return self.device.type == "cpu"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["generator"] = None  # a torch.Generator does not pickle; every game reseeds it
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.generator = torch.Generator(device=self.device)

    @torch.no_grad()
    def act_batch(self, observations: np.ndarray) -> np.ndarray:
        """Greedy actions for a batch of observations, one per game."""
        x = torch.as_tensor(np.asarray(observations), device=self.device)
        logits = self.model.masked_logits(self.model.get_logits(x), self.mask)
        return logits.argmax(-1).cpu().numpy()

    @torch.no_grad()
    def act(self, env: Any, observation: np.ndarray) -> int:
        if self.greedy:
            return int(self.act_batch(np.asarray(observation)[None])[0])
        x = torch.as_tensor(observation, device=self.device).unsqueeze(0)
        logits = self.model.masked_logits(self.model.get_logits(x), self.mask)
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


class RandomAgent:
    """Uniform over the allowed actions: the bottom of the random-to-demonstrator scale."""

    kind = "policy"
    portable = True

    def __init__(self, mask: np.ndarray) -> None:
        self.allowed = np.flatnonzero(np.asarray(mask, dtype=bool))
        if self.allowed.size == 0:
            raise ValueError("the action mask allows no action")
        self.rng = np.random.default_rng(0)

    def reset(self, env: Any, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def act(self, env: Any, observation: np.ndarray) -> int:
        return int(self.rng.choice(self.allowed))


class NoisyAgent:
    """Plays `agent`'s choice, or with chance `noise` a uniformly random allowed action
    (the recorder still tells `agent` nothing: what it chose is what it would have done)."""

    def __init__(self, agent: Agent, mask: np.ndarray, noise: float, *, seed: int = 0) -> None:
        self.agent = agent
        self.kind = agent.kind
        self.allowed = np.flatnonzero(np.asarray(mask, dtype=bool))
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    @property
    def portable(self) -> bool:
        return getattr(self.agent, "portable", False)

    def reset(self, env: Any, seed: int) -> None:
        self.agent.reset(env, seed)
        self.rng = np.random.default_rng([seed, 1])

    def act(self, env: Any, observation: np.ndarray) -> int:
        action = int(self.agent.act(env, observation))
        if self.rng.random() < self.noise:
            return int(self.rng.choice(self.allowed))
        return action
