"""Stage one, `oakemu bootstrap bc`: imprint the trunk and policy head on demonstrated actions.

Cross-entropy on the demonstrator's actions with the action mask applied to the logits.
The value head is not in the optimizer and comes out exactly as initialised; critic
calibration fits it next. The best epoch by validation loss is saved as `bc.pt`.
"""

from __future__ import annotations

import contextlib
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

from .. import runs
from ..agents import PRECISIONS, SEED_MAX, autocast_dtype, resolve_device
from ..checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from ..demos import DemoFile
from ..envs import EnvSpec
from ..errors import ConfigError, DemoFileError, OakEmuError, check_options
from ..metrics import MetricsLogger
from ..model import ARCHITECTURES, PPOModel
from ..plots import plot_bc_curves
from .data import DemoDataset, split_episodes

LR_SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class BCConfig:
    """Behaviour cloning settings; `oakemu bootstrap bc --help` shows them as options."""

    demos: tuple[str, ...]
    """Demo files recorded with one env spec."""
    run_dir: str | None = None
    """Where bc.pt and metrics go (default data/runs/<game>)."""
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
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    precision: str = "auto"
    """Training arithmetic: fp32, bf16 (autocast; weights and the loss stay fp32) or auto
    (bf16 on a GPU that supports it, fp32 on the CPU). Validation is always fp32."""
    cache_mb: int = 2048
    """Demo frames up to this size are read once and kept in memory; larger sets stream."""
    block_size: int = 256
    """Streaming: consecutive steps read together."""
    shuffle_blocks: int = 32
    """Streaming: blocks shuffled together (resident memory ≈ this × block_size frames)."""
    num_workers: int = 0
    """DataLoader worker processes reading the HDF5 files."""
    checkpoint: str | None = None
    """Start from this checkpoint's weights instead of a fresh model (same spec)."""
    architecture: str = "nature"
    """Fresh model size: nature (the Nature-DQN trunk), small or tiny (quick CPU runs)."""
    head_gain: float = 1.0
    """Fresh model: re-initialise the policy head with this orthogonal gain before training
    (0 keeps PPO's near-uniform 0.01 init, under which BC sits at the action prior)."""
    progress: bool = True
    """Show tqdm bars."""

    def __post_init__(self) -> None:
        check_options("bc", self, [
            ("epochs", self.epochs >= 1, "≥ 1"), ("batch_size", self.batch_size >= 1, "≥ 1"),
            ("lr", self.lr > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, "≥ 0"),
            ("label_smoothing", 0 <= self.label_smoothing < 1, "in [0, 1)"),
            ("augment_shift", 0 <= self.augment_shift <= 16, "from 0 to 16"),
            ("val_fraction", 0 <= self.val_fraction < 1, "in [0, 1)"),
            ("patience", self.patience >= 0, "≥ 0"),
            ("max_grad_norm", self.max_grad_norm >= 0, "≥ 0"),
            ("head_gain", 0 <= self.head_gain <= 10, "from 0 to 10"),
            ("cache_mb", self.cache_mb >= 0, "≥ 0"),
            ("block_size", self.block_size >= 1, "≥ 1"),
            ("shuffle_blocks", self.shuffle_blocks >= 1, "≥ 1"),
            ("num_workers", self.num_workers >= 0, "≥ 0"),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
        ])
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"bc option architecture must be one of {sorted(ARCHITECTURES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"bc option precision must be one of {PRECISIONS}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"bc option lr_schedule must be one of {LR_SCHEDULES}")
        if not self.demos:
            raise ConfigError("bc needs at least one demo file")


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
    masked = logits.masked_fill(~action_mask, torch.finfo(logits.dtype).min)
    log_probs = torch.log_softmax(masked, dim=-1)
    target = F.one_hot(actions, logits.shape[-1]).to(log_probs.dtype)
    if label_smoothing > 0:
        allowed = action_mask.to(log_probs.dtype)
        target = (1 - label_smoothing) * target + label_smoothing * allowed / allowed.sum()
    per_sample = -(target * log_probs).where(action_mask, torch.zeros_like(log_probs)).sum(-1)
    if class_weights is None:
        return per_sample.mean()
    weights = class_weights[actions]
    return (weights * per_sample).sum() / weights.sum()


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


def open_demo_files(paths: tuple[str, ...] | list[str]) -> list[DemoFile]:
    """Open demo files that share one env spec, or say which one differs."""
    demos = [DemoFile(p) for p in paths]
    for demo in demos[1:]:
        if not demo.spec.same_frames_as(demos[0].spec) or \
                demo.action_meanings != demos[0].action_meanings:
            raise DemoFileError(
                f"demo files {demos[0].path} and {demo.path} were recorded with different "
                "env specs; merge only matching files"
            )
    return demos


@torch.no_grad()
def evaluate_bc(model: PPOModel, dataset: DemoDataset, mask: torch.Tensor,
                device: torch.device) -> dict[str, float]:
    """Validation loss, accuracy and per-action accuracy (no augmentation, no smoothing)."""
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
    n = total.sum()
    return {
        "loss": loss_sum / max(n, 1),
        "accuracy": float(correct.sum() / max(n, 1)),
        "per_action": [float(c / t) if t else float("nan") for c, t in zip(correct, total,
                                                                          strict=True)],
    }


def train_bc(config: BCConfig) -> Path:
    """Run behaviour cloning; returns the path of the saved bc.pt."""
    demos = open_demo_files(config.demos)
    spec: EnvSpec = demos[0].spec
    meanings = demos[0].action_meanings
    mask_np = demos[0].action_mask
    device = resolve_device(config.device)
    amp = autocast_dtype(config.precision, device)
    precision_used = "bf16" if amp else "fp32"
    run_dir = runs.prepare_run_dir(config.run_dir, spec.game)
    torch.manual_seed(config.seed)

    train_refs, val_refs = split_episodes(demos, config.val_fraction, config.seed)
    if not train_refs:
        raise DemoFileError("the demo files hold no episodes to train on")
    common = dict(action_mask=mask_np, cache_bytes=config.cache_mb << 20,
                  block_size=config.block_size, shuffle_blocks=config.shuffle_blocks,
                  batch_size=config.batch_size)
    train_set = DemoDataset(demos, train_refs, shuffle=True, seed=config.seed, **common)
    val_set = DemoDataset(demos, val_refs, shuffle=False, **common) if val_refs else None
    if train_set.num_samples == 0:
        raise DemoFileError("every demonstrated action is forbidden by the action mask")
    if val_set is not None and val_set.num_samples == 0:
        val_set = None  # only forbidden actions: a val loss of 0.0 would stop training
        tqdm.write("note: the validation episodes hold only forbidden actions, so there is "
                   "no validation; the last epoch is saved")

    model = _initial_model(config, spec, meanings).to(device)
    if device.type == "cpu":
        # Channels-last convolutions: NCHW ran at 0.83x of them with batch 128 in
        # benchmarks/bc_throughput.py, and level (1.01x) with batch 64 in another run on the
        # shared machine. The model lays its inputs out to match, and checkpoints are
        # written in the default layout (checkpoint.plain_state_dict).
        model = model.to(memory_format=torch.channels_last)
    value_head_before = {k: v.clone() for k, v in model.value_head.state_dict().items()}
    params = [*model.conv.parameters(), *model.fc.parameters(),
              *model.policy_head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    mask = torch.as_tensor(mask_np, device=device)
    class_weights = None
    if config.class_balance:
        counts = torch.as_tensor(train_set.action_counts(len(meanings)), dtype=torch.float32)
        class_weights = torch.where(counts > 0, counts.sum() / counts.clamp(min=1) /
                                    (counts > 0).sum(), torch.zeros_like(counts)).to(device)

    loader = DataLoader(train_set, batch_size=None, num_workers=config.num_workers,
                        persistent_workers=False)
    generator = torch.Generator().manual_seed(config.seed)
    total_steps = config.epochs * len(train_set)
    best = {"loss": float("inf"), "epoch": 0}
    stale = 0
    step = 0
    samples = 0
    history = []
    path = run_dir / runs.STAGE_FILES["bc"]
    if not val_refs:
        tqdm.write("note: fewer than two episodes, so no validation split; the last epoch "
                   "is saved")

    if config.progress:
        tqdm.write(f"bc on {device.type} in {precision_used}{' autocast' if amp else ''}: "
                   f"{train_set.num_samples:,} training and "
                   f"{val_set.num_samples if val_set else 0:,} validation samples")
    with MetricsLogger(run_dir, "bc") as log:
        for epoch in range(1, config.epochs + 1):
            model.train()
            train_set.set_epoch(epoch)
            loss_sum = hits = seen = 0.0
            start = time.perf_counter()
            bar = tqdm(loader, total=len(train_set), disable=not config.progress,
                       desc=f"bc epoch {epoch}/{config.epochs}", unit="batch", leave=False)
            for obs, actions in bar:
                for group in optimizer.param_groups:
                    group["lr"] = config.lr * _lr_factor(config.lr_schedule, step, total_steps)
                obs = random_shift(obs, config.augment_shift, generator).to(device)
                actions = actions.to(device)
                with _autocast(device, amp):
                    logits = model.get_logits(obs).float()
                loss = bc_loss(logits, actions, mask, label_smoothing=config.label_smoothing,
                               class_weights=class_weights)
                if not torch.isfinite(loss):
                    raise _diverged(f"the BC loss became {float(loss.detach())}", epoch,
                                    best["epoch"], path)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # max_grad_norm 0 means no clipping: an infinite bound scales by 1 and
                # still measures the norm, so a NaN or inf gradient never reaches the weights.
                grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm or math.inf)
                if not torch.isfinite(grad_norm):
                    raise _diverged(f"a BC gradient became {float(grad_norm)}", epoch,
                                    best["epoch"], path)
                optimizer.step()
                step += 1
                n = len(actions)
                samples += n
                seen += n
                loss_sum += float(loss.detach()) * n
                hits += float((model.masked_logits(logits, mask).argmax(-1) == actions).sum())
                bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{hits / seen:.3f}")
            bar.close()
            elapsed = time.perf_counter() - start
            record = {"epoch": epoch, "bc/train_loss": loss_sum / seen,
                      "bc/train_accuracy": hits / seen,
                      "bc/lr": optimizer.param_groups[0]["lr"],
                      "bc/samples_per_second": seen / elapsed}
            if val_set is not None:
                val = evaluate_bc(model, val_set, mask, device)
                record |= {"bc/val_loss": val["loss"], "bc/val_accuracy": val["accuracy"]}
                record |= {f"bc/val_accuracy/{m}": a
                           for m, a in zip(meanings, val["per_action"], strict=True)}
                improved = val["loss"] < best["loss"]
            else:
                improved = True
            log.log(step, record)
            history.append(record)
            message = (f"epoch {epoch}: train loss {record['bc/train_loss']:.4f} acc "
                       f"{record['bc/train_accuracy']:.3f}")
            if val_set is not None:
                message += (f" | val loss {record['bc/val_loss']:.4f} acc "
                            f"{record['bc/val_accuracy']:.3f}")
            if improved:
                best = {"loss": record.get("bc/val_loss", record["bc/train_loss"]),
                        "epoch": epoch}
                stale = 0
                _save(path, model, spec, meanings, mask_np, config, epoch, step, samples,
                      record, precision_used)
                message += "  (saved)"
            else:
                stale += 1
            if config.progress:
                tqdm.write(message)
            if config.patience and stale >= config.patience:
                if config.progress:
                    tqdm.write(f"early stop: no better validation loss for {stale} epochs")
                break

    after = model.value_head.state_dict()
    assert all(torch.equal(value_head_before[k], after[k]) for k in after)
    plot_bc_curves(history, run_dir / "bc_curves.png")
    runs.remember_run(run_dir)
    return path


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision for the forward pass when `dtype` is set, else nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _diverged(what: str, epoch: int, best_epoch: int, path: Path) -> OakEmuError:
    kept = (f"epoch {best_epoch}, the best so far, is kept in {path}"
            if best_epoch else f"this run wrote nothing to {path}")
    return OakEmuError(f"{what} at epoch {epoch}; training stopped ({kept}); try a lower --lr")


def _initial_model(config: BCConfig, spec: EnvSpec, meanings: list[str]) -> PPOModel:
    if config.checkpoint is None:
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
    checkpoint = load_checkpoint(config.checkpoint)
    start_spec = EnvSpec.from_dict(checkpoint.env_spec)
    if not start_spec.same_frames_as(spec) or checkpoint.action_meanings != meanings:
        raise OakEmuError(
            f"checkpoint {config.checkpoint} was made for {start_spec.env_id} with another env "
            f"spec than the demo files ({spec.env_id}); use demos recorded with its spec"
        )
    return checkpoint.build_model()


def _save(path: Path, model: PPOModel, spec: EnvSpec, meanings: list[str], mask: np.ndarray,
          config: BCConfig, epoch: int, step: int, samples: int, record: dict,
          precision: str) -> None:
    checkpoint = Checkpoint.from_model(
        model,
        stage="bc",
        action_meanings=meanings,
        action_mask=mask.tolist(),
        env_spec=spec.to_dict(),
        steps={"epochs": epoch, "updates": step, "samples": samples},
        config=dataclasses.asdict(config) | {"demos": list(config.demos),
                                             "precision_used": precision},
        extra={"metrics": {k: float(v) for k, v in record.items()
                           if isinstance(v, float) and math.isfinite(v)}},
    )
    save_checkpoint(path, checkpoint)
