"""The h5py-only example in docs/demo-format.md writes a file our reader accepts."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from oakemu_rl.demos import validate_demo_file

DOC = Path(__file__).resolve().parents[1] / "docs" / "demo-format.md"


def test_the_documented_snippet_writes_a_valid_file(tmp_path: Path, monkeypatch) -> None:
    snippet = re.search(r"## Writing a file with h5py alone\n\n```python\n(.+?)```",
                        DOC.read_text(), re.S).group(1)
    assert "oakemu_rl" not in snippet  # h5py and numpy alone
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, str(DOC), "exec"), {})
    with validate_demo_file(tmp_path / "mine.h5") as demo:
        assert [e.length for e in demo.episodes] == [100]
        assert demo.episodes[0].terminated and not demo.episodes[0].truncated
        assert demo.spec.game == "pong" and demo.spec.frame_stack == 4
        assert np.array_equal(demo.observation(0, 0), np.zeros((4, 84, 84), np.uint8))
