"""PNG plots a person opens beside the metrics. Written atomically, headless (Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .fsutil import atomic_write


def _figure(ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    return plt, fig, axes[0]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_write(path) as handle:
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)
    return path


def plot_bc_curves(records: Sequence[dict], path: Path) -> Path:
    """Train/validation loss and accuracy per epoch."""
    plt, fig, (loss_ax, acc_ax) = _figure(2)
    epochs = [r["epoch"] for r in records]
    for key, label in (("bc/train_loss", "train"), ("bc/val_loss", "validation")):
        values = [r.get(key) for r in records]
        if any(v is not None for v in values):
            loss_ax.plot(epochs, [np.nan if v is None else v for v in values], "o-", label=label)
    for key, label in (("bc/train_accuracy", "train"), ("bc/val_accuracy", "validation")):
        values = [r.get(key) for r in records]
        if any(v is not None for v in values):
            acc_ax.plot(epochs, [np.nan if v is None else v for v in values], "o-", label=label)
    loss_ax.set(xlabel="epoch", ylabel="cross-entropy", title="BC loss")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="BC accuracy", ylim=(0, 1))
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, path)


def plot_value_scatter(predicted: np.ndarray, target: np.ndarray, explained: float,
                       path: Path) -> Path:
    """Predicted value against return target on held-out states."""
    plt, fig, (ax,) = _figure(1)
    ax.scatter(target, predicted, s=4, alpha=0.3)
    lo = float(min(np.min(target), np.min(predicted)))
    hi = float(max(np.max(target), np.max(predicted)))
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = return")
    ax.set(xlabel="return target", ylabel="predicted value",
           title=f"critic calibration (explained variance {explained:.3f})")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_learning_curve(series: dict[str, Sequence[tuple[float, float]]], path: Path, *,
                        title: str = "PPO learning curve") -> Path:
    """Game score against agent steps; each series has its own (step, score) points."""
    plt, fig, (ax,) = _figure(1)
    for label, points in series.items():
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3, label=label)
    ax.set(xlabel="agent steps", ylabel="game score", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)
