"""SIGKILL every stage of the real CLI once, at a seeded random moment, and check that
nothing is lost: the fast version of benchmarks/kill_harness.py (same code, smaller runs).

Each stage is a real `python -m oakemu_rl` subprocess started with `subprocess.Popen`; the
harness waits for its progress bar (for ppo: for a fresh ppo_last.pt too), sleeps a
seeded random delay and sends SIGKILL. Then every output file must load, the demo file
keeps every committed episode and takes new ones, `--resume` finishes PPO from the saved
step with every update logged once, and a pipeline re-run skips finished stages and
completes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "kill_harness.py"
_spec = importlib.util.spec_from_file_location("kill_harness", _PATH)
kill_harness = importlib.util.module_from_spec(_spec)
sys.modules["kill_harness"] = kill_harness  # dataclasses look their module up
_spec.loader.exec_module(kill_harness)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return kill_harness.Harness(tmp_path_factory.mktemp("kills"), seed=0,
                                budget=kill_harness.QUICK, say=lambda row: None)


@pytest.mark.parametrize("stage", kill_harness.STAGES)
def test_a_kill_loses_nothing(harness, stage) -> None:
    report = getattr(harness, stage)(1)
    print(kill_harness.format_row(report))
    for note in report.notes:
        print(f"  {note}")
    assert report.problems == []
    assert report.kills >= 1
    assert report.files_checked > 0
