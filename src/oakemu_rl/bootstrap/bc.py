"""Stage one, `oakemu bootstrap bc`: imprint the trunk and policy head on demonstrated actions.

Cross-entropy on the demonstrator's actions with the action mask applied to the logits.
The value head is not in the optimizer and comes out exactly as initialised; critic
calibration fits it next. The best epoch by validation loss is saved as `bc.pt`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from .. import distributed, runs
from ..checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from ..configs import check_choice, check_options
from ..demos import DemoFile, open_demo_files
from ..demos.dataset import DemoDataset, split_episodes
from ..envs import EnvSpec, require_same_env
from ..errors import ConfigError, DemoFileError, OakEmuError, check_finite
from ..metrics import MetricsLogger
from ..model import ARCHITECTURES, PPOModel, mixed_logits
from ..plots import plot_bc_curves
from ..rl.losses import bc_loss
from ..runtime import PRECISIONS, SEED_MAX, autocast_dtype, precision_used, resolve_device
from . import dagger

LR_SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class BCConfig:
    """Behaviour cloning settings; `oakemu bootstrap bc --help` shows them as options."""

    epochs: int = 10
    """Passes over the training episodes (fewer if early stopping ends it)."""
    batch_size: int = 64
    """Samples per gradient step."""
    lr: float = 3e-4
    """Peak Adam learning rate."""
    lr_schedule: str = "cosine"
    """How the learning rate falls over training: cosine, linear or constant."""
    weight_decay: float = 0.0
    """AdamW weight decay on the trunk and policy head."""
    label_smoothing: float = 0.0
    """Share of the target spread evenly over the allowed actions."""
    class_balance: bool = False
    """Weight each sample by the inverse frequency of its action in the training set."""
    augment_shift: int = 0
    """Random-shift augmentation: frames move by up to this many pixels (0: off; on Pong a
    4-pixel shift kept BC at the action prior, benchmarks/bc_quality.py)."""
    val_fraction: float = 0.1
    """Share of episodes held out for validation (ignored when the file stores a split)."""
    patience: int = 3
    """Stop after this many epochs without a better validation loss (0: never stop early)."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this (0 turns clipping off)."""
    seed: int = 0
    """Seeds the split, the model init, the shuffling and the augmentation."""
    precision: str = "auto"
    """Training arithmetic: fp32, bf16 (autocast on the conv trunk; weights, the policy
    head, logits and the loss stay fp32) or auto (bf16 on a GPU that supports it, fp32 on
    the CPU). Validation is always fp32."""
    cache_mb: int = 2048
    """Demo frames up to this size are read once and kept in memory; larger sets stream."""
    block_size: int = 256
    """Streaming: consecutive steps read together."""
    shuffle_blocks: int = 32
    """Streaming: blocks shuffled together (resident memory ≈ this × block_size frames)."""
    num_workers: int = 0
    """DataLoader worker processes reading the HDF5 files."""
    architecture: str = "nature"
    """Fresh model size: nature (the Nature-DQN trunk), small or tiny (quick CPU runs)."""
    head_gain: float = 1.0
    """Fresh model: re-initialise the policy head with this orthogonal gain before training
    (0 keeps PPO's near-uniform 0.01 init, under which BC sits at the action prior)."""
    sharpen: float = 1.0
    """Multiply the saved clone's policy logits by this: its greedy play stays the same,
    and above 1 its sampled play, which calibration and PPO start from, comes closer to
    the greedy play (a clone fitted to a person's hesitations samples them as jitter)."""
    relabel_episodes: int = 0
    """Relabelling (DAgger): after BC, the clone plays this many games while the scripted
    demonstrator labels every frame with what it would do, and a fresh BC trains on the
    demos and those frames (0: off)."""
    relabel_rounds: int = 1
    """Relabelling rounds: each round's newest clone plays `relabel_episodes` games into
    relabelled.h5, relabelled2.h5, ..., and a fresh BC trains on the demos and all of them."""
    relabel_epochs: int | tuple[int, ...] | None = None
    """Epochs of each BC after a relabelling round: one number for every round, or a list
    with one per round (default: epochs)."""
    relabel_style: str = "planner"
    """The scripted demonstrator's style that labels the clone's frames."""
    relabel_seed: int | None = None
    """Seed of the first relabelled game (default: the one after the demo files' last)."""
    relabel_workers: int = 0
    """Processes that play the relabelling games, one thread each (0: one per usable
    core); the relabelled file does not depend on it."""
    relabel_noise: float = 0.0
    """Chance that the clone plays a random allowed action at a step of its relabelling
    games: it then strays into states its own play rarely reaches (walls, far misses),
    which the script labels as always; the labels are never the random actions."""

    def __post_init__(self) -> None:
        check_options(self, [
            ("epochs", self.epochs >= 1, "≥ 1"), ("batch_size", self.batch_size >= 1, "≥ 1"),
            ("lr", self.lr > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, "≥ 0"),
            ("label_smoothing", 0 <= self.label_smoothing < 1, "in [0, 1)"),
            ("augment_shift", 0 <= self.augment_shift <= 16, "from 0 to 16"),
            ("val_fraction", 0 <= self.val_fraction < 1, "in [0, 1)"),
            ("patience", self.patience >= 0, "≥ 0"),
            ("max_grad_norm", self.max_grad_norm >= 0, "≥ 0"),
            ("head_gain", 0 <= self.head_gain <= 10, "from 0 to 10"),
            ("sharpen", 0 < self.sharpen <= 100, "in (0, 100]"),
            ("cache_mb", self.cache_mb >= 0, "≥ 0"),
            ("block_size", self.block_size >= 1, "≥ 1"),
            ("shuffle_blocks", self.shuffle_blocks >= 1, "≥ 1"),
            ("num_workers", self.num_workers >= 0, "≥ 0"),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
            ("relabel_episodes", self.relabel_episodes >= 0, "≥ 0"),
            ("relabel_rounds", self.relabel_rounds >= 1, "≥ 1"),
            ("relabel_epochs", all(e >= 1 for e in self._epochs_per_round()), "≥ 1 (each)"),
            ("relabel_epochs", not isinstance(self.relabel_epochs, tuple)
             or len(self.relabel_epochs) == self.relabel_rounds,
             f"one number, or a list of relabel_rounds = {self.relabel_rounds} numbers"),
            ("relabel_noise", 0 <= self.relabel_noise <= 1, "in [0, 1]"),
            ("relabel_workers", self.relabel_workers >= 0, "≥ 0"),
            ("relabel_seed", self.relabel_seed is None or 0 <= self.relabel_seed <= SEED_MAX,
             f"from 0 to {SEED_MAX}"),
        ], stage="bc")
        check_choice("bc", "architecture", self.architecture, sorted(ARCHITECTURES))
        check_choice("bc", "precision", self.precision, PRECISIONS)
        check_choice("bc", "lr_schedule", self.lr_schedule, LR_SCHEDULES)

    def _epochs_per_round(self) -> list[int]:
        """relabel_epochs as one entry per round (empty when unset)."""
        epochs = self.relabel_epochs
        if epochs is None:
            return []
        return list(epochs) if isinstance(epochs, tuple) else [epochs] * self.relabel_rounds

    def epochs_after_round(self, round_: int) -> int:
        """Epochs of the BC that follows relabelling round `round_` (from 1)."""
        epochs = self._epochs_per_round()
        return epochs[round_ - 1] if epochs else self.epochs


def random_shift(x: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each observation by up to `pad` pixels (edges repeated), all frames alike."""
    if pad == 0:
        return x
    n, _, h, w = x.shape
    padded = F.pad(x.float(), (pad, pad, pad, pad), mode="replicate").to(x.dtype)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    rows = (dy[:, None] + torch.arange(h)[None]).to(x.device)  # (n, h)
    cols = (dx[:, None] + torch.arange(w)[None]).to(x.device)  # (n, w)
    index = torch.arange(n, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[index, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()


def _lr_factor(schedule: str, step: int, total: int) -> float:
    progress = min(step / max(total, 1), 1.0)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0


@torch.no_grad()
def evaluate_bc(model: PPOModel, dataset: DemoDataset, mask: torch.Tensor,
                device: torch.device, world: distributed.World = distributed.SINGLE
                ) -> dict[str, float]:
    """Validation loss, accuracy and per-action accuracy (no augmentation, no smoothing),
    over every rank's share of the validation set."""
    model.eval()
    n_actions = model.action_shape
    correct = np.zeros(n_actions)
    total = np.zeros(n_actions)
    loss_sum = 0.0
    for obs, actions in dataset:
        obs, actions = obs.to(device), actions.to(device)
        logits = model.get_logits(obs)
        loss_sum += float(bc_loss(logits, actions, mask)) * len(actions)
        predicted = model.masked_logits(logits, mask).argmax(-1)
        hits = (predicted == actions).cpu().numpy()
        acts = actions.cpu().numpy()
        np.add.at(total, acts, 1)
        np.add.at(correct, acts, hits)
    sums = distributed.sum_over_ranks(world, torch.as_tensor(
        np.concatenate([[loss_sum], correct, total]), dtype=torch.float64, device=device))
    sums = sums.cpu().numpy()
    loss_sum, correct, total = sums[0], sums[1:1 + n_actions], sums[1 + n_actions:]
    n = total.sum()
    return {
        "loss": loss_sum / max(n, 1),
        "accuracy": float(correct.sum() / max(n, 1)),
        "per_action": [float(c / t) if t else float("nan") for c, t in zip(correct, total,
                                                                          strict=True)],
    }


def train_bc(config: BCConfig, demos: tuple[str, ...] | list[str], *,
             run_dir: str | Path | None = None, init_from: str | Path | None = None,
             device: str = "auto", progress: bool = True) -> Path:
    """Clone the demonstrations in `demos` into bc.pt in `run_dir` (default data/runs/GAME),
    from a fresh model or `init_from`'s weights; with `config.relabel_episodes`, then run
    the relabelling rounds, each followed by a fresh BC on the demos and every relabelled
    file so far. Returns the path of bc.pt."""
    if not demos:
        raise DemoFileError("bc needs at least one demo file")
    world, torch_device = distributed.init(resolve_device(device))
    if not world.is_main:  # rank 0 imports any Minari dataset; the others then reuse it
        distributed.barrier(world)
    files, run_dir = _demo_files(demos, run_dir)
    if world.is_main:
        distributed.barrier(world)
    dagger.check_labeller(config, files)
    try:
        path = _train_clone(config, files, run_dir, init_from, torch_device, progress, world)
        rounds = config.relabel_rounds if config.relabel_episodes else 0
        for round_ in range(1, rounds + 1):
            if world.is_main:  # rank 0 plays the round; the others wait for its file
                dagger.relabel_round(config, path, files, round_, device=device,
                                     progress=progress)
            distributed.barrier(world)
            files.append(str(dagger.relabelled_path(path.parent, round_)))
            # A fresh model: continuing the first clone for 5 epochs gained about a third
            # of what retraining did (benchmarks/bc_quality.py --relabel-episodes).
            path = _train_clone(
                dataclasses.replace(config, epochs=config.epochs_after_round(round_)), files,
                path.parent, init_from, torch_device, progress, world)
    except distributed.collective_failures() as error:
        if not world.enabled:
            raise
        raise distributed.lost_peer(world, error, "training stopped; bc.pt holds the best "
                                    "epoch saved so far, if any") from None
    return path


def _demo_files(demos: tuple[str, ...] | list[str], run_dir: str | Path | None
                ) -> tuple[list[str], str | Path | None]:
    """The demo files, with each `minari:NAMESPACE/NAME-v0` dataset imported into the run
    directory (whose default then follows the dataset's game)."""
    from ..demos.minari_io import MINARI_PREFIX, minari_game, resolve_demo_paths

    datasets = [str(d)[len(MINARI_PREFIX):] for d in demos if str(d).startswith(MINARI_PREFIX)]
    if not datasets:
        return [str(d) for d in demos], run_dir
    target = runs.prepare_run_dir(run_dir, minari_game(datasets[0].strip()))
    return list(resolve_demo_paths([str(d) for d in demos], target)), target


def _train_clone(config: BCConfig, files: list[str], run_dir: str | Path | None,
                 init_from: str | Path | None, device: torch.device, progress: bool,
                 world: distributed.World) -> Path:
    """One BC run on `files`: the best epoch by validation loss is saved as bc.pt."""
    run = _BCRun(config, open_demo_files(files), run_dir, init_from, device, progress, world)
    logger = MetricsLogger(run.run_dir, "bc") if world.is_main else contextlib.nullcontext()
    with logger as log:
        for epoch in range(1, config.epochs + 1):
            record = run.epoch(epoch)
            if log is not None:
                log.log(run.step, record)
            if run.after_epoch(epoch, record, files):
                break
    after = run.model.value_head.state_dict()
    assert all(torch.equal(run.value_head_before[k], after[k]) for k in after)
    if world.is_main:
        plot_bc_curves(run.history, run.run_dir / "bc_curves.png")
        runs.remember_run(run.run_dir)
    distributed.barrier(world)  # every rank returns once bc.pt is final
    return run.path


class _BCRun:
    """The model, data and counters of one BC run."""

    def __init__(self, config: BCConfig, demos: list[DemoFile], run_dir: str | Path | None,
                 init_from: str | Path | None, device: torch.device, progress: bool,
                 world: distributed.World) -> None:
        self.config, self.init_from, self.world = config, init_from, world
        self.progress = progress and world.is_main
        self.spec: EnvSpec = demos[0].spec
        self.meanings = demos[0].action_meanings
        self.mask_np = demos[0].action_mask
        self.device = device
        self.amp = autocast_dtype(config.precision, self.device)
        self.run_dir = runs.prepare_run_dir(run_dir, self.spec.game)
        self.path = self.run_dir / runs.STAGE_FILES["bc"]
        torch.manual_seed(config.seed)
        self.train_set, self.val_set = _datasets(config, demos, self.mask_np, world)
        self.parent = load_checkpoint(init_from) if init_from is not None else None
        model = _initial_model(config, self.spec, self.meanings, self.parent, init_from)
        model = model.to(self.device)
        if self.device.type == "cpu":
            # Channels-last convolutions train at least as fast as NCHW on the CPU
            # (benchmarks/bc_throughput.py); checkpoints are written NCHW all the same.
            model = model.to(memory_format=torch.channels_last)
        distributed.broadcast_model(world, model)
        self.model = model
        self.value_head_before = {k: v.clone() for k, v in model.value_head.state_dict().items()}
        self.params = [*model.conv.parameters(), *model.fc.parameters(),
                       *model.policy_head.parameters()]
        # One fused kernel for every parameter: on the CPU torch's default loops over the
        # tensors, a cost a small batch's step feels (benchmarks/bc_throughput.py).
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr,
                                           weight_decay=config.weight_decay, fused=True)
        self.mask = torch.as_tensor(self.mask_np, device=self.device)
        self.class_weights = _class_weights(self.train_set, len(self.meanings), self.device) \
            if config.class_balance else None
        self.loader = DataLoader(self.train_set, batch_size=None,
                                 num_workers=config.num_workers, persistent_workers=False)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.total_steps = config.epochs * len(self.train_set)
        self.best = {"loss": float("inf"), "epoch": 0}
        self.stale = self.step = self.samples = 0
        self.history: list[dict] = []
        self._announce()

    def _announce(self) -> None:
        if self.val_set is None and self.world.is_main:  # quiet runs need to know it too
            tqdm.write("note: no validation episodes (fewer than two episodes, or only "
                       "forbidden actions in them); the last epoch is saved")
        if not self.progress:
            return
        tqdm.write(f"bc on {self.device.type} in {'bf16 autocast' if self.amp else 'fp32'}: "
                   f"{self.train_set.total_samples:,} training and "
                   f"{self.val_set.total_samples if self.val_set else 0:,} validation samples")

    def epoch(self, epoch: int) -> dict[str, float]:
        """One pass over the training set; returns the epoch's metrics, validation included."""
        config = self.config
        self.model.train()
        self.train_set.set_epoch(epoch)
        loss_sum = hits = seen = 0.0
        start = time.perf_counter()
        bar = tqdm(self.loader, total=len(self.train_set), disable=not self.progress,
                   desc=f"bc epoch {epoch}/{config.epochs}", unit="batch", leave=False)
        for obs, actions in bar:
            loss, logits, actions = self._step(obs, actions, epoch)
            seen += len(actions)
            loss_sum += float(loss.detach()) * len(actions)
            hits += float((self.model.masked_logits(logits, self.mask).argmax(-1)
                           == actions).sum())
            bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{hits / seen:.3f}")
        bar.close()
        loss_sum, hits, seen = (float(v) for v in distributed.sum_over_ranks(
            self.world, torch.tensor([loss_sum, hits, seen], dtype=torch.float64)))
        record = {"epoch": epoch, "bc/train_loss": loss_sum / seen,
                  "bc/train_accuracy": hits / seen,
                  "bc/lr": self.optimizer.param_groups[0]["lr"],
                  "bc/samples_per_second": seen / (time.perf_counter() - start)}
        if self.val_set is not None:
            val = evaluate_bc(self.model, self.val_set, self.mask, self.device, self.world)
            record |= {"bc/val_loss": val["loss"], "bc/val_accuracy": val["accuracy"]}
            record |= {f"bc/val_accuracy/{m}": a
                       for m, a in zip(self.meanings, val["per_action"], strict=True)}
        return record

    def _step(self, obs: torch.Tensor, actions: torch.Tensor, epoch: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step on one batch; returns (loss, logits, actions) on the device."""
        config = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = config.lr * _lr_factor(config.lr_schedule, self.step, self.total_steps)
        obs = random_shift(obs, config.augment_shift, self.generator).to(self.device)
        actions = actions.to(self.device)
        logits = mixed_logits(self.model, obs, self.amp)
        loss = bc_loss(logits, actions, self.mask, label_smoothing=config.label_smoothing,
                       class_weights=self.class_weights)
        mean_loss = loss.detach() if not self.world.enabled else distributed.sum_over_ranks(
            self.world, loss.detach()) / self.world.world_size
        check_finite(mean_loss, "the BC loss", where=f"epoch {epoch}", outcome=self._outcome())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        distributed.average_gradients(self.world, self.params)
        # max_grad_norm 0 means no clipping: an infinite bound scales by 1 and still
        # measures the norm, so a NaN or inf gradient never reaches the weights.
        norm = torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm or math.inf,
                                              foreach=True)
        check_finite(norm, "a BC gradient", where=f"epoch {epoch}", outcome=self._outcome())
        self.optimizer.step()
        self.step += 1
        self.samples += len(actions) * self.world.world_size
        return loss, logits, actions

    def _outcome(self) -> str:
        kept = (f"epoch {self.best['epoch']}, the best so far, is kept in {self.path}"
                if self.best["epoch"] else f"this run wrote nothing to {self.path}")
        return f"training stopped ({kept}); try a lower --lr"

    def after_epoch(self, epoch: int, record: dict[str, float], files: list[str]) -> bool:
        """Save an improved epoch and report it; True when early stopping ends the run."""
        self.history.append(record)
        loss = record.get("bc/val_loss", record["bc/train_loss"])
        improved = self.val_set is None or loss < self.best["loss"]
        message = (f"epoch {epoch}: train loss {record['bc/train_loss']:.4f} acc "
                   f"{record['bc/train_accuracy']:.3f}")
        if self.val_set is not None:
            message += (f" | val loss {record['bc/val_loss']:.4f} acc "
                        f"{record['bc/val_accuracy']:.3f}")
        if improved:
            self.best = {"loss": loss, "epoch": epoch}
            self.stale = 0
            self._save(epoch, record, files)
            message += "  (saved)"
        else:
            self.stale += 1
        if self.progress:
            tqdm.write(message)
        if self.config.patience and self.stale >= self.config.patience:
            if self.progress:
                tqdm.write(f"early stop: no better validation loss for {self.stale} epochs")
            return True
        return False

    def _shipped(self) -> PPOModel:
        """The model as bc.pt holds it: training goes on with the fitted logits, and the
        saved clone has them multiplied by `sharpen`."""
        if self.config.sharpen == 1:
            return self.model
        model = copy.deepcopy(self.model)
        with torch.no_grad():
            for parameter in model.policy_head.parameters():
                parameter.mul_(self.config.sharpen)
        return model

    def _save(self, epoch: int, record: dict, files: list[str]) -> None:
        model = self._shipped()
        digests = distributed.weight_digests(self.world, model)
        if not self.world.is_main:
            return
        save_checkpoint(self.path, Checkpoint.from_model(
            model, stage="bc", action_meanings=self.meanings,
            action_mask=self.mask_np.tolist(), env_spec=self.spec.to_dict(),
            steps={"epochs": epoch, "updates": self.step, "samples": self.samples},
            config=dataclasses.asdict(self.config)
            | {"precision_used": precision_used(self.amp)},
            extra={"metrics": {k: float(v) for k, v in record.items()
                               if isinstance(v, float) and math.isfinite(v)},
                   "world_size": self.world.world_size, "rank_weight_sha256": digests},
            parent=self.parent, inputs=files))


def _datasets(config: BCConfig, demos: list[DemoFile], mask: np.ndarray,
              world: distributed.World) -> tuple[DemoDataset, DemoDataset | None]:
    """This rank's share of the training set and of the validation set (None when there is
    nothing to validate on: a val loss of 0.0 on no samples would stop training)."""
    if config.batch_size % world.world_size:
        raise ConfigError(f"bc option batch_size={config.batch_size} does not divide evenly "
                          f"over {world.world_size} ranks: --batch-size is the batch of all "
                          "ranks together; make it a multiple of the number of processes")
    train_refs, val_refs = split_episodes(demos, config.val_fraction, config.seed)
    if not train_refs:
        raise DemoFileError("the demo files hold no episodes to train on")
    common = dict(action_mask=mask, cache_bytes=config.cache_mb << 20,
                  block_size=config.block_size, shuffle_blocks=config.shuffle_blocks,
                  batch_size=config.batch_size // world.world_size,
                  shard=(world.rank, world.world_size))
    train_set = DemoDataset(demos, train_refs, shuffle=True, seed=config.seed, **common)
    if train_set.total_samples == 0:
        raise DemoFileError("every demonstrated action is forbidden by the action mask")
    val_set = DemoDataset(demos, val_refs, shuffle=False, **common) if val_refs else None
    if val_set is not None and val_set.num_samples == 0:
        val_set = None
    return train_set, val_set


def _class_weights(train_set: DemoDataset, actions: int, device: torch.device) -> torch.Tensor:
    """Inverse action frequencies, normalised over the actions that occur."""
    counts = torch.as_tensor(train_set.action_counts(actions), dtype=torch.float32)
    return torch.where(counts > 0, counts.sum() / counts.clamp(min=1) / (counts > 0).sum(),
                       torch.zeros_like(counts)).to(device)


def _initial_model(config: BCConfig, spec: EnvSpec, meanings: list[str],
                   start: Checkpoint | None = None, path: str | Path | None = None) -> PPOModel:
    """A fresh model with a re-initialised policy head, or `start`'s weights."""
    if start is None:
        model = PPOModel(spec.observation_shape, len(meanings),
                         ARCHITECTURES[config.architecture])
        if config.head_gain:
            # With PPO's 0.01 gain the trunk's gradient is scaled down a hundredfold, and on
            # Atari frames BC stays at the action prior for thousands of steps; a unit gain
            # gets past it within a few epochs (benchmarks/bc_quality.py --head-gain). The
            # model config keeps 0.01, so `finetune ppo --from-scratch` still starts uniform.
            torch.nn.init.orthogonal_(model.policy_head.weight, config.head_gain)
            torch.nn.init.zeros_(model.policy_head.bias)
        return model
    require_same_env(f"checkpoint {path}", EnvSpec.from_dict(start.env_spec),
                     start.action_meanings, "the demo files", spec, meanings,
                     hint="use demos recorded with its spec", error=OakEmuError)
    return start.build_model()
