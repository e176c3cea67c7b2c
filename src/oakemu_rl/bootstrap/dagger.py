"""Relabelling (DAgger) rounds of the bc stage: the clone plays, the scripted player labels.

A clone drifts into states the demonstrator never visits and has no labels for. A round
lets the newest clone play whole games while the scripted demonstrator labels every frame
with the action it would take there; the bc stage then trains a fresh clone on the demos
and every relabelled file so far (`train_bc` with `relabel_episodes`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from ..agents.recording import RecordConfig, record, relabelling_agents
from ..demos import DemoFile
from ..runtime import usable_cpus

if TYPE_CHECKING:
    from .bc import BCConfig


def relabel_round(config: BCConfig, clone: Path, files: list[str], round_: int, *,
                  device: str = "auto", progress: bool = True) -> Path:
    """Round `round_` (from 1): `clone` plays `config.relabel_episodes` games into
    relabelled.h5 (relabelled2.h5, ... for later rounds) beside it; returns that file.
    The curves of the BC this round replaces are kept as bc_first_* (the clone of the
    demos alone) or bc_round{k}_* (the clone after round k)."""
    run_dir = clone.parent
    out = relabelled_path(run_dir, round_)
    if out.exists():  # left by an interrupted run: its clone is gone
        out.unlink()
    seed = _first_seed(config, files, round_)
    labeller, driver, spec = relabelling_agents(clone, style=config.relabel_style, seed=seed,
                                                noise=config.relabel_noise, device=device)
    if progress:
        tqdm.write(f"[bc] relabelling round {round_}/{config.relabel_rounds}: the clone plays "
                   f"{config.relabel_episodes} game(s), the scripted demonstrator labels them")
    record(RecordConfig(out=out, spec=spec, episodes=config.relabel_episodes, seed=seed,
                        progress=progress, workers=config.relabel_workers or usable_cpus()),
           labeller, driver)
    keep = "bc_first_" if round_ == 1 else f"bc_round{round_ - 1}_"
    for name in ("bc_metrics.jsonl", "bc_curves.png"):
        done = run_dir / name
        if done.exists():
            done.replace(run_dir / name.replace("bc_", keep, 1))
    return out


def check_labeller(config: BCConfig, files: list[str]) -> None:
    """Refuse, before any training, relabelling rounds whose scripted labeller does not
    exist for the demos' game or style."""
    if not config.relabel_episodes:
        return
    from ..agents.scripted import make_demonstrator

    with DemoFile(files[0]) as demo:
        make_demonstrator(demo.spec, style=config.relabel_style)


def relabelled_path(run_dir: Path, round_: int) -> Path:
    """The file round `round_` writes: relabelled.h5, relabelled2.h5, ..."""
    return run_dir / f"relabelled{'' if round_ == 1 else round_}.h5"


def _first_seed(config: BCConfig, files: list[str], round_: int) -> int:
    """`relabel_seed` plus the earlier rounds' games, or by default the seed after the last
    game in the files so far, so relabelled games never replay a demonstrated one."""
    if config.relabel_seed is not None:
        return config.relabel_seed + (round_ - 1) * config.relabel_episodes
    seeds = []
    for path in files:
        with DemoFile(path) as demo:
            seeds += [e.seed for e in demo.episodes]
    return int(np.max(seeds)) + 1 if seeds else 0
