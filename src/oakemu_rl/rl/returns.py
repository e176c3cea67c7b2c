"""Returns and advantages, as plain functions over (time, env) arrays.

Conventions for a rollout of T steps in N envs, all arrays shaped (T, N):

- `rewards[t]`, `terminations[t]`, `truncations[t]` are what the env returned after the
  action at step t.
- `values[t]` is V(s_t); `next_values[t]` is V(s_{t+1}) of the *same* episode: the value of
  the final observation when the episode was truncated at t. It is ignored where the
  episode terminated at t (a terminal state is worth 0).

A termination cuts the return; a truncation also stops the sum but bootstraps from
`next_values`, because the game could have gone on.
"""

from __future__ import annotations

import numpy as np
import torch

Array = np.ndarray | torch.Tensor


def _lib(x: Array):
    return torch if isinstance(x, torch.Tensor) else np


def gae(
    rewards: Array,
    values: Array,
    next_values: Array,
    terminations: Array,
    truncations: Array,
    gamma: float,
    lam: float,
) -> tuple[Array, Array]:
    """GAE(λ): returns (advantages, returns) with returns = advantages + values.

    λ = 1 gives Monte-Carlo returns bootstrapped only at truncations and at the rollout's
    end; λ = 0 gives one-step TD targets.
    """
    xp = _lib(rewards)
    not_terminal = 1.0 - terminations.astype(np.float32) if xp is np \
        else 1.0 - terminations.float()
    done = terminations | truncations
    not_done = 1.0 - done.astype(np.float32) if xp is np else 1.0 - done.float()
    deltas = rewards + gamma * next_values * not_terminal - values
    advantages = xp.zeros_like(deltas)
    running = xp.zeros_like(deltas[0])
    for t in range(deltas.shape[0] - 1, -1, -1):
        running = deltas[t] + gamma * lam * not_done[t] * running
        advantages[t] = running
    return advantages, advantages + values


def discounted_returns(
    rewards: Array,
    terminations: Array,
    truncations: Array,
    bootstrap: Array,
    gamma: float,
) -> Array:
    """Monte-Carlo returns G_t = r_t + γ G_{t+1}, cut at episode ends.

    `bootstrap[t]` stands in for the rest of the episode where it was truncated at t, and
    at the last step of the rollout when the episode goes on.
    """
    xp = _lib(rewards)
    returns = xp.zeros_like(rewards)
    running = bootstrap[-1] * 0
    last = rewards.shape[0] - 1
    for t in range(last, -1, -1):
        if xp is np:
            term = terminations[t].astype(bool)
            trunc = truncations[t].astype(bool)
        else:
            term, trunc = terminations[t].bool(), truncations[t].bool()
        follow = bootstrap[t] if t == last else running
        follow = xp.where(trunc, bootstrap[t], follow)
        follow = xp.where(term, follow * 0, follow)
        running = rewards[t] + gamma * follow
        returns[t] = running
    return returns


def explained_variance(predicted: Array, target: Array) -> float:
    """1 - Var(target - predicted) / Var(target); nan when the target does not vary."""
    predicted = np.asarray(predicted, dtype=np.float64).reshape(-1)
    target = np.asarray(target, dtype=np.float64).reshape(-1)
    var = target.var()
    if var == 0:
        return float("nan")
    return float(1.0 - (target - predicted).var() / var)
