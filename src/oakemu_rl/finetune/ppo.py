"""Stage three, `oakemu finetune ppo`: full PPO from the warm start, without forgetting it.

A readable loop in the usual Atari-PPO shape (rollout → GAE → epochs of minibatches of
clipped-surrogate updates), with three guards against the known failure of PPO from a
BC policy — the first updates, driven by an untrained critic, wreck the imprint:

- **critic-first warm-up**: for `warmup_updates` updates the trunk and policy are frozen
  (no gradients, no optimizer state, outside the gradient-norm clip: only the value head
  learns), then their learning rate ramps up over `warmup_ramp_updates`;
- **KL anchor**: a penalty `kl_coef × decay^update × KL(π_bootstrap ‖ π)` toward the frozen
  starting policy;
- **BC loss** on demo batches mixed into the loss with an annealed weight (optional).

Checkpoints every `checkpoint_every` updates (`ppo_last.pt`, with optimizer state) make
`--resume` continue with the same global step, optimizer state and schedules.

**Selection**: every greedy evaluation plays the same `eval_episodes` games (the selection
seeds, from `eval_seed`, apart from the training envs' seeds and the final test's), and the
shipped `ppo.pt` holds the evaluated policy with the best mean score there (the latest on a
tie: near a game's ceiling many evaluations tie, and the later one has trained longer at no
worse a score; docs/results.md, "Game Boy learning"); `ppo_last.pt` keeps the last one.
`ppo.pt`'s extra `selection` names the update chosen, its score ± standard error and every
evaluation's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .. import distributed, runs
from ..agents import greedy_agent
from ..agents.play import EvalConfig, play_games, score_text
from ..checkpoint import (
    Checkpoint,
    lineage_inputs,
    load_checkpoint,
    plain_state_dict,
    save_checkpoint,
)
from ..configs import check_choice, check_options
from ..demos import open_demo_files
from ..demos.dataset import DemoDataset, split_episodes
from ..envs import EnvSpec, require_same_env
from ..errors import ConfigError, EnvError, OakEmuError, check_finite
from ..metrics import MetricsLogger
from ..model import PPOModel, mixed_forward, mixed_logits
from ..rl.losses import PPOBatch, PPOCoefficients, bc_loss, ppo_loss
from ..rl.returns import gae
from ..rl.rollout import Rollout, RolloutCollector
from ..runtime import (
    PRECISIONS,
    SEED_MAX,
    autocast_dtype,
    precision_used,
    resolve_device,
    torch_threads,
)

LAST = "ppo_last.pt"

# Options that fix the counters and schedules a resumed run must continue.
RESUME_KEYS = ("total_steps", "num_envs", "num_steps", "lr", "anneal_lr", "anneal_ent",
               "warmup_updates", "warmup_ramp_updates", "kl_coef", "kl_decay", "bc_coef",
               "bc_decay", "label_rollouts", "from_scratch", "eval_episodes", "eval_seed",
               "eval_max_steps")


@dataclass(frozen=True)
class PPOConfig:
    """PPO settings; defaults follow the standard Atari recipe."""

    from_scratch: bool = False
    """Start from a fresh model with the starting checkpoint's env spec (for comparison);
    the warm-start guards (warm-up, KL anchor, BC loss) are then off."""
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
    """Entropy bonus (at update 1, when anneal_ent)."""
    anneal_ent: bool = False
    """Anneal the entropy bonus linearly to 0 over training, as the learning rate is: the
    policy keeps exploring early and sharpens toward the greedy play that is tested."""
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
    """Critic-first warm-up: updates in which only the value head learns."""
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
    bc_batch_size: int = 64
    """Demo samples per minibatch for the BC loss."""
    label_rollouts: str | None = None
    """Style of the scripted player that labels every state the rollouts visit: the BC
    loss then covers the agent's own states too, at the same weight (a game with a
    scripted player; it reads each emulator's RAM, so Atari rollouts step single envs in
    worker processes rather than the C++ vector env; needs bc_coef)."""
    eval_every: int = 0
    """Greedy evaluation every this many updates, and always after the last (0: only after
    the last); ppo.pt is the evaluated policy that scored best."""
    eval_episodes: int = 10
    """Greedy games per evaluation, the same selection games every time (0: no evaluation,
    ppo.pt is the last policy)."""
    eval_seed: int = 10_000
    """Seed of the first selection game: evaluations play seeds eval_seed to eval_seed +
    eval_episodes - 1, which must not be training envs' seeds (seed + 1 onwards)."""
    eval_max_steps: int | None = None
    """Agent steps after which an evaluation episode is cut (default: whole games, as the
    final test plays them; a cut game's score is not a game score)."""
    checkpoint_every: int = 10
    """Write ppo_last.pt every this many updates."""
    seed: int = 0
    """Seeds the emulators, the sampling and the minibatches."""
    # One thread by default: on a 2-core machine shared with other work a second OpenMP
    # thread waits at every barrier for a core the emulators hold; on a machine of your
    # own two are faster (docs/results.md, "PPO torch threads").
    threads: int = 1
    """Torch CPU threads while training (0: leave torch's default), and as many processes
    play the evaluation games."""
    precision: str = "auto"
    """Trunk arithmetic in rollouts and learning steps: fp32, bf16 (autocast on the conv
    trunk; weights, heads, logits and losses stay fp32) or auto (bf16 where the hardware
    does bf16 arithmetic: a GPU that supports it, a CPU with AVX512-BF16 or AMX; else
    fp32). Evaluation games and the saved policy are fp32."""

    def __post_init__(self) -> None:
        try:  # (a wrong type or count is refused below, by name)
            training = self.training_seeds() if self.batch_size >= 1 else range(0)
        except TypeError:
            training = range(0)
        check_options(self, [
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
            ("label_rollouts", self.label_rollouts is None or self.bc_coef > 0,
             "left unset while --bc-coef is 0 (the labels feed the BC loss)"),
            ("eval_every", self.eval_every >= 0, "≥ 0"),
            ("eval_episodes", self.eval_episodes >= 0, "≥ 0"),
            ("eval_max_steps", self.eval_max_steps is None or self.eval_max_steps >= 1, "≥ 1"),
            ("eval_seed", 0 <= self.eval_seed <= SEED_MAX - self.eval_episodes,
             f"from 0 to {SEED_MAX} - --eval-episodes"),
            ("eval_seed", not seeds_overlap(self.selection_seeds, training),
             f"outside the training envs' seeds ({describe_seeds(training)})"),
            ("checkpoint_every", self.checkpoint_every >= 1, "≥ 1"),
            ("threads", self.threads >= 0, "≥ 0"),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
        ], stage="ppo")
        check_choice("ppo", "precision", self.precision, PRECISIONS)

    @property
    def selection_seeds(self) -> range:
        """The seeds of the games every greedy evaluation plays (empty without evaluation)."""
        return range(self.eval_seed, self.eval_seed + self.eval_episodes)

    def training_seeds(self, world_size: int = 1) -> range:
        """Every seed a training env may start from: a run (or a resume after update u)
        seeds env i of rank r with seed + u + 1 + r × num_envs + i."""
        return range(self.seed + 1, self.seed + self.updates(world_size)
                     + world_size * self.num_envs)

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.updates()

    def updates(self, world_size: int = 1) -> int:
        """Updates of a run on `world_size` ranks: each update takes a global batch of
        world_size × num_envs × num_steps agent steps."""
        return max(1, self.total_steps // (self.batch_size * world_size))

    @property
    def coefficients(self) -> PPOCoefficients:
        return PPOCoefficients(clip_coef=self.clip_coef, ent_coef=self.ent_coef,
                               vf_coef=self.vf_coef, clip_vloss=self.clip_vloss,
                               norm_adv=self.norm_adv)


def seeds_overlap(first: range, second: range) -> bool:
    """Whether two ranges of game seeds share a seed."""
    return bool(first) and bool(second) and first.start < second.stop \
        and second.start < first.stop


def describe_seeds(seeds: range) -> str:
    """`first to last` of a range of game seeds."""
    return f"{seeds.start} to {seeds.stop - 1}" if seeds else "(none)"


# -- schedules (pure) --------------------------------------------------------------------


def _remaining(config: PPOConfig, update: int, world_size: int) -> float:
    """The linear fade the annealed schedules share: 1 at update 1, falling toward 0."""
    return 1.0 - (update - 1) / config.updates(world_size)


def lr_at(config: PPOConfig, update: int, world_size: int = 1) -> float:
    """Learning rate of update `update` (1-based) before the warm-up factor."""
    if not config.anneal_lr:
        return config.lr
    return config.lr * _remaining(config, update, world_size)


def ent_at(config: PPOConfig, update: int, world_size: int = 1) -> float:
    """Entropy-bonus weight of update `update` (1-based)."""
    if not config.anneal_ent:
        return config.ent_coef
    return config.ent_coef * _remaining(config, update, world_size)


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


def _mean(values: list) -> float | None:
    """Mean of floats or of 0-d tensors (read out in one go); None when there are none."""
    if not values:
        return None
    if isinstance(values[0], torch.Tensor):
        return float(torch.stack(values).double().mean())
    return float(np.mean(values))


# -- the stage -----------------------------------------------------------------------------


def finetune_ppo(config: PPOConfig, *, run_dir: str | Path | None = None,
                 checkpoint: str | Path | None = None, resume: bool = False,
                 bc_demos: tuple[str, ...] = (), device: str = "auto",
                 progress: bool = True, stop_after_steps: int | None = None) -> Path:
    """Run PPO from `checkpoint` (default: the run directory's calibrated.pt) and return
    the path of ppo.pt. `resume` continues the run directory's ppo_last.pt; `bc_demos`
    feed the BC loss (default: the demo files the starting policy was cloned from).

    `stop_after_steps` pauses the run at the first update that reaches that many agent
    steps: it writes ppo_last.pt there and returns its path, and writes no ppo.pt. The
    schedules (learning rate, anchor and BC fades) stay those of `total_steps`, so a
    paused run is the same run as a whole one up to that point, and `resume` goes on."""
    world, torch_device = distributed.init(resolve_device(device))
    with torch_threads(config.threads):
        if config.from_scratch:  # nothing to protect: plain PPO
            config = dataclasses.replace(config, warmup_updates=0, warmup_ramp_updates=0,
                                         kl_coef=0.0, bc_coef=0.0, label_rollouts=None)
        source, run_dir = runs.stage_source(run_dir, checkpoint, needs="calibrate")
        start = load_checkpoint(source)
        if config.label_rollouts is not None:
            _check_labeller(config.label_rollouts, start)
        if not config.from_scratch:
            _check_critic_returns(config, start, source)
        trainer = _Trainer(config, start, run_dir, torch_device, progress, world)
        trainer.inputs = [source]
        if resume:
            trainer.resume()
        if stop_after_steps is not None:
            trainer.pause_at(stop_after_steps)
        if config.bc_coef > 0:
            demos = bc_demos or tuple(lineage_inputs(start, "bc"))
            trainer.demo_batches = _demo_batches(config, start, demos, world)
            trainer.inputs += demos
        try:
            trainer.train()
        except distributed.collective_failures() as error:
            if not world.enabled:
                raise
            kept = (f"the last good checkpoint is {trainer.last_path}; continue from it with "
                    "the same command and --resume" if trainer.saved
                    else "no checkpoint was written by this run")
            raise distributed.lost_peer(world, error, kept) from None
        return trainer.finish()


def _check_labeller(style: str, start: Checkpoint) -> None:
    """Refuse, before the run directory is touched, labels no script can give."""
    from ..agents.scripted import make_demonstrator

    try:
        make_demonstrator(EnvSpec.from_dict(start.env_spec), style=style)
    except EnvError as error:
        raise ConfigError(f"--label-rollouts {style}: {error}") from None


CRITIC_RETURNS = ("reward_clipping", "episodic_life", "gamma")
"""What defines the returns a critic predicts: calibration and PPO must agree on them."""


def _check_critic_returns(config: PPOConfig, start: Checkpoint, source: Path) -> None:
    """A calibrated critic fitted to other returns than PPO trains it on would start PPO
    with a wrong baseline, the failure calibration exists to prevent: refuse it."""
    if start.stage != "calibrate":
        return
    differ = [k for k in CRITIC_RETURNS
              if k in start.config and start.config[k] != getattr(config, k)]
    if differ:
        raise ConfigError(
            f"{source}'s critic was calibrated for other returns than this PPO trains on ("
            + ", ".join(f"{k} {start.config[k]!r} there, {getattr(config, k)!r} here"
                        for k in differ)
            + "); calibrate with the same settings, or start from bc.pt with --checkpoint")


def _demo_batches(config: PPOConfig, start: Checkpoint, paths: tuple[str, ...],
                  world: distributed.World = distributed.SINGLE):
    """An endless stream of shuffled (observation, action) demo batches, forbidden actions
    left out as BC leaves them out, read in blocks rather than row by row."""
    if not paths:
        raise ConfigError("--bc-coef needs demo files: pass --bc-demos FILE")
    demos = open_demo_files(paths)
    require_same_env(f"demo file {demos[0].path}", demos[0].spec, demos[0].action_meanings,
                     "the checkpoint", EnvSpec.from_dict(start.env_spec), start.action_meanings,
                     hint="pass matching --bc-demos", error=OakEmuError)
    train, _ = split_episodes(demos, 0.0, config.seed)
    dataset = DemoDataset(demos, train, batch_size=config.bc_batch_size,
                          action_mask=np.asarray(start.action_mask), seed=config.seed,
                          cache_bytes=256 << 20, shard=(world.rank, world.world_size))
    return _epochs(dataset)


def _epochs(dataset: DemoDataset) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The dataset's batches, epoch after epoch, each epoch shuffled anew. (A generator of
    its own, so `_demo_batches` checks the files before training starts.)"""
    epoch = 0
    while True:
        epoch += 1
        dataset.set_epoch(epoch)
        yield from dataset


class _Trainer:
    """The state of one PPO run: model, frozen reference, optimizer, envs, counters."""

    def __init__(self, config: PPOConfig, start: Checkpoint, run_dir: Path,
                 device: torch.device, progress: bool,
                 world: distributed.World = distributed.SINGLE) -> None:
        self.config, self.start, self.run_dir = config, start, run_dir
        self.device, self.world = device, world
        self.progress = progress and world.is_main
        self.num_updates = config.updates(world.world_size)
        self.stop_update = self.num_updates
        """The last update this process runs (before num_updates when the run pauses)."""
        self.spec = EnvSpec.from_dict(start.env_spec)
        torch.manual_seed(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        model = (PPOModel(start.observation_shape, start.action_count, start.model_config)
                 if config.from_scratch else start.build_model()).to(device)
        if device.type == "cpu":
            # oneDNN's channels-last convolutions train faster than NCHW on the CPU
            # (benchmarks/ppo_throughput.py); checkpoints are still written NCHW.
            model = model.to(memory_format=torch.channels_last)
        distributed.broadcast_model(world, model)
        self.model = model
        self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.shared = [*model.conv.parameters(), *model.fc.parameters(),
                       *model.policy_head.parameters()]
        self.optimizer = torch.optim.Adam(
            [{"params": self.shared, "name": "trunk_policy"},
             {"params": list(model.value_head.parameters()), "name": "value_head"}],
            lr=config.lr, eps=1e-5, fused=True)  # one kernel for all: see bc.py
        self.mask = start.action_mask_tensor().to(device)
        self.amp = autocast_dtype(config.precision, device, native_cpu=True)
        self.first_update, self.global_step = 1, 0
        self.saved = False  # whether ppo_last.pt holds a good state of this run
        self.demo_batches: Any = None
        self.last_eval: dict[str, float] = {}
        self.best: dict[str, Any] | None = None
        """The best-scoring evaluation so far, with its weights: what ppo.pt will hold."""
        self.evaluations: list[dict[str, Any]] = []
        """Every evaluation's update, agent step, mean score, standard error and games."""
        self.collector: RolloutCollector | None = None
        self.inputs: list[str | Path] = []
        """The files this run reads, named in the lineage: the start and any BC demos."""

    @property
    def last_path(self) -> Path:
        return self.run_dir / LAST

    def pause_at(self, steps: int) -> None:
        """End this process's run at the first update that reaches `steps` agent steps."""
        if steps < 1:
            raise ConfigError(f"the run can pause after 1 agent step or more, not {steps}")
        batch = self.config.batch_size * self.world.world_size
        self.stop_update = min(self.num_updates, -(-steps // batch))
        if self.stop_update < self.first_update:
            raise OakEmuError(
                f"{self.last_path} is already at update {self.first_update - 1} "
                f"({self.global_step:,} agent steps), past the pause at {steps:,} steps")

    def resume(self) -> None:
        """Continue from ppo_last.pt: weights, reference, optimizer, RNGs and counters."""
        path = self.last_path
        if not path.exists():
            raise OakEmuError(f"nothing to resume: {path} does not exist")
        last = load_checkpoint(path)
        if last.stage != "ppo" or "optimizer" not in last.extra:
            raise OakEmuError(f"{path} is not a resumable PPO checkpoint")
        ranks = int(last.extra.get("world_size", 1))
        if ranks != self.world.world_size:
            raise OakEmuError(
                f"{path} was written by a run on {ranks} rank(s), and this one has "
                f"{self.world.world_size}: the ranks set the batch and so the schedule; resume "
                f"with {ranks} process(es) (torchrun --nproc-per-node and --nnodes)")
        changed = [k for k in RESUME_KEYS if k in last.config
                   and last.config[k] != getattr(self.config, k)]
        if changed:
            raise OakEmuError(
                f"{path} was written with other settings ("
                + ", ".join(f"--{k.replace('_', '-')} {last.config[k]!r}, now "
                            f"{getattr(self.config, k)!r}" for k in changed)
                + "); resume with the same options")
        used, now = last.config.get("precision_used"), precision_used(self.amp)
        if used not in (None, now) and self.world.is_main:
            # Allowed (the weights are fp32 either way), but the run is then not the one a
            # single run in one precision gives: say so where the run's output shows it.
            tqdm.write(f"note: {path} trained its trunk in {used}; the resumed updates train "
                       f"it in {now} (--precision {self.config.precision})")
        self.model.load_state_dict(last.state_dict)
        self.reference.load_state_dict(last.extra["reference"])
        self.optimizer.load_state_dict(last.extra["optimizer"])
        self.first_update = int(last.steps["ppo/updates"]) + 1
        self.global_step = int(last.steps["ppo/global_step"])
        self.generator.set_state(last.extra["generator"])
        torch.set_rng_state(last.extra["torch_rng"])
        kept = last.extra.get("selection_state", {})
        self.best, self.evaluations = kept.get("best"), list(kept.get("evaluations", []))
        self.saved = True

    def train(self) -> None:
        config = self.config
        learning = dataclasses.replace(self.spec, reward_clipping=config.reward_clipping,
                                       episodic_life=config.episodic_life)
        # Rank r steps the envs a single process with ranks × num_envs envs would number
        # r × num_envs onwards, with the same seeds: the ranks split one run's envs.
        self.collector = RolloutCollector(
            learning, self.model, self.mask, num_envs=config.num_envs,
            num_steps=config.num_steps, device=self.device,
            seed=config.seed + self.first_update + self.world.rank * config.num_envs,
            labeller=config.label_rollouts, amp=self.amp)
        self.collector.global_step = self.global_step // self.world.world_size
        bar = tqdm(total=self.num_updates, initial=self.first_update - 1,
                   disable=not self.progress, desc="ppo", unit="update")
        resumed = self.first_update > 1
        logger = MetricsLogger(self.run_dir, "ppo",
                               resume_after=self.global_step if resumed else None) \
            if self.world.is_main else contextlib.nullcontext(_NoLog())
        try:
            with logger as log:
                started = (time.perf_counter(), self.global_step)
                for update in range(self.first_update, self.stop_update + 1):
                    record = self.update(update, started)
                    for step, score, length in self.finished_games():
                        log.log(step, {"charts/episodic_return": score,
                                       "charts/episodic_length": length})
                    log.log(self.steps_done(), record)
                    if update % config.checkpoint_every == 0 or update == self.stop_update:
                        self.save(self.last_path, update, final=False)
                    _show(bar, record, _mean(list(self.collector.stats.returns)[-20:]))
        finally:
            bar.close()
            self.collector.close()

    def finished_games(self) -> list[tuple[int, float, int]]:
        """(agent step over every rank, score, length) of each game finished in the last
        rollout, on any rank, in step order: one metrics point per game, as raw scores."""
        ranks = distributed.gather_objects(self.world, self.collector.stats.drain())
        size = self.world.world_size
        return sorted((step * size, score, length) for games in ranks
                      for step, score, length in games)

    def steps_done(self) -> int:
        """Agent steps so far over every rank."""
        return self.collector.global_step * self.world.world_size

    def update(self, update: int, started: tuple[float, int]) -> dict[str, Any]:
        """One rollout and its epochs of minibatch steps; returns the update's metrics."""
        config, collector = self.config, self.collector
        lr = lr_at(config, update, self.world.world_size)
        factor = policy_lr_factor(config, update)
        self.optimizer.param_groups[0]["lr"] = lr * factor
        self.optimizer.param_groups[1]["lr"] = lr
        rollout = collector.collect()
        learn_start = time.perf_counter()
        stats, stopped = self.learn(rollout, update, frozen=factor == 0)
        collector.timings.learn += time.perf_counter() - learn_start
        elapsed = time.perf_counter() - started[0]
        record = {
            "charts/learning_rate": lr,
            "charts/policy_lr_factor": factor,
            "charts/SPS": (self.steps_done() - started[1]) / max(elapsed, 1e-9),
            "charts/update": update,
            "losses/explained_variance": stats.pop("explained_variance"),
            "charts/ent_coef": ent_at(config, update, self.world.world_size),
            "guards/kl_coef": kl_weight(config, update),
            "guards/bc_coef": bc_weight(config, update) if self.demo_batches else 0.0,
            "guards/target_kl_stop": stopped,
        }
        for key, name in (("pg", "losses/policy_loss"), ("v", "losses/value_loss"),
                          ("ent", "losses/entropy"), ("approx_kl", "losses/approx_kl"),
                          ("old_approx_kl", "losses/old_approx_kl"),
                          ("clipfrac", "losses/clipfrac"), ("kl_ref", "guards/kl_ref"),
                          ("bc", "guards/bc_loss"), ("bc_rollout", "guards/bc_rollout_loss")):
            record[name] = self.across_ranks(stats.get(key, []))
        if config.eval_episodes and (update == self.num_updates or (
                config.eval_every and update % config.eval_every == 0)):
            record |= self.evaluate(update)
        return record

    def across_ranks(self, values: list[torch.Tensor]) -> float | None:
        """The mean over minibatches and ranks of one statistic (None when it is absent)."""
        mean = _mean(values)
        if not self.world.enabled or mean is None:
            return mean
        total = distributed.sum_over_ranks(self.world, torch.tensor([mean], device=self.device))
        return float(total[0]) / self.world.world_size

    def learn(self, rollout: Rollout, update: int, *, frozen: bool
              ) -> tuple[dict[str, Any], bool]:
        """Epochs of minibatch steps on one rollout. While `frozen` (the critic-first
        warm-up) the trunk and policy take no gradient, so Adam keeps no state for them and
        the norm clip measures the value head alone."""
        config = self.config
        advantages, returns = gae(rollout.rewards, rollout.values, rollout.next_values,
                                  rollout.terminations, rollout.truncations, config.gamma,
                                  config.gae_lambda)
        obs = rollout.obs.reshape(-1, *rollout.obs.shape[2:])
        batch = PPOBatch(actions=rollout.actions.reshape(-1),
                         log_probs=rollout.log_probs.reshape(-1),
                         advantages=advantages.reshape(-1), returns=returns.reshape(-1),
                         values=rollout.values.reshape(-1),
                         labels=None if rollout.labels is None else rollout.labels.reshape(-1))
        size = config.batch_size // config.num_minibatches
        kl_w, bc_w = kl_weight(config, update), bc_weight(config, update)
        if kl_w > 0:  # the frozen policy's logits, once per rollout, not per epoch
            with torch.no_grad():
                ref = torch.cat([mixed_logits(self.reference, obs[b:b + size], self.amp)
                                 for b in range(0, config.batch_size, size)])
            batch = dataclasses.replace(batch, ref_logits=ref)
        coef = dataclasses.replace(config.coefficients, kl_weight=kl_w,
                                   ent_coef=ent_at(config, update, self.world.world_size))
        for parameter in self.shared:
            parameter.requires_grad_(not frozen)
        stats: dict[str, list[torch.Tensor]] = {}
        try:
            for _ in range(config.update_epochs):
                order = torch.randperm(config.batch_size, generator=self.generator)
                for b in range(0, config.batch_size, size):
                    idx = order[b:b + size].to(self.device)
                    step = self.step(obs[idx], _take(batch, idx), coef, bc_w, update)
                    for key, value in step.items():
                        stats.setdefault(key, []).append(value)
                if config.target_kl is not None and \
                        self.across_ranks(stats["approx_kl"][-1:]) > config.target_kl:
                    return self.with_ev(stats, batch), True
        finally:
            for parameter in self.shared:
                parameter.requires_grad_(True)
        return self.with_ev(stats, batch), False

    def with_ev(self, stats: dict[str, Any], batch: PPOBatch) -> dict[str, Any]:
        """`stats` with the explained variance of the rollout's values over every rank."""
        values, returns = batch.values.double(), batch.returns.double()
        residual = returns - values
        sums = distributed.sum_over_ranks(self.world, torch.stack([
            returns.new_tensor(float(len(returns))), returns.sum(), returns.pow(2).sum(),
            residual.sum(), residual.pow(2).sum()]))
        n, s, ss, rs, rss = (float(v) for v in sums)
        var = ss / n - (s / n) ** 2
        stats["explained_variance"] = float("nan") if var <= 0 else \
            1.0 - (rss / n - (rs / n) ** 2) / var
        return stats

    def step(self, obs: torch.Tensor, batch: PPOBatch, coef: PPOCoefficients, bc_w: float,
             update: int) -> dict[str, torch.Tensor]:
        """One optimizer step on one minibatch; returns its statistics."""
        if self.world.enabled and coef.norm_adv:
            batch = dataclasses.replace(batch, advantages=self.normalized(batch.advantages))
            coef = dataclasses.replace(coef, norm_adv=False)
        logits, values = mixed_forward(self.model, obs, self.amp)
        loss, stats = ppo_loss(logits, values.squeeze(-1), self.mask, batch, coef)
        if self.demo_batches is not None and bc_w > 0:
            demo_obs, demo_actions = next(self.demo_batches)
            bc = bc_loss(mixed_logits(self.model, demo_obs.to(self.device), self.amp),
                         demo_actions.to(self.device), self.mask)
            loss = loss + bc_w * bc
            stats["bc"] = bc.detach()
        if batch.labels is not None and bc_w > 0:  # the script's labels on the agent's states
            own = bc_loss(logits, batch.labels, self.mask)
            loss = loss + bc_w * own
            stats["bc_rollout"] = own.detach()
        outcome = self.stopped_outcome()
        # Every rank checks the same number (the mean over ranks), so all stop together.
        check_finite(self.across_ranks([loss.detach()]), "the PPO loss",
                     where=f"update {update}", outcome=outcome)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        learning = [p for p in self.model.parameters() if p.grad is not None]
        distributed.average_gradients(self.world, learning)
        norm = torch.nn.utils.clip_grad_norm_(learning, self.config.max_grad_norm, foreach=True)
        check_finite(norm, "a PPO gradient", where=f"update {update}", outcome=outcome)
        self.optimizer.step()
        return stats

    def normalized(self, advantages: torch.Tensor) -> torch.Tensor:
        """Advantages normalised by the mean and (unbiased) std of the global minibatch:
        the union of every rank's minibatch, as one process with all the envs would."""
        a = advantages.double()
        n, s, ss = (float(v) for v in distributed.sum_over_ranks(self.world, torch.stack([
            a.new_tensor(float(len(a))), a.sum(), a.pow(2).sum()])))
        mean = s / n
        std = max((ss - n * mean * mean) / max(n - 1, 1), 0.0) ** 0.5
        return (advantages - mean) / (std + 1e-8)

    def stopped_outcome(self) -> str:
        if self.saved:
            return (f"training stopped, the last good checkpoint is {self.last_path} (continue "
                    "from it with --resume, e.g. with a lower --lr)")
        return "training stopped, no checkpoint was written by this run"

    def evaluate(self, update: int) -> dict[str, Any]:
        """Greedy games of the current policy on the selection seeds (the same games at
        every evaluation, so their means compare); keeps the policy when it scores best so
        far. Every rank takes part (the weight digests), rank 0 alone plays."""
        digests = distributed.weight_digests(self.world, self.model)
        if not self.world.is_main:
            return {}
        # The onnx agent traces a copy of the weights, so the model in training is untouched.
        agent = greedy_agent(self.model, self.mask.cpu().numpy(), device="cpu", engine="onnx")
        config = self.config
        # The training threads idle while the games play: each of their cores plays games
        # in a process of its own (docs/results.md, "Greedy play speed").
        start = time.perf_counter()
        result = play_games(agent, self.spec, EvalConfig(
            episodes=config.eval_episodes, seed=config.eval_seed,
            max_steps=config.eval_max_steps, workers=torch.get_num_threads()),
            progress=False)
        seconds = time.perf_counter() - start
        self.collector.timings.evaluation += seconds
        point = {"update": update, "global_step": self.steps_done(), "mean": result.mean,
                 "sem": None if np.isnan(result.sem) else result.sem,
                 "episodes": result.episodes}
        self.evaluations.append(point)
        record = {"eval/greedy_return": result.mean, "eval/greedy_return_std": result.std,
                  "eval/greedy_return_sem": result.sem, "eval/episodes": result.episodes,
                  "eval/greedy_length": result.mean_length, "eval/seconds": seconds}
        if self.best is None or result.mean >= self.best["mean"]:  # the later of a tie
            self.best = point | {"state_dict": plain_state_dict(self.model),
                                 "rank_weight_sha256": digests, "eval": record}
        self.last_eval = record | {"eval/selected_update": self.best["update"],
                                   "eval/selected_return": self.best["mean"]}
        return self.last_eval

    def selection(self) -> dict[str, Any]:
        """What ppo.pt records of how it was chosen: the update, its selection score ±
        standard error over how many games on which seeds, and every evaluation's score."""
        config = self.config
        if self.best is None:
            return {"update": self.num_updates, "evaluated": False}
        seeds = config.selection_seeds
        return {"evaluated": True, "last_update": self.num_updates,
                "seeds": [seeds.start, seeds.stop - 1], "max_steps": config.eval_max_steps,
                **{k: self.best[k] for k in ("update", "global_step", "mean", "sem",
                                             "episodes")},
                "evaluations": list(self.evaluations)}

    def save(self, path: Path, update: int, *, final: bool) -> None:
        """Rank 0 writes `path`, with every rank's weight digest; every rank then knows a
        good checkpoint exists. The final file (ppo.pt) holds the selected policy."""
        digests = distributed.weight_digests(self.world, self.model)
        if not self.world.is_main:
            self.saved = True
            return
        chosen = self.best if final and self.best is not None else None
        extra = {"selection": self.selection()} if final else {
            "optimizer": self.optimizer.state_dict(),
            "reference": plain_state_dict(self.reference),
            "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
            "selection_state": {"best": self.best, "evaluations": self.evaluations}}
        extra |= {"world_size": self.world.world_size,
                  "rank_weight_sha256": chosen["rank_weight_sha256"] if chosen else digests,
                  "timings": self.collector.timings.as_dict(),
                  "eval": chosen["eval"] if chosen else self.last_eval}
        steps = ({"updates": chosen["update"], "global_step": chosen["global_step"]} if chosen
                 else {"updates": update, "global_step": self.steps_done()})
        checkpoint = Checkpoint.from_model(
            self.model, stage="ppo", action_meanings=self.start.action_meanings,
            action_mask=self.start.action_mask, env_spec=self.start.env_spec,
            steps=steps, config=dataclasses.asdict(self.config)
            | {"precision_used": precision_used(self.amp)}, extra=extra,
            parent=self.start, inputs=self.inputs)
        if chosen:
            checkpoint = dataclasses.replace(checkpoint, state_dict=chosen["state_dict"])
        save_checkpoint(path, checkpoint)
        self.saved = True

    def finish(self) -> Path:
        """Write ppo.pt, or nothing more than ppo_last.pt when the run paused; return it."""
        if self.stop_update < self.num_updates:
            path = self.last_path
        else:
            path = self.run_dir / runs.STAGE_FILES["ppo"]
            self.save(path, self.num_updates, final=True)
        distributed.barrier(self.world)  # the other ranks return once the file is written
        if self.world.is_main:
            runs.remember_run(self.run_dir)
        if self.progress:
            t = self.collector.timings
            parts = {"env": t.env, "inference": t.inference, "learning": t.learn,
                     "evaluation games": t.evaluation}
            total = max(sum(parts.values()), 1e-9)
            tqdm.write("time: " + ", ".join(f"{name} {seconds:.0f}s "
                                            f"({100 * seconds / total:.0f}%)"
                                            for name, seconds in parts.items())
                       + f"; trunk in {precision_used(self.amp)}")
        return path


def selection_summary(selection: dict[str, Any]) -> str:
    """One line on which policy a ppo.pt holds and how it scored when it was chosen."""
    if not selection.get("evaluated"):
        return "no greedy evaluation (eval_episodes 0): the last policy"
    first, last = selection["seeds"]
    return (f"update {selection['update']} of {selection['last_update']}, selected on "
            f"{score_text(selection['mean'], selection['sem'], selection['episodes'])} "
            f"greedy, seeds {first}-{last} (the last update is in {LAST})")


def _take(batch: PPOBatch, idx: torch.Tensor) -> PPOBatch:
    """The rows `idx` of every tensor of a flattened rollout."""
    return PPOBatch(**{f.name: None if getattr(batch, f.name) is None
                       else getattr(batch, f.name)[idx] for f in dataclasses.fields(batch)})


class _NoLog:
    """The metrics logger of a rank other than 0: rank 0 alone writes metrics."""

    def log(self, step: int, record: dict[str, Any]) -> None:
        pass


def _show(bar: tqdm, record: dict[str, Any], recent: float | None) -> None:
    """The bar's postfix: speed, this rank's last 20 games' mean score, approximate KL."""
    bar.set_postfix(SPS=f"{record['charts/SPS']:.0f}",
                    ret="-" if recent is None else f"{recent:+.1f}",
                    kl=f"{record['losses/approx_kl']:.3f}")
    bar.update(1)
