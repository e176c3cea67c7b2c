"""Stage metrics: one JSON object per line beside the checkpoints, and TensorBoard events.

Names follow the usual PPO conventions (`charts/episodic_return`, `losses/approx_kl`, ...).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import OakEmuError
from .fsutil import atomic_write_text


class MetricsLogger:
    """Appends `{"step": ..., name: value, ...}` records to `<run_dir>/<stage>_metrics.jsonl`
    and mirrors scalars to TensorBoard under `<run_dir>/tb/<stage>`."""

    def __init__(self, run_dir: Path, stage: str, *, tensorboard: bool = True,
                 resume_after: int | None = None) -> None:
        """A fresh log, or with `resume_after` the existing one continued from that step:
        records after it (written past the checkpoint a run resumes from) are dropped."""
        self.path = Path(run_dir) / f"{stage}_metrics.jsonl"
        if resume_after is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_after]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        try:
            mode = "w" if resume_after is None else "a"
            self._file = open(self.path, mode, buffering=1)  # noqa: SIM115
        except OSError as error:
            raise OakEmuError(f"cannot write metrics to {self.path}: {error.strerror}") from None
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resume_after is None else resume_after + 1
                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb" / stage),
                                         purge_step=purge)
            except ImportError:  # tensorboard is optional at run time
                self._tb = None

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": int(step)}
        for key, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                record[key] = None if math.isnan(value) else str(value)
            else:
                record[key] = value
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics file (a line cut by a kill is skipped)."""
    records = []
    with open(path) as handle:
        for line in handle:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records
