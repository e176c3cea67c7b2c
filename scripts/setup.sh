#!/usr/bin/env bash
# Set-up on a fresh machine: a virtualenv in .venv with OakEmu-RL and the pinned versions
# of everything it needs (constraints.txt). Safe to re-run; fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt -e '.[dev]'
