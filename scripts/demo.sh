#!/usr/bin/env bash
# Quickstart 1: install into .venv and run the main job: the prefix-cache benchmark on the built-in model
# (the shipped SWE-agent slice, cache modes none, block-aligned and hybridcache), tables on the terminal, plots in results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh bench
.venv/bin/hybridcache bench "$@"
