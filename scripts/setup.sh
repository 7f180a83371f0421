#!/usr/bin/env bash
# Create .venv (if missing) and install hybridcache with the given extras into it.
# Usage: bash scripts/setup.sh [EXTRAS]   e.g. bash scripts/setup.sh dev
#
# torch is installed first, and only if .venv has none: left to the resolver, plain "torch" from the public
# index is a CUDA build of several GB. By default this asks for torch==2.13.0 (machines that keep a CPU
# wheel of it locally take that one). A CPU-only machine without such a wheel points pip at PyTorch's CPU
# index: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# A GPU machine wants the CUDA build: TORCH_INDEX_URL=pypi (the public index's default torch).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  case "${TORCH_INDEX_URL:-}" in
    "") .venv/bin/python -m pip install -q "torch==2.13.0" ;;
    pypi) .venv/bin/python -m pip install -q "torch>=2.6" ;;
    *) .venv/bin/python -m pip install -q torch --index-url "$TORCH_INDEX_URL" ;;
  esac
fi
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
