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
from ..checkpoint import Checkpoint, load_checkpoint, policy_differences, save_checkpoint
from ..configs import check_choice, check_options
from ..demos import open_demo_files
from ..envs import EnvSpec, require_same_env
from ..errors import DemoFileError, check_finite
from ..metrics import MetricsLogger
from ..model import PPOModel
from ..plots import plot_value_scatter
from ..rl.returns import discounted_returns, explained_variance, gae
from ..rl.rollout import Rollout, RolloutCollector
from ..runtime import SEED_MAX, resolve_device

TARGETS = ("td_lambda", "mc")
REPORT_SEED_OFFSET = 1_000_003
"""The report games' seeds start this far from the fitting ones, so no game repeats."""


@dataclass(frozen=True)
class CalibrateConfig:
    """Critic calibration settings; `oakemu bootstrap calibrate --help` shows them."""

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
    demo_ratio: float = 0.5
    """Demo samples per rollout sample in each iteration's data."""
    seed: int = 0
    """Seeds the emulators, sampling and minibatches."""

    def __post_init__(self) -> None:
        check_options(self, [
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
        ], stage="calibrate")
        check_choice("calibrate", "target", self.target, TARGETS)


def value_targets(rollout, config: CalibrateConfig) -> torch.Tensor:
    """Return targets (T, N) for a rollout under the chosen estimator."""
    if config.target == "mc":
        return discounted_returns(rollout.rewards, rollout.terminations, rollout.truncations,
                                  rollout.next_values, config.gamma)
    _, returns = gae(rollout.rewards, rollout.values, rollout.next_values,
                           rollout.terminations, rollout.truncations, config.gamma,
                           config.gae_lambda)
    return returns


def demo_returns(paths: tuple[str, ...], spec: EnvSpec, meanings: list[str],
                 config: CalibrateConfig) -> list[tuple[object, int, np.ndarray]]:
    """(demo file, episode, discounted returns) of every demo episode, with the same reward
    clipping as the rollouts. A truncated episode's tail counts as ending there."""
    demos = open_demo_files(paths)
    require_same_env(f"demo file {demos[0].path}", demos[0].spec, demos[0].action_meanings,
                     "the checkpoint", spec, meanings, hint="pass demos recorded with its spec",
                     error=DemoFileError)
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


def calibrate(config: CalibrateConfig, *, run_dir: str | Path | None = None,
              checkpoint: str | Path | None = None, demos: tuple[str, ...] = (),
              device: str = "auto", progress: bool = True) -> Path:
    """Fit the value head of `checkpoint` (default: the run directory's bc.pt) on its
    policy's returns, with `demos`' own returns as extra data; returns calibrated.pt."""
    source, run_dir = runs.stage_source(run_dir, checkpoint, needs="bc")
    start = load_checkpoint(source)
    spec = dataclasses.replace(EnvSpec.from_dict(start.env_spec),
                               reward_clipping=config.reward_clipping,
                               episodic_life=config.episodic_life)
    torch.manual_seed(config.seed)
    fit = _ValueFit(config, start.build_model(resolve_device(device)), start.action_mask_tensor(),
                    demo_returns(demos, spec, start.action_meanings, config) if demos else [])
    collector = RolloutCollector(spec, fit.model, fit.mask, num_envs=config.num_envs,
                                 num_steps=config.num_steps, device=fit.device, seed=config.seed,
                                 greedy=config.greedy)
    start_time = time.perf_counter()
    bar = tqdm(range(1, config.iterations + 1), disable=not progress, desc="calibrate",
               unit="iter")
    try:
        with MetricsLogger(run_dir, "calibrate") as log:
            for iteration in bar:
                ev = fit.iteration(collector, iteration, log)
                bar.set_postfix(ev=f"{ev:.3f}", loss=f"{fit.last_loss:.4f}")
                if not math.isnan(ev) and ev >= config.target_explained_variance:
                    break
    finally:
        bar.close()
        collector.close()
    summary = fit.finish(time.perf_counter() - start_time)
    summary |= fit.report(spec, config)
    path = run_dir / runs.STAGE_FILES["calibrate"]
    save_checkpoint(path, Checkpoint.from_model(
        fit.model, stage="calibrate", action_meanings=start.action_meanings,
        action_mask=start.action_mask, env_spec=start.env_spec,
        steps={"env_steps": collector.global_step, "iterations": len(fit.history)},
        config=dataclasses.asdict(config), extra={"bc": start.extra, "calibration": summary},
        parent=start, inputs=[source, *demos]))
    plot_value_scatter(*fit.report_plot, summary["explained_variance"],
                       run_dir / "calibration_scatter.png")
    runs.remember_run(run_dir)
    if progress:
        tqdm.write(f"explained variance {summary['initial_explained_variance']:.3f} -> "
                   f"{summary['explained_variance']:.3f} on {summary['report_steps']:,} fresh "
                   f"steps that neither fitted nor chose the head (best of "
                   f"{len(fit.history)} iterations on the held-out envs: "
                   f"{summary['selection_explained_variance']:.3f}) in "
                   f"{summary['wall_seconds']:.0f}s; a least-squares value head on the same "
                   "features reaches "
                   f"{summary['linear_ceiling_explained_variance']:.3f}; wrote {path}")
    return path


class _ValueFit:
    """The value head, its optimizer, and the windows of frozen features it is judged on.

    The trunk is frozen, so features computed once stay valid: the fit reads them, and the
    held-out envs' last `holdout_window` rollouts measure explained variance."""

    def __init__(self, config: CalibrateConfig, model: PPOModel, mask: torch.Tensor,
                 demo_episodes: list) -> None:
        self.config, self.model, self.mask = config, model, mask
        self.device = next(model.parameters()).device
        self.before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.startswith("value_head."))
        self.optimizer = torch.optim.Adam(model.value_head.parameters(), lr=config.lr)
        self.demo_episodes = demo_episodes
        self.rng = np.random.default_rng(config.seed)
        self.held: deque = deque(maxlen=config.holdout_window)
        self.fitted: deque = deque(maxlen=config.holdout_window)
        self.history: list[float] = []
        self.best: dict = {"ev": -math.inf}
        self.initial = math.nan
        self.last_loss = math.nan
        self.report_plot: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))

    def iteration(self, collector: RolloutCollector, iteration: int, log: MetricsLogger
                  ) -> float:
        """One rollout, its fit, and the held-out explained variance after it."""
        rollout = collector.collect()
        obs, targets = self._windows(rollout)
        if iteration == 1:
            self.initial = self._held_out_ev()[0]
        obs, targets = self._with_demos(obs, targets)
        fit_start = time.perf_counter()
        self.last_loss = self._fit(obs, targets, iteration)
        collector.timings.learn += time.perf_counter() - fit_start
        ev, held_targets = self._held_out_ev()
        self.history.append(ev)
        log.log(collector.global_step, {
            "calibrate/iteration": iteration,
            "calibrate/value_loss": self.last_loss,
            "losses/explained_variance": ev,
            "calibrate/target_mean": float(held_targets.mean()),
            "calibrate/target_std": float(held_targets.std()),
            "charts/episodic_return": float(np.mean(collector.stats.returns))
            if collector.stats.returns else None,
        })
        if not math.isnan(ev) and ev > self.best["ev"]:
            self.best = {"ev": ev, "iteration": iteration,
                         "state": {k: v.detach().cpu().clone()
                                   for k, v in self.model.value_head.state_dict().items()}}
        return ev

    def _windows(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """The fitting envs' observations and targets; both halves' features are kept."""
        fit_envs = self.config.num_envs - self.config.holdout_envs
        targets = value_targets(rollout, self.config)
        obs = rollout.obs[:, :fit_envs].reshape(-1, *rollout.obs.shape[2:])
        fit_targets = targets[:, :fit_envs].reshape(-1)
        held_obs = rollout.obs[:, fit_envs:].reshape(-1, *rollout.obs.shape[2:])
        with torch.no_grad():
            self.held.append((self.model.features(held_obs), targets[:, fit_envs:].reshape(-1)))
            self.fitted.append((self.model.features(obs).cpu(), fit_targets.cpu()))
        return obs, fit_targets

    def _with_demos(self, obs: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = int(len(targets) * self.config.demo_ratio)
        if not self.demo_episodes or count == 0:
            return obs, targets
        demo_obs, demo_targets = _sample_demo_states(self.demo_episodes, count, self.rng)
        return (torch.cat([obs, demo_obs.to(self.device)]),
                torch.cat([targets, demo_targets.to(self.device)]))

    def _fit(self, obs: torch.Tensor, targets: torch.Tensor, iteration: int) -> float:
        """Epochs of value-head steps; returns the mean loss."""
        losses = []
        outcome = "calibration stopped (nothing was overwritten)"
        for _ in range(self.config.epochs):
            order = torch.from_numpy(self.rng.permutation(len(targets))).to(self.device)
            for b in range(0, len(order), self.config.minibatch_size):
                idx = order[b:b + self.config.minibatch_size]
                predicted = self.model.get_value(obs[idx], detach_features=True)
                loss = 0.5 * (predicted - targets[idx]).pow(2).mean()
                check_finite(loss, "the value loss", where=f"iteration {iteration}",
                             outcome=outcome)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(self.model.value_head.parameters(),
                                                      math.inf)
                check_finite(norm, "a value-head gradient", where=f"iteration {iteration}",
                             outcome=outcome)
                self.optimizer.step()
                losses.append(float(loss.detach()))
        return float(np.mean(losses))

    def _held_out_ev(self) -> tuple[float, torch.Tensor]:
        features = torch.cat([f for f, _ in self.held])
        targets = torch.cat([t for _, t in self.held]).cpu()
        with torch.no_grad():
            predicted = self.model.value_head(features)[:, 0].cpu()
        return explained_variance(predicted, targets), targets

    def report(self, spec: EnvSpec, config: CalibrateConfig) -> dict:
        """The chosen head's explained variance on fresh games (new seeds, as many steps as
        the held-out window): data that took part neither in the fit, nor in choosing the
        best iteration, nor in deciding when to stop."""
        # All the envs at once (the forward passes batch), as many steps in all as the
        # held-out window holds.
        steps = -(-config.holdout_envs * config.num_steps * config.holdout_window
                  // config.num_envs)
        collector = RolloutCollector(spec, self.model, self.mask, num_envs=config.num_envs,
                                     num_steps=steps, device=self.device,
                                     seed=config.seed + REPORT_SEED_OFFSET,
                                     greedy=config.greedy)
        try:
            rollout = collector.collect()
        finally:
            collector.close()
        targets = value_targets(rollout, config).reshape(-1).cpu()
        predicted = rollout.values.reshape(-1).cpu()
        self.report_plot = (predicted.numpy(), targets.numpy())
        return {"explained_variance": explained_variance(predicted, targets),
                "report_steps": int(targets.numel())}

    def finish(self, wall: float) -> dict:
        """Restore the best head, check the policy is BC's, and summarise the fit."""
        if "state" in self.best:
            self.model.value_head.load_state_dict(self.best["state"])
        changed = policy_differences(self.before, self.model.state_dict())
        if changed:
            raise RuntimeError(f"calibration changed {changed[0]}; the policy must stay as BC "
                               "left it")
        held_features = torch.cat([f for f, _ in self.held]).cpu()
        held_targets = torch.cat([t for _, t in self.held]).cpu()
        ceiling = linear_ceiling(torch.cat([f for f, _ in self.fitted]),
                                 torch.cat([t for _, t in self.fitted]),
                                 held_features, held_targets)
        return {
            "selection_explained_variance": float(self.best["ev"]) if "state" in self.best
            else float("nan"),
            "initial_explained_variance": float(self.initial),
            "best_iteration": int(self.best.get("iteration", 0)),
            "linear_ceiling_explained_variance": float(ceiling),
            "wall_seconds": float(wall),
            "history": [float(h) for h in self.history],
        }
