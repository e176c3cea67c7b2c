"""Playing a policy in the vector env and keeping what learning needs.

The emulator always runs with raw rewards and whole games; the training-only switches of
the env spec are applied here: `reward_clipping` clips the learning reward to its sign,
`episodic_life` makes a lost life a termination for learning (the game goes on). Episode
statistics (`charts/episodic_return`) are always raw game scores of whole games.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..envs import EnvSpec, make_vector_env
from ..model import PPOModel, masked_log_softmax, mixed_features, mixed_forward


@dataclass
class Rollout:
    """T steps of N envs; every tensor is (T, N, ...) and lives on the learning device."""

    obs: torch.Tensor  # uint8 (T, N, C, H, W)
    actions: torch.Tensor  # int64
    log_probs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor  # learning rewards (clipped when the spec says so)
    terminations: torch.Tensor  # bool, learning terminations (life loss with episodic_life)
    truncations: torch.Tensor  # bool
    next_values: torch.Tensor  # V(s_{t+1}) of the same episode (final obs where truncated)
    labels: torch.Tensor | None = None  # int64, the scripted player's action on each obs

    @property
    def num_steps(self) -> int:
        return self.actions.shape[0] * self.actions.shape[1]


@dataclass
class Timings:
    env: float = 0.0
    inference: float = 0.0
    learn: float = 0.0
    evaluation: float = 0.0
    """Greedy evaluation games (PPO's selection), where the training waits."""

    def as_dict(self) -> dict[str, float]:
        return {"env": self.env, "inference": self.inference, "learn": self.learn,
                "evaluation": self.evaluation}


@dataclass
class EpisodeStats:
    """Raw scores and lengths of finished games, most recent last."""

    returns: deque = field(default_factory=lambda: deque(maxlen=100))
    lengths: deque = field(default_factory=lambda: deque(maxlen=100))
    finished: int = 0
    new: list[tuple[int, float, int]] = field(default_factory=list)
    """(this collector's step at the game's end, score, length) of the games finished since
    `drain` last ran: training logs one point per finished game."""

    def drain(self) -> list[tuple[int, float, int]]:
        games, self.new = self.new, []
        return games


_SAMPLING_SALT = 0x5EED_0000
"""Keeps the sampling streams apart from the emulators' own seeds."""


class RolloutCollector:
    """Steps `num_envs` emulators with a policy, `num_steps` at a time. With `amp` the
    policy's trunk runs under autocast to that dtype, as PPO's learning steps run it, so
    the rollout's log-probabilities are those the learning steps start from."""

    def __init__(
        self,
        spec: EnvSpec,
        model: PPOModel,
        action_mask: torch.Tensor,
        *,
        num_envs: int,
        num_steps: int,
        device: torch.device,
        seed: int = 0,
        greedy: bool = False,
        labeller: str | None = None,
        amp: torch.dtype | None = None,
    ) -> None:
        self.spec = spec
        self.model = model
        self.mask = action_mask.to(device)
        self.num_envs = num_envs
        self.num_steps = num_steps
        self.device = device
        self.greedy = greedy
        self.amp = amp
        self.env = make_vector_env(spec.for_evaluation(), num_envs, same_step_reset=True,
                                   labeller=labeller)
        obs, info = self.env.reset(seed=seed)
        self.labelled = labeller is not None
        self.next_labels = np.asarray(info["labels"]).copy() if self.labelled else None
        # One sampling stream per env, seeded like the env (env i plays seed + i): a run
        # whose envs are split over several processes samples the actions one process
        # with all of them would.
        self.generators = [torch.Generator().manual_seed(_SAMPLING_SALT + seed + i)
                           for i in range(num_envs)]
        self.next_obs = obs
        self.lives = np.asarray(info["lives"]).copy()
        self.raw_return = np.zeros(num_envs)
        self.raw_length = np.zeros(num_envs, dtype=np.int64)
        self.stats = EpisodeStats()
        self.timings = Timings()
        self.global_step = 0
        shape = (num_steps, num_envs)
        obs_shape = tuple(obs.shape[1:])
        self._obs = torch.zeros((*shape, *obs_shape), dtype=torch.uint8, device=device)
        self._actions = torch.zeros(shape, dtype=torch.int64, device=device)
        self._log_probs = torch.zeros(shape, device=device)
        self._values = torch.zeros(shape, device=device)
        self._rewards = np.zeros(shape, dtype=np.float32)
        self._terms = np.zeros(shape, dtype=bool)
        self._truncs = np.zeros(shape, dtype=bool)
        self._labels = np.zeros(shape, dtype=np.int64)

    @torch.no_grad()
    def _act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action, its log-probability, value) per env: the argmax when greedy, else a
        sample of the masked policy (Gumbel-max with each env's own noise)."""
        logits, value = mixed_forward(self.model, obs, self.amp)
        log_probs = masked_log_softmax(logits, self.mask)
        if self.greedy:
            action = log_probs.argmax(-1)
        else:
            uniform = torch.stack([torch.rand(log_probs.shape[-1], generator=g)
                                   for g in self.generators]).to(log_probs.device)
            gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-12)))
            action = (log_probs + gumbel).where(self.mask, torch.finfo(log_probs.dtype).min) \
                .argmax(-1)
        log_prob = log_probs.gather(-1, action[:, None])[:, 0]
        return action, log_prob, value[:, 0]

    def _value(self, obs: torch.Tensor) -> torch.Tensor:
        """The critic's value per env, with the trunk in the rollout's precision."""
        return self.model.value_head(mixed_features(self.model, obs, self.amp))[:, 0]

    @torch.no_grad()
    def collect(self) -> Rollout:
        model_was_training = self.model.training
        self.model.eval()
        finals: list[tuple[int, np.ndarray, np.ndarray]] = []  # (t, env ids, final obs)
        for t in range(self.num_steps):
            start = time.perf_counter()
            obs = torch.from_numpy(self.next_obs).to(self.device)
            self._obs[t] = obs
            if self.labelled:
                self._labels[t] = self.next_labels
            action, log_prob, value = self._act(obs)
            self._actions[t] = action
            self._log_probs[t] = log_prob
            self._values[t] = value
            actions = action.cpu().numpy()
            mid = time.perf_counter()
            next_obs, reward, terminated, truncated, info = self.env.step(actions)
            self.timings.env += time.perf_counter() - mid
            self.timings.inference += mid - start
            done = terminated | truncated
            lives = np.asarray(info["lives"])
            learn_terminated = terminated.copy()
            if self.spec.episodic_life:
                learn_terminated |= (lives < self.lives) & ~done
            self.lives = lives.copy()
            self._rewards[t] = np.sign(reward) if self.spec.reward_clipping else reward
            self._terms[t] = learn_terminated
            self._truncs[t] = truncated & ~learn_terminated
            if truncated.any():
                ids = np.flatnonzero(self._truncs[t])
                if len(ids):
                    finals.append((t, ids, np.asarray(info["final_obs"])[ids]))
            self.raw_return += reward
            self.raw_length += 1
            for i in np.flatnonzero(done):
                self.stats.returns.append(float(self.raw_return[i]))
                self.stats.lengths.append(int(self.raw_length[i]))
                self.stats.finished += 1
                self.stats.new.append((self.global_step + (t + 1) * self.num_envs,
                                       float(self.raw_return[i]), int(self.raw_length[i])))
                self.raw_return[i] = 0
                self.raw_length[i] = 0
            self.next_obs = next_obs
            if self.labelled:
                self.next_labels = np.asarray(info["labels"]).copy()
        self.global_step += self.num_steps * self.num_envs

        start = time.perf_counter()
        next_values = torch.empty_like(self._values)
        next_values[:-1] = self._values[1:]
        last = torch.from_numpy(self.next_obs).to(self.device)
        next_values[-1] = self._value(last)
        for t, ids, final in finals:
            final_values = self._value(torch.from_numpy(final).to(self.device))
            next_values[t, torch.from_numpy(ids).to(self.device)] = final_values
        self.timings.inference += time.perf_counter() - start
        self.model.train(model_was_training)
        as_tensor = lambda a: torch.from_numpy(a.copy()).to(self.device)  # noqa: E731
        return Rollout(
            obs=self._obs.clone(),
            actions=self._actions.clone(),
            log_probs=self._log_probs.clone(),
            values=self._values.clone(),
            rewards=as_tensor(self._rewards),
            terminations=as_tensor(self._terms),
            truncations=as_tensor(self._truncs),
            next_values=next_values,
            labels=as_tensor(self._labels) if self.labelled else None,
        )

    def close(self) -> None:
        self.env.close()
