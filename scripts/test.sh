#!/usr/bin/env bash
# Quickstart 2: install into .venv with the dev extras, lint, and run the default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
