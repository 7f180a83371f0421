#!/usr/bin/env bash
# Create .venv (if missing) and install hybridcache with the given extras into it.
# Usage: bash scripts/setup.sh [EXTRAS]   e.g. bash scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch first: left to the resolver, plain "torch" pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
