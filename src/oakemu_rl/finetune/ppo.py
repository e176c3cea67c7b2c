"""Stage three, `oakemu finetune ppo`: full PPO from the warm start, without forgetting it.

A readable loop in the usual Atari-PPO shape (rollout → GAE → epochs of minibatches of
clipped-surrogate updates), with three guards against the known failure of PPO from a
BC policy — the first updates, driven by an untrained critic, wreck the imprint:

- **critic-first warm-up**: for `warmup_updates` updates the trunk and policy have
  learning rate 0 (only the value head learns), then their rate ramps up over
  `warmup_ramp_updates`;
- **KL anchor**: a penalty `kl_coef × decay^update × KL(π_bootstrap ‖ π)` toward the frozen
  starting policy;
- **BC loss** on demo batches mixed into the loss with an annealed weight (optional).

Checkpoints every `checkpoint_every` updates (`ppo_last.pt`, with optimizer state) make
`--resume` continue with the same global step, optimizer state and schedules.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import runs
from ..agents import SEED_MAX, resolve_device
from ..checkpoint import Checkpoint, load_checkpoint, plain_state_dict, save_checkpoint
from ..envs import EnvSpec
from ..errors import ConfigError, OakEmuError, check_options
from ..metrics import MetricsLogger
from ..model import PPOModel
from .advantages import explained_variance, td_lambda
from .rollout import RolloutCollector

LAST = "ppo_last.pt"

# Options that fix the counters and schedules a resumed run must continue.
RESUME_KEYS = ("total_steps", "num_envs", "num_steps", "lr", "anneal_lr", "warmup_updates",
               "warmup_ramp_updates", "kl_coef", "kl_decay", "bc_coef", "bc_decay",
               "from_scratch")


@dataclass(frozen=True)
class PPOConfig:
    """PPO settings; defaults follow the standard Atari recipe."""

    run_dir: str | None = None
    """Run directory holding calibrated.pt; ppo.pt is written there (default: the last run)."""
    checkpoint: str | None = None
    """Start from this checkpoint (any stage) instead of the run's calibrated.pt."""
    from_scratch: bool = False
    """Start from a fresh model with the starting checkpoint's env spec (for comparison);
    the warm-start guards (warm-up, KL anchor, BC loss) are then off."""
    resume: bool = False
    """Continue from the run's ppo_last.pt: same global step, optimizer state, schedules."""
    total_steps: int = 200_000
    """Agent steps (over all envs) to train for."""
    num_envs: int = 8
    """Emulators stepped together."""
    num_steps: int = 128
    """Steps per env per rollout."""
    lr: float = 2.5e-4
    """Adam learning rate (annealed linearly to 0 when anneal_lr)."""
    anneal_lr: bool = True
    """Anneal the learning rate linearly to 0 over training."""
    gamma: float = 0.99
    """Discount."""
    gae_lambda: float = 0.95
    """λ of GAE."""
    num_minibatches: int = 4
    """Minibatches per epoch."""
    update_epochs: int = 4
    """Passes over each rollout."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    clip_coef: float = 0.1
    """Surrogate clipping range."""
    clip_vloss: bool = True
    """Clip the value loss around the rollout's values."""
    ent_coef: float = 0.01
    """Entropy bonus."""
    vf_coef: float = 0.5
    """Value-loss weight."""
    max_grad_norm: float = 0.5
    """Gradient-norm clipping."""
    target_kl: float | None = None
    """Stop an update's epochs early once the approximate KL exceeds this."""
    reward_clipping: bool = True
    """Clip learning rewards to their sign."""
    episodic_life: bool = True
    """A lost life ends the learning episode (the game goes on)."""
    warmup_updates: int = 10
    """Critic-first warm-up: updates with the trunk and policy frozen (learning rate 0)."""
    warmup_ramp_updates: int = 10
    """Updates over which the trunk and policy learning rate ramps from 0 to full."""
    kl_coef: float = 0.2
    """Weight of KL(bootstrap policy ‖ policy) at update 1 (0 turns the anchor off)."""
    kl_decay: float = 0.9995
    """Per-update decay of the KL weight."""
    bc_coef: float = 0.0
    """Weight of a BC loss on demo batches at update 1 (0 turns it off)."""
    bc_decay: float = 0.99
    """Per-update decay of the BC weight."""
    bc_demos: tuple[str, ...] = ()
    """Demo files for the BC loss (default: the demos bc.pt was trained on)."""
    bc_batch_size: int = 64
    """Demo samples per minibatch for the BC loss."""
    eval_every: int = 0
    """Greedy evaluation every this many updates (0: only at the end)."""
    eval_episodes: int = 3
    """Episodes per greedy evaluation."""
    eval_max_steps: int | None = None
    """Agent steps after which an evaluation episode is cut (default: whole games, as the
    final test plays them; a cut game's score is not a game score)."""
    checkpoint_every: int = 10
    """Write ppo_last.pt every this many updates."""
    seed: int = 0
    """Seeds the emulators, the sampling and the minibatches."""
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    # Default by measurement (benchmarks/ppo_throughput.py, Nature CNN, 8 envs, 2-core CPU
    # shared with other jobs): under load (load average 4-5) two threads ran ~6x slower
    # than one (36 vs 201 SPS): the second OpenMP thread waits at every barrier for a core
    # that the emulator threads and other processes hold. On the idle machine two threads
    # are 1.67x faster (681 vs 407 SPS): pass --threads 2 (or 0) on a machine of your own.
    threads: int = 1
    """Torch CPU threads while training (0: leave torch's default)."""
    progress: bool = True
    """Show a tqdm bar with SPS and recent return."""

    def __post_init__(self) -> None:
        check_options("ppo", self, [
            ("total_steps", self.total_steps >= 1, "≥ 1"),
            ("num_envs", self.num_envs >= 1, "≥ 1"), ("num_steps", self.num_steps >= 1, "≥ 1"),
            ("lr", self.lr > 0, "> 0"), ("gamma", 0 < self.gamma <= 1, "in (0, 1]"),
            ("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
            ("num_minibatches", 1 <= self.num_minibatches <= self.num_envs * self.num_steps,
             f"from 1 to --num-envs × --num-steps ({self.num_envs * self.num_steps})"),
            ("update_epochs", self.update_epochs >= 1, "≥ 1"),
            ("clip_coef", self.clip_coef > 0, "> 0"), ("ent_coef", self.ent_coef >= 0, "≥ 0"),
            ("vf_coef", self.vf_coef >= 0, "≥ 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            ("target_kl", self.target_kl is None or self.target_kl > 0, "> 0"),
            ("warmup_updates", self.warmup_updates >= 0, "≥ 0"),
            ("warmup_ramp_updates", self.warmup_ramp_updates >= 0, "≥ 0"),
            ("kl_coef", self.kl_coef >= 0, "≥ 0"),
            ("kl_decay", 0 < self.kl_decay <= 1, "in (0, 1]"),
            ("bc_coef", self.bc_coef >= 0, "≥ 0"),
            ("bc_decay", 0 < self.bc_decay <= 1, "in (0, 1]"),
            ("bc_batch_size", self.bc_batch_size >= 1, "≥ 1"),
            ("eval_every", self.eval_every >= 0, "≥ 0"),
            ("eval_episodes", self.eval_episodes >= 0, "≥ 0"),
            ("eval_max_steps", self.eval_max_steps is None or self.eval_max_steps >= 1, "≥ 1"),
            ("checkpoint_every", self.checkpoint_every >= 1, "≥ 1"),
            ("threads", self.threads >= 0, "≥ 0"),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
        ])

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return max(1, self.total_steps // self.batch_size)


# -- schedules (pure) --------------------------------------------------------------------


def lr_at(config: PPOConfig, update: int) -> float:
    """Learning rate of update `update` (1-based) before the warm-up factor."""
    if not config.anneal_lr:
        return config.lr
    return config.lr * (1.0 - (update - 1) / config.num_updates)


def policy_lr_factor(config: PPOConfig, update: int) -> float:
    """0 during the critic-first warm-up, then a linear ramp to 1."""
    if update <= config.warmup_updates:
        return 0.0
    if config.warmup_ramp_updates == 0:
        return 1.0
    return min(1.0, (update - config.warmup_updates) / config.warmup_ramp_updates)


def kl_weight(config: PPOConfig, update: int) -> float:
    return config.kl_coef * config.kl_decay ** (update - 1)


def bc_weight(config: PPOConfig, update: int) -> float:
    return config.bc_coef * config.bc_decay ** (update - 1)


# -- loss pieces (pure) --------------------------------------------------------------------


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
    low = torch.finfo(logits.dtype).min
    ref_logp = torch.log_softmax(ref_logits.masked_fill(~mask, low), -1)
    logp = torch.log_softmax(logits.masked_fill(~mask, low), -1)
    terms = ref_logp.exp() * (ref_logp - logp)
    return terms.where(mask, torch.zeros_like(terms)).sum(-1).mean()


def _mean(values: list) -> float | None:
    """Mean of floats or of 0-d tensors (read out in one go); None when there are none."""
    if not values:
        return None
    if isinstance(values[0], torch.Tensor):
        return float(torch.stack(values).double().mean())
    return float(np.mean(values))


# -- the stage -----------------------------------------------------------------------------


def _starting_checkpoint(config: PPOConfig) -> tuple[Path, Checkpoint, Path]:
    if config.checkpoint is not None:
        source = Path(config.checkpoint)
        checkpoint = load_checkpoint(source)
        run_dir = runs.prepare_run_dir(config.run_dir or source.parent, "")
        return source, checkpoint, run_dir
    run_dir = runs.find_run_dir(config.run_dir, needs="calibrate")
    source = runs.stage_input(run_dir, "calibrate")
    return source, load_checkpoint(source), run_dir


def _param_groups(model: PPOModel) -> list[dict]:
    shared = [*model.conv.parameters(), *model.fc.parameters(),
              *model.policy_head.parameters()]
    return [{"params": shared, "name": "trunk_policy"},
            {"params": list(model.value_head.parameters()), "name": "value_head"}]


class _DemoBatches:
    """Random (observation, action) batches from demo files for the BC loss."""

    def __init__(self, paths: tuple[str, ...], spec: EnvSpec, meanings: list[str],
                 batch_size: int, seed: int) -> None:
        from ..bootstrap.bc import open_demo_files

        self.demos = open_demo_files(paths)
        for demo in self.demos:
            if not demo.spec.same_frames_as(spec) or demo.action_meanings != meanings:
                raise OakEmuError(
                    f"demo file {demo.path} was recorded with another env spec than the "
                    "checkpoint; pass matching --bc-demos"
                )
        self.index = [(f, i, t) for f, d in enumerate(self.demos)
                      for i, e in enumerate(d.episodes) for t in range(e.length)]
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        picks = self.rng.choice(len(self.index), size=min(self.batch_size, len(self.index)),
                                replace=False)
        obs, acts = [], []
        for p in picks:
            f, i, t = self.index[p]
            obs.append(self.demos[f].observation(i, t))
            acts.append(int(self.demos[f].read(i, "actions", slice(t, t + 1))[0]))
        return torch.from_numpy(np.stack(obs)), torch.tensor(acts)


def _greedy_eval(model: PPOModel, spec: EnvSpec, mask: torch.Tensor, config: PPOConfig,
                 update: int) -> dict[str, float]:
    from ..tester import EvalConfig, evaluate, greedy_agent

    # The onnx agent traces a copy of the weights, so the model in training is not touched.
    agent = greedy_agent(model, mask.cpu().numpy(), device="cpu", engine="onnx")
    result = evaluate(agent, spec.for_evaluation(), EvalConfig(
        episodes=config.eval_episodes, seed=10_000 + update, max_steps=config.eval_max_steps,
        progress=False))
    return {"eval/greedy_return": result.mean, "eval/greedy_return_std": result.std,
            "eval/greedy_length": result.mean_length}


def _diverged(what: str, update: int, last: Path | None) -> OakEmuError:
    kept = (f"the last good checkpoint is {last} (continue from it with --resume, e.g. with "
            "a lower --lr)" if last is not None else "no checkpoint was written by this run")
    return OakEmuError(f"{what} at update {update}; training stopped, {kept}")


def finetune_ppo(config: PPOConfig) -> Path:
    """Run PPO; returns the path of ppo.pt."""
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _finetune_ppo(config)
    finally:
        torch.set_num_threads(threads)


def _finetune_ppo(config: PPOConfig) -> Path:
    if config.from_scratch:  # nothing to protect: plain PPO
        config = dataclasses.replace(config, warmup_updates=0, warmup_ramp_updates=0,
                                     kl_coef=0.0, bc_coef=0.0)
    source, start, run_dir = _starting_checkpoint(config)
    base_spec = EnvSpec.from_dict(start.env_spec)
    spec = dataclasses.replace(base_spec, reward_clipping=config.reward_clipping,
                               episodic_life=config.episodic_life)
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)

    if config.from_scratch:
        model = PPOModel(start.observation_shape, start.action_count, start.model_config)
    else:
        model = start.build_model()
    model = model.to(device)
    if device.type == "cpu":
        # Measured (benchmarks/ppo_throughput.py, Nature CNN, 1 thread): oneDNN's
        # channels-last convolutions make training ~1.4x faster than NCHW (432 vs 300
        # SPS); the model lays its inputs out to match (PPOModel._features). Checkpoints
        # are still written in the default layout (Checkpoint.from_model).
        model = model.to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model).eval()  # the bootstrap policy the KL anchor holds to
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    optimizer = torch.optim.Adam(_param_groups(model), lr=config.lr, eps=1e-5)
    mask = start.action_mask_tensor().to(device)

    first_update = 1
    global_step = 0
    resume_path = run_dir / LAST
    if config.resume:
        if not resume_path.exists():
            raise OakEmuError(f"nothing to resume: {resume_path} does not exist")
        last = load_checkpoint(resume_path)
        if last.stage != "ppo" or "optimizer" not in last.extra:
            raise OakEmuError(f"{resume_path} is not a resumable PPO checkpoint")
        changed = [k for k in RESUME_KEYS if k in last.config
                   and last.config[k] != getattr(config, k)]
        if changed:
            raise OakEmuError(
                f"{resume_path} was written with other settings ("
                + ", ".join(f"--{k.replace('_', '-')} {last.config[k]!r}, now "
                            f"{getattr(config, k)!r}" for k in changed)
                + "); resume with the same options"
            )
        model.load_state_dict(last.state_dict)
        reference.load_state_dict(last.extra["reference"])
        optimizer.load_state_dict(last.extra["optimizer"])
        first_update = int(last.steps["updates"]) + 1
        global_step = int(last.steps["global_step"])
        generator.set_state(last.extra["generator"])
        torch.set_rng_state(last.extra["torch_rng"])

    demo_batches = None
    if config.bc_coef > 0:
        paths = config.bc_demos or tuple(start.config.get("demos", ()))
        if not paths:
            raise ConfigError("--bc-coef needs demo files: pass --bc-demos FILE")
        demo_batches = _DemoBatches(tuple(paths), base_spec, start.action_meanings,
                                    config.bc_batch_size, config.seed)

    collector = RolloutCollector(spec, model, mask, num_envs=config.num_envs,
                                 num_steps=config.num_steps, device=device,
                                 seed=config.seed + first_update)
    collector.global_step = global_step
    minibatch = config.batch_size // config.num_minibatches
    start_time = time.perf_counter()
    start_step = global_step
    last_eval: dict[str, float] = {}
    bar = tqdm(total=config.num_updates, initial=first_update - 1, disable=not config.progress,
               desc="ppo", unit="update")

    saved = config.resume  # a resumed run starts from a good ppo_last.pt

    def save(path: Path, update: int, final: bool) -> None:
        nonlocal saved
        extra = {"optimizer": optimizer.state_dict(), "reference": plain_state_dict(reference),
                 "generator": generator.get_state(), "torch_rng": torch.get_rng_state()}
        checkpoint = Checkpoint.from_model(
            model, stage="ppo", action_meanings=start.action_meanings,
            action_mask=start.action_mask, env_spec=start.env_spec,
            steps=start.steps | {"updates": update, "global_step": collector.global_step},
            config=dataclasses.asdict(config) | {"bc_demos": list(config.bc_demos),
                                                 "source": str(source)},
            extra=({} if final else extra) | {"timings": collector.timings.as_dict(),
                                              "eval": last_eval},
        )
        save_checkpoint(path, checkpoint)
        saved = True

    try:
        with MetricsLogger(run_dir, "ppo",
                           resume_after=global_step if config.resume else None) as log:
            for update in range(first_update, config.num_updates + 1):
                lr = lr_at(config, update)
                factor = policy_lr_factor(config, update)
                optimizer.param_groups[0]["lr"] = lr * factor
                optimizer.param_groups[1]["lr"] = lr
                rollout = collector.collect()
                advantages, returns = td_lambda(
                    rollout.rewards, rollout.values, rollout.next_values,
                    rollout.terminations, rollout.truncations, config.gamma, config.gae_lambda)
                learn_start = time.perf_counter()
                b_obs = rollout.obs.reshape(-1, *rollout.obs.shape[2:])
                b_actions = rollout.actions.reshape(-1)
                b_logprobs = rollout.log_probs.reshape(-1)
                b_adv = advantages.reshape(-1)
                b_returns = returns.reshape(-1)
                b_values = rollout.values.reshape(-1)
                kl_w, bc_w = kl_weight(config, update), bc_weight(config, update)
                ref_logits_all = None
                if kl_w > 0:  # the frozen policy's logits, once per rollout, not per epoch
                    with torch.no_grad():
                        ref_logits_all = torch.cat([
                            reference.get_logits(b_obs[b:b + minibatch])
                            for b in range(0, config.batch_size, minibatch)])
                # Detached 0-d tensors, read out once per update (a float() per minibatch
                # would wait for the device every time).
                stats: dict[str, list[torch.Tensor]] = {k: [] for k in (
                    "pg", "v", "ent", "kl_ref", "bc", "approx_kl", "old_approx_kl", "clipfrac")}
                stop = False
                for _ in range(config.update_epochs):
                    order = torch.randperm(config.batch_size, generator=generator).to(device)
                    for b in range(0, config.batch_size, minibatch):
                        idx = order[b:b + minibatch]
                        obs = b_obs[idx]
                        logits, new_value = model(obs)
                        new_value = new_value.squeeze(-1)
                        masked = model.masked_logits(logits, mask)
                        logp_all = torch.log_softmax(masked, -1)
                        new_logprob = logp_all.gather(-1, b_actions[idx, None]).squeeze(-1)
                        p_all = logp_all.exp()
                        entropy = -(p_all * logp_all).where(mask, torch.zeros_like(p_all)).sum(-1)
                        logratio = new_logprob - b_logprobs[idx]
                        ratio = logratio.exp()
                        with torch.no_grad():
                            stats["old_approx_kl"].append((-logratio).mean())
                            stats["approx_kl"].append(((ratio - 1) - logratio).mean())
                            stats["clipfrac"].append(
                                ((ratio - 1).abs() > config.clip_coef).float().mean())
                        adv = b_adv[idx]
                        if config.norm_adv and len(idx) > 1:
                            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                        pg = policy_loss(adv, ratio, config.clip_coef)
                        v = value_loss(new_value, b_values[idx], b_returns[idx],
                                       config.clip_coef, config.clip_vloss)
                        ent = entropy.mean()
                        loss = pg - config.ent_coef * ent + config.vf_coef * v
                        if ref_logits_all is not None:
                            kl_ref = masked_kl(ref_logits_all[idx], logits, mask)
                            loss = loss + kl_w * kl_ref
                            stats["kl_ref"].append(kl_ref.detach())
                        if demo_batches is not None and bc_w > 0:
                            from ..bootstrap.bc import bc_loss

                            d_obs, d_act = demo_batches.sample()
                            bc = bc_loss(model.get_logits(d_obs.to(device)), d_act.to(device),
                                         mask)
                            loss = loss + bc_w * bc
                            stats["bc"].append(bc.detach())
                        if not torch.isfinite(loss):
                            raise _diverged(f"the PPO loss became {float(loss.detach())}",
                                            update, resume_path if saved else None)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                   config.max_grad_norm)
                        if not torch.isfinite(grad_norm):
                            raise _diverged(f"a PPO gradient became {float(grad_norm)}",
                                            update, resume_path if saved else None)
                        optimizer.step()
                        stats["pg"].append(pg.detach())
                        stats["v"].append(v.detach())
                        stats["ent"].append(ent.detach())
                    if config.target_kl is not None and \
                            float(stats["approx_kl"][-1]) > config.target_kl:
                        stop = True
                        break
                collector.timings.learn += time.perf_counter() - learn_start
                elapsed = time.perf_counter() - start_time
                sps = (collector.global_step - start_step) / max(elapsed, 1e-9)
                record = {
                    "charts/learning_rate": lr,
                    "charts/policy_lr_factor": factor,
                    "charts/SPS": sps,
                    "charts/episodic_return": _mean(list(collector.stats.returns)[-20:]),
                    "charts/episodic_length": _mean(list(collector.stats.lengths)[-20:]),
                    "losses/policy_loss": _mean(stats["pg"]),
                    "losses/value_loss": _mean(stats["v"]),
                    "losses/entropy": _mean(stats["ent"]),
                    "losses/approx_kl": _mean(stats["approx_kl"]),
                    "losses/old_approx_kl": _mean(stats["old_approx_kl"]),
                    "losses/clipfrac": _mean(stats["clipfrac"]),
                    "losses/explained_variance": explained_variance(
                        b_values.cpu().numpy(), b_returns.cpu().numpy()),
                    "guards/kl_ref": _mean(stats["kl_ref"]),
                    "guards/kl_coef": kl_w,
                    "guards/bc_loss": _mean(stats["bc"]),
                    "guards/bc_coef": bc_w if demo_batches is not None else 0.0,
                    "guards/target_kl_stop": stop,
                    "charts/update": update,
                }
                if config.eval_every and update % config.eval_every == 0:
                    last_eval = _greedy_eval(model, base_spec, mask, config, update)
                    record |= last_eval
                log.log(collector.global_step, record)
                if update % config.checkpoint_every == 0 or update == config.num_updates:
                    save(resume_path, update, final=False)
                recent = record["charts/episodic_return"]
                bar.set_postfix(SPS=f"{sps:.0f}", ret="-" if recent is None else f"{recent:+.1f}",
                                kl=f"{record['losses/approx_kl']:.3f}")
                bar.update(1)
            if config.eval_episodes:
                last_eval = _greedy_eval(model, base_spec, mask, config, config.num_updates)
                log.log(collector.global_step, last_eval)
    finally:
        bar.close()
        collector.close()

    path = run_dir / runs.STAGE_FILES["ppo"]
    save(path, config.num_updates, final=True)
    runs.remember_run(run_dir)
    if config.progress:
        t = collector.timings
        total = max(t.env + t.inference + t.learn, 1e-9)
        tqdm.write(
            f"time: env {t.env:.0f}s ({100 * t.env / total:.0f}%), inference "
            f"{t.inference:.0f}s ({100 * t.inference / total:.0f}%), learning {t.learn:.0f}s "
            f"({100 * t.learn / total:.0f}%)"
        )
        if last_eval:
            tqdm.write(f"greedy return {last_eval['eval/greedy_return']:+.1f} over "
                       f"{config.eval_episodes} episode(s); wrote {path}")
    return path
