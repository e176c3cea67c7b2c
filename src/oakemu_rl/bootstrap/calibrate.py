"""Stage two, `oakemu bootstrap calibrate`: fit only the value head on the BC policy's returns.

The BC policy plays in the vector env; its rollouts give return targets (discounted
Monte-Carlo, or bootstrapped TD(λ)); the value head alone is fitted through
`get_value(x, detach_features=True)`, with an optimizer that holds the value head's
parameters and nothing else. The trunk and policy head come out bit-identical to BC's,
so PPO starts from the imprinted policy *and* a critic that already knows its returns.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import runs
from ..agents import SEED_MAX, resolve_device
from ..checkpoint import Checkpoint, load_checkpoint, policy_differences, save_checkpoint
from ..envs import EnvSpec
from ..errors import ConfigError, DemoFileError, OakEmuError, check_options
from ..finetune.advantages import discounted_returns, explained_variance, td_lambda
from ..finetune.rollout import RolloutCollector
from ..metrics import MetricsLogger
from ..model import PPOModel
from ..plots import plot_value_scatter
from .bc import open_demo_files

TARGETS = ("td_lambda", "mc")


@dataclass(frozen=True)
class CalibrateConfig:
    """Critic calibration settings; `oakemu bootstrap calibrate --help` shows them."""

    run_dir: str | None = None
    """Run directory holding bc.pt; calibrated.pt is written there (default: the last run)."""
    checkpoint: str | None = None
    """Calibrate this checkpoint instead of the run's bc.pt."""
    num_envs: int = 8
    """Emulators stepped together."""
    num_steps: int = 256
    """Steps per env per iteration."""
    holdout_envs: int = 2
    """Envs whose rollouts are only used to measure explained variance."""
    holdout_window: int = 8
    """Iterations of held-out rollouts pooled for the explained variance (the policy is
    frozen, so older rollouts stay on-policy; one rollout of two envs is too few rallies)."""
    iterations: int = 20
    """Most rollout-and-fit iterations."""
    target_explained_variance: float = 0.6
    """Stop once the held-out explained variance reaches this."""
    target: str = "td_lambda"
    """Return targets: td_lambda (bootstrapped) or mc (discounted Monte-Carlo)."""
    gamma: float = 0.99
    """Discount."""
    gae_lambda: float = 0.95
    """λ of TD(λ)."""
    epochs: int = 4
    """Passes over each iteration's data."""
    minibatch_size: int = 256
    """Samples per value-head step."""
    lr: float = 1e-3
    """Adam learning rate of the value head."""
    greedy: bool = False
    """Play the argmax action instead of sampling from the masked policy."""
    reward_clipping: bool = True
    """Clip learning rewards to their sign (must match the PPO that follows)."""
    episodic_life: bool = True
    """A lost life ends the learning episode (must match the PPO that follows)."""
    demos: tuple[str, ...] = ()
    """Demo files whose own discounted returns are added as calibration data."""
    demo_ratio: float = 0.5
    """Demo samples per rollout sample in each iteration's data."""
    seed: int = 0
    """Seeds the emulators, sampling and minibatches."""
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    progress: bool = True
    """Show a tqdm bar."""

    def __post_init__(self) -> None:
        check_options("calibrate", self, [
            ("num_envs", self.num_envs >= 2, "≥ 2"), ("num_steps", self.num_steps >= 1, "≥ 1"),
            ("holdout_envs", 1 <= self.holdout_envs < self.num_envs,
             f"≥ 1 and below --num-envs ({self.num_envs})"),
            ("iterations", self.iterations >= 1, "≥ 1"),
            ("holdout_window", self.holdout_window >= 1, "≥ 1"),
            ("gamma", 0 < self.gamma <= 1, "in (0, 1]"),
            ("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
            ("epochs", self.epochs >= 1, "≥ 1"),
            ("minibatch_size", self.minibatch_size >= 1, "≥ 1"), ("lr", self.lr > 0, "> 0"),
            ("demo_ratio", self.demo_ratio >= 0, "≥ 0"),
            ("target_explained_variance", self.target_explained_variance <= 1, "≤ 1"),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
        ])
        if self.target not in TARGETS:
            raise ConfigError(f"calibrate option target must be one of {TARGETS}")


def value_targets(rollout, config: CalibrateConfig) -> torch.Tensor:
    """Return targets (T, N) for a rollout under the chosen estimator."""
    if config.target == "mc":
        return discounted_returns(rollout.rewards, rollout.terminations, rollout.truncations,
                                  rollout.next_values, config.gamma)
    _, returns = td_lambda(rollout.rewards, rollout.values, rollout.next_values,
                           rollout.terminations, rollout.truncations, config.gamma,
                           config.gae_lambda)
    return returns


def demo_returns(paths: tuple[str, ...], spec: EnvSpec, meanings: list[str],
                 config: CalibrateConfig) -> list[tuple[object, int, np.ndarray]]:
    """(demo file, episode, discounted returns) of every demo episode, with the same reward
    clipping as the rollouts. A truncated episode's tail counts as ending there."""
    demos = open_demo_files(paths)
    for demo in demos:
        if not demo.spec.same_frames_as(spec) or demo.action_meanings != meanings:
            raise DemoFileError(
                f"demo file {demo.path} was recorded with a different env spec "
                f"({demo.spec.env_id}) than the checkpoint ({spec.env_id})"
            )
    out = []
    for demo in demos:
        for i in range(len(demo.episodes)):
            rewards = demo.read(i, "rewards").astype(np.float32)[:, None]
            if config.reward_clipping:
                rewards = np.sign(rewards)
            ends = np.zeros_like(rewards, dtype=bool)
            ends[-1] = True
            returns = discounted_returns(rewards, ends, np.zeros_like(ends),
                                         np.zeros_like(rewards), config.gamma)
            out.append((demo, i, returns[:, 0]))
    return out


def _sample_demo_states(episodes, count: int, rng: np.random.Generator
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = np.array([len(r) for _, _, r in episodes])
    picks = rng.choice(lengths.sum(), size=min(count, lengths.sum()), replace=False)
    bounds = np.cumsum(lengths)
    obs, targets = [], []
    for p in np.sort(picks):
        e = int(np.searchsorted(bounds, p, side="right"))
        t = int(p - (bounds[e] - lengths[e]))
        demo, i, returns = episodes[e]
        obs.append(demo.observation(i, t))
        targets.append(returns[t])
    return torch.from_numpy(np.stack(obs)), torch.tensor(np.array(targets), dtype=torch.float32)


def linear_ceiling(features: torch.Tensor, targets: torch.Tensor,
                   held_features: torch.Tensor, held_targets: torch.Tensor) -> float:
    """Held-out explained variance of the least-squares linear value head on these features.

    The value head is linear and the trunk is frozen, so no fit can do much better than
    this (up to the ridge term): a low figure says the BC features carry little of the
    return, not that the fit went wrong."""
    x = torch.cat([features.double(), torch.ones(len(features), 1, dtype=torch.float64)], 1)
    gram = x.T @ x
    ridge = 1e-3 * gram.diagonal().mean() * torch.eye(len(gram), dtype=torch.float64)
    weights = torch.linalg.solve(gram + ridge, x.T @ targets.double())
    held = torch.cat([held_features.double(),
                      torch.ones(len(held_features), 1, dtype=torch.float64)], 1)
    return explained_variance((held @ weights).float(), held_targets.float())


def _check_policy_unchanged(before: dict[str, torch.Tensor], model: PPOModel) -> None:
    changed = policy_differences(before, model.state_dict())
    if changed:
        raise RuntimeError(f"calibration changed {changed[0]}; the policy must stay as BC "
                           "left it")


def calibrate(config: CalibrateConfig) -> Path:
    """Run critic calibration; returns the path of calibrated.pt."""
    if config.checkpoint is not None:
        source = Path(config.checkpoint)
        run_dir = runs.prepare_run_dir(config.run_dir or source.parent, "")
    else:
        run_dir = runs.find_run_dir(config.run_dir, needs="bc")
        source = runs.stage_input(run_dir, "bc")
    checkpoint = load_checkpoint(source)
    spec = dataclasses.replace(EnvSpec.from_dict(checkpoint.env_spec),
                               reward_clipping=config.reward_clipping,
                               episodic_life=config.episodic_life)
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    model = checkpoint.build_model(device)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("value_head."))
    optimizer = torch.optim.Adam(model.value_head.parameters(), lr=config.lr)
    mask = checkpoint.action_mask_tensor()
    demo_episodes = (demo_returns(config.demos, spec, checkpoint.action_meanings, config)
                     if config.demos else [])

    collector = RolloutCollector(spec, model, mask, num_envs=config.num_envs,
                                 num_steps=config.num_steps, device=device, seed=config.seed,
                                 greedy=config.greedy)
    fit_envs = config.num_envs - config.holdout_envs
    path = run_dir / runs.STAGE_FILES["calibrate"]
    best: dict = {"ev": -math.inf}
    held_window: deque = deque(maxlen=config.holdout_window)
    fit_window: deque = deque(maxlen=config.holdout_window)
    history: list[float] = []
    start_time = time.perf_counter()
    bar = tqdm(range(1, config.iterations + 1), disable=not config.progress,
               desc="calibrate", unit="iter")
    try:
        with MetricsLogger(run_dir, "calibrate") as log:
            for iteration in bar:
                rollout = collector.collect()
                targets = value_targets(rollout, config)
                obs = rollout.obs[:, :fit_envs].reshape(-1, *rollout.obs.shape[2:])
                fit_targets = targets[:, :fit_envs].reshape(-1)
                held_obs = rollout.obs[:, fit_envs:].reshape(-1, *rollout.obs.shape[2:])
                with torch.no_grad():  # the trunk is frozen: its features never go stale
                    held_window.append((model._features(held_obs),
                                        targets[:, fit_envs:].reshape(-1)))
                    fit_window.append((model._features(obs).cpu(), fit_targets.cpu()))
                held_features = torch.cat([f for f, _ in held_window])
                held_targets = torch.cat([t for _, t in held_window]).cpu()
                if iteration == 1:
                    with torch.no_grad():
                        initial = explained_variance(
                            model.value_head(held_features)[:, 0].cpu(), held_targets)
                demo_count = int(len(fit_targets) * config.demo_ratio)
                if demo_episodes and demo_count > 0:
                    demo_obs, demo_t = _sample_demo_states(demo_episodes, demo_count, rng)
                    obs = torch.cat([obs, demo_obs.to(device)])
                    fit_targets = torch.cat([fit_targets, demo_t.to(device)])
                fit_start = time.perf_counter()
                losses = []
                for _ in range(config.epochs):
                    order = torch.from_numpy(rng.permutation(len(fit_targets))).to(device)
                    for b in range(0, len(order), config.minibatch_size):
                        idx = order[b:b + config.minibatch_size]
                        predicted = model.get_value(obs[idx], detach_features=True)
                        loss = 0.5 * (predicted - fit_targets[idx]).pow(2).mean()
                        if not torch.isfinite(loss):
                            raise OakEmuError(
                                f"the value loss became {float(loss.detach())} at iteration "
                                f"{iteration}; calibration stopped (nothing was overwritten)"
                            )
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        if not all(bool(torch.isfinite(p.grad).all())
                                   for p in model.value_head.parameters() if p.grad is not None):
                            raise OakEmuError(
                                f"a value-head gradient became non-finite at iteration "
                                f"{iteration}; calibration stopped (nothing was overwritten)"
                            )
                        optimizer.step()
                        losses.append(float(loss.detach()))
                collector.timings.learn += time.perf_counter() - fit_start
                with torch.no_grad():
                    held_pred = model.value_head(held_features)[:, 0].cpu()
                ev = explained_variance(held_pred, held_targets)
                history.append(ev)
                log.log(collector.global_step, {
                    "calibrate/iteration": iteration,
                    "calibrate/value_loss": float(np.mean(losses)),
                    "losses/explained_variance": ev,
                    "calibrate/target_mean": float(held_targets.mean()),
                    "calibrate/target_std": float(held_targets.std()),
                    "charts/episodic_return": float(np.mean(collector.stats.returns))
                    if collector.stats.returns else None,
                })
                bar.set_postfix(ev=f"{ev:.3f}", loss=f"{np.mean(losses):.4f}")
                if not math.isnan(ev) and ev > best["ev"]:
                    best = {"ev": ev, "iteration": iteration,
                            "state": {k: v.detach().cpu().clone()
                                      for k, v in model.value_head.state_dict().items()},
                            "pred": held_pred.numpy(), "target": held_targets.numpy()}
                if not math.isnan(ev) and ev >= config.target_explained_variance:
                    break
    finally:
        bar.close()
        collector.close()

    if "state" in best:
        model.value_head.load_state_dict(best["state"])
    _check_policy_unchanged(before, model)
    ceiling = linear_ceiling(torch.cat([f for f, _ in fit_window]),
                             torch.cat([t for _, t in fit_window]),
                             held_features.cpu(), held_targets)
    wall = time.perf_counter() - start_time
    result = Checkpoint.from_model(
        model,
        stage="calibrate",
        action_meanings=checkpoint.action_meanings,
        action_mask=checkpoint.action_mask,
        env_spec=checkpoint.env_spec,
        steps=checkpoint.steps | {"calibrate_env_steps": collector.global_step,
                                  "calibrate_iterations": len(history)},
        config=dataclasses.asdict(config) | {"demos": list(config.demos),
                                             "source": str(source)},
        extra={"bc": checkpoint.extra, "calibration": {
            "explained_variance": float(best["ev"]) if "state" in best else float("nan"),
            "initial_explained_variance": float(initial),
            "best_iteration": int(best.get("iteration", 0)),
            "linear_ceiling_explained_variance": float(ceiling),
            "wall_seconds": float(wall),
            "history": [float(h) for h in history],
        }},
    )
    save_checkpoint(path, result)
    if "state" in best:
        plot_value_scatter(best["pred"], best["target"], best["ev"],
                           run_dir / "calibration_scatter.png")
    runs.remember_run(run_dir)
    if config.progress:
        tqdm.write(f"explained variance {initial:.3f} -> {best.get('ev', float('nan')):.3f} "
                   f"(held-out, best of {len(history)} iterations) in {wall:.0f}s; "
                   f"a least-squares value head on the same features reaches {ceiling:.3f}; "
                   f"wrote {path}")
    return path
