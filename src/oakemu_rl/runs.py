"""Run directories: each stage writes into one, and the next stage finds its input there.

```
data/runs/<game>/            the default run directory of a game
    bc.pt, calibrated.pt, ppo.pt
    bc_metrics.jsonl, calibrate_metrics.jsonl, ...   one JSON object per line
    tb/<stage>/               TensorBoard event files
    *.png                     plots
data/runs/.last-run          the run directory a stage last wrote to
```

`oakemu bootstrap calibrate` and `oakemu finetune ppo` with no paths use the last run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .errors import OakEmuError
from .fsutil import atomic_write_text

RUNS_ROOT = Path("data/runs")
LAST_RUN = ".last-run"

STAGE_FILES = {"bc": "bc.pt", "calibrate": "calibrated.pt", "ppo": "ppo.pt"}
STAGE_COMMANDS = {
    "bc": "oakemu bootstrap bc DEMOS.h5",
    "calibrate": "oakemu bootstrap calibrate",
    "ppo": "oakemu finetune ppo",
}


def runs_root() -> Path:
    return Path(os.environ.get("OAKEMU_RUNS", RUNS_ROOT))


def default_run_dir(game: str) -> Path:
    return runs_root() / game


def remember_run(run_dir: Path) -> None:
    """Note `run_dir` as the last run, so later stages need no path."""
    with contextlib.suppress(OakEmuError):  # a read-only runs root only loses the shortcut
        atomic_write_text(runs_root() / LAST_RUN, str(run_dir.resolve()) + "\n")


def last_run_dir() -> Path | None:
    marker = runs_root() / LAST_RUN
    try:
        text = marker.read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


def prepare_run_dir(run_dir: str | os.PathLike[str] | None, game: str) -> Path:
    """The run directory a stage writes to, created if needed."""
    path = Path(run_dir) if run_dir is not None else default_run_dir(game)
    if path.exists() and not path.is_dir():
        raise OakEmuError(f"run directory {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OakEmuError(f"cannot create run directory {path}: {error.strerror}") from None
    if not os.access(path, os.W_OK):
        raise OakEmuError(f"run directory {path} is not writable")
    return path


def find_run_dir(run_dir: str | os.PathLike[str] | None, needs: str) -> Path:
    """The run directory to read a stage's input from: the given one, or the last run."""
    if run_dir is not None:
        path = Path(run_dir)
        if not path.is_dir():
            raise OakEmuError(f"run directory {path} does not exist")
        return path
    last = last_run_dir()
    if last is None or not last.is_dir():
        raise OakEmuError(
            f"no run directory yet: make {STAGE_FILES[needs]} with `{STAGE_COMMANDS[needs]}` "
            "first, or pass --run-dir / --checkpoint"
        )
    return last


def stage_input(run_dir: Path, stage: str) -> Path:
    """The checkpoint `stage` wrote in `run_dir`; a clear error says how to make it."""
    path = run_dir / STAGE_FILES[stage]
    if not path.exists():
        raise OakEmuError(
            f"{path} does not exist: make it with `{STAGE_COMMANDS[stage]}` "
            f"(run directory {run_dir}), or pass --checkpoint"
        )
    return path


def stage_source(run_dir: str | os.PathLike[str] | None, checkpoint: str | os.PathLike[str] | None,
                 needs: str) -> tuple[Path, Path]:
    """(the checkpoint a stage starts from, the run directory it writes into): `checkpoint`
    and `run_dir` (default: the checkpoint's folder) when a checkpoint is given, else the
    run directory's output of stage `needs` (default: the last run)."""
    if checkpoint is not None:
        source = Path(checkpoint)
        return source, prepare_run_dir(run_dir or source.parent, "")
    found = find_run_dir(run_dir, needs=needs)
    return stage_input(found, needs), found
