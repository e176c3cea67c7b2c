"""Shared test settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests run small models on a small shared machine: one torch thread is faster there
# (two threads contend with the emulator threads) and keeps runs reproducible.
torch.set_num_threads(1)
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")


@pytest.fixture(autouse=True)
def runs_root(tmp_path_factory, monkeypatch) -> Path:
    """No test writes into the project's data/runs (nor reads a user's last run); tests
    that check what a stage remembers read this root."""
    root = tmp_path_factory.mktemp("runs")
    monkeypatch.setenv("OAKEMU_RUNS", str(root))
    return root
