#!/usr/bin/env bash
# Quickstart 1: install into .venv and run the main job on the built-in model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/hybridcache generate --max-tokens 32 "$@"
