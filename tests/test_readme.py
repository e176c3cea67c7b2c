"""The README's two set-up commands stay true: CI runs the test command it shows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, re.S)[:2]


def test_readme_opens_with_the_main_job_and_the_test_command() -> None:
    main_job, tests = readme_commands()
    for command in (main_job, tests):
        assert "\n" not in command.strip()
        assert command.startswith("bash scripts/setup.sh && ")
    assert "oakemu" in main_job
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command() -> None:
    _, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci
    assert "set -euo pipefail" in ci  # a failing or empty test run fails CI


def test_readme_shows_the_quick_preset() -> None:
    text = (ROOT / "README.md").read_text()
    command = ".venv/bin/oakemu pipeline run pipelines/pong-quick.toml"
    assert command in text
    assert (ROOT / "pipelines" / "pong-quick.toml").exists()
