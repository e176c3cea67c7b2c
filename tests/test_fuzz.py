"""Mutated demo files and checkpoints through the CLI: success or one clear error line.

A seeded sample of the cases benchmarks/fuzz_inputs.py runs by the thousand (truncated,
flipped and zeroed bytes, wrong dtypes and shapes, missing keys and attributes, other
HDF5, zip and torch files, damaged checkpoint entries, pickle payloads, and Game Boy
inputs: files that are not ROMs, bad header checksums, configs naming RAM outside the
map, save states from another ROM, missing ROMs). Each CLI run is
made in a forked child with a SIGALRM timeout, so a hang or a crash in a C library is
counted instead of stopping the test. Only exit 0, or a non-zero exit with exactly one
"Error: " line and no traceback, are allowed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz_inputs.py"
_spec = importlib.util.spec_from_file_location("fuzz_inputs", _PATH)
fuzz_inputs = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_inputs"] = fuzz_inputs  # dataclasses look their module up
_spec.loader.exec_module(fuzz_inputs)

CASES = 150


def test_mutated_inputs_give_success_or_one_clear_error(tmp_path) -> None:
    report = fuzz_inputs.fuzz(CASES, seed=20240, workdir=tmp_path, timeout=60.0,
                              heavy_share=0.05)
    print(fuzz_inputs.format_report(report))
    assert report.files == CASES
    every_kind = ({f"demo:{k}" for k in fuzz_inputs.DEMO_KINDS}
                  | {f"checkpoint:{k}" for k in fuzz_inputs.CKPT_KINDS}
                  | {f"gameboy:{k}" for k in fuzz_inputs.GB_KINDS})
    assert set(report.by_kind) == every_kind
    assert report.failures == [], fuzz_inputs.format_report(report)


def test_the_classifier() -> None:
    classify = fuzz_inputs.classify
    assert classify(0, None, "ok\n", "")[0] == "ok"
    assert classify(1, SystemExit(1), "note\nError: bad file\n", "Error: bad file\n")[0] == \
        "error"
    assert classify(1, SystemExit(1), "Error: a\nError: b\n", "Error: a\nError: b\n")[0] == \
        "bad-error"
    assert classify(1, SystemExit(1), "something broke\n", "something broke\n")[0] == \
        "bad-error"
    assert classify(1, KeyError("x"), "", "")[0] == "traceback"
