#!/usr/bin/env bash
# Quickstart 2: install into .venv with the dev extras, lint, and run the default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check .
# Two workers, one per core of the 2-core machine the suite is timed on (pytest-xdist; each file's tests on one
# worker: tests/xdist_scheduling.py). `-n 0` (or later `-n N`) in the arguments overrides it.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
