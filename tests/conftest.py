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
def rom_store(tmp_path_factory, monkeypatch) -> Path:
    """Game Boy ROMs and save states a test adds go to a fresh store, never the user's."""
    root = tmp_path_factory.mktemp("roms")
    monkeypatch.setenv("OAKEMU_ROM_DIR", str(root))
    return root


@pytest.fixture(autouse=True)
def runs_root(tmp_path_factory, monkeypatch) -> Path:
    """No test writes into the project's data/runs (nor reads a user's last run); tests
    that check what a stage remembers read this root."""
    root = tmp_path_factory.mktemp("runs")
    monkeypatch.setenv("OAKEMU_RUNS", str(root))
    return root


@pytest.fixture
def checkpoint_file(tmp_path):
    """`checkpoint_file(name="agent.pt", spec=None, **options)`: a checkpoint written by
    `builders.write_checkpoint` in the test's temporary directory."""
    from builders import write_checkpoint

    def make(name: str = "agent.pt", spec=None, **options) -> Path:
        return write_checkpoint(tmp_path / name, spec, **options)

    return make


@pytest.fixture
def scripted_demos(tmp_path):
    """`scripted_demos(name="demos.h5", spec=None, **options)`: a demo file recorded by the
    scripted demonstrator (`builders.record_scripted`)."""
    from builders import record_scripted

    def make(name: str = "demos.h5", spec=None, **options) -> Path:
        return record_scripted(tmp_path / name, spec, **options)

    return make
