"""Losses as pure functions of tensors: behaviour cloning, the PPO objective, the KL anchor.

Each takes what a minibatch holds and returns a loss (and, for PPO, its statistics), so
it can be checked against numbers worked out by hand (tests/test_losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model import masked_entropy, masked_log_softmax


def bc_loss(
    logits: torch.Tensor,
    actions: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    class_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of masked logits; smoothing spreads over the allowed actions only, and
    class weights give a weighted mean (the weights of the batch's targets sum to one)."""
    log_probs = masked_log_softmax(logits, action_mask)
    target = F.one_hot(actions, logits.shape[-1]).to(log_probs.dtype)
    if label_smoothing > 0:
        allowed = action_mask.to(log_probs.dtype)
        target = (1 - label_smoothing) * target + label_smoothing * allowed / allowed.sum()
    per_sample = -(target * log_probs).where(action_mask, torch.zeros_like(log_probs)).sum(-1)
    if class_weights is None:
        return per_sample.mean()
    weights = class_weights[actions]
    return (weights * per_sample).sum() / weights.sum()


def policy_loss(advantages: torch.Tensor, ratio: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """Clipped surrogate objective, as a loss to minimise."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    return torch.max(unclipped, clipped).mean()


def value_loss(new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_coef: float, clip: bool) -> torch.Tensor:
    """0.5 × squared error, optionally clipped around the rollout's values."""
    unclipped = (new_values - returns).pow(2)
    if not clip:
        return 0.5 * unclipped.mean()
    clipped_values = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    clipped = (clipped_values - returns).pow(2)
    return 0.5 * torch.max(unclipped, clipped).mean()


def masked_kl(ref_logits: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean KL(softmax(ref) ‖ softmax(logits)) over the allowed actions."""
    ref_logp = masked_log_softmax(ref_logits, mask)
    logp = masked_log_softmax(logits, mask)
    terms = ref_logp.exp() * (ref_logp - logp)
    return terms.where(mask, torch.zeros_like(terms)).sum(-1).mean()


@dataclass(frozen=True)
class PPOCoefficients:
    """The weights and switches of one PPO minibatch loss."""

    clip_coef: float = 0.1
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    clip_vloss: bool = True
    norm_adv: bool = True
    kl_weight: float = 0.0
    """Weight of KL(reference ‖ policy); 0 leaves the anchor out."""


@dataclass(frozen=True)
class PPOBatch:
    """One minibatch of a rollout, flattened over time and envs."""

    actions: torch.Tensor
    log_probs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor
    ref_logits: torch.Tensor | None = None
    """The reference (bootstrap) policy's logits, for the KL anchor."""
    labels: torch.Tensor | None = None
    """The scripted player's action on each observation, for the BC loss on rollouts."""


def ppo_loss(logits: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, batch: PPOBatch,
             coef: PPOCoefficients) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss of a minibatch from the model's fresh `logits` and `values` (batch,),
    and its statistics as detached 0-d tensors: pg, v, ent, kl_ref (when anchored),
    approx_kl, old_approx_kl and clipfrac."""
    logp_all = masked_log_softmax(logits, mask)
    new_logprob = logp_all.gather(-1, batch.actions[:, None]).squeeze(-1)
    logratio = new_logprob - batch.log_probs
    ratio = logratio.exp()
    adv = batch.advantages
    if coef.norm_adv and len(adv) > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg = policy_loss(adv, ratio, coef.clip_coef)
    v = value_loss(values, batch.values, batch.returns, coef.clip_coef, coef.clip_vloss)
    ent = masked_entropy(logp_all).mean()
    loss = pg - coef.ent_coef * ent + coef.vf_coef * v
    stats = {"pg": pg, "v": v, "ent": ent}
    if batch.ref_logits is not None and coef.kl_weight > 0:
        kl_ref = masked_kl(batch.ref_logits, logits, mask)
        loss = loss + coef.kl_weight * kl_ref
        stats["kl_ref"] = kl_ref
    with torch.no_grad():
        stats["old_approx_kl"] = (-logratio).mean()
        stats["approx_kl"] = ((ratio - 1) - logratio).mean()
        stats["clipfrac"] = ((ratio - 1).abs() > coef.clip_coef).float().mean()
    return loss, {k: s.detach() for k, s in stats.items()}
