#!/usr/bin/env bash
# Clone this repository (its committed HEAD) into an empty temporary folder with no siblings and run
# Quickstart 1 (scripts/demo.sh) there, to its result table: proves that a fresh clone needs nothing outside
# itself. Prints how long Quickstart 1 took. Usage: bash scripts/fresh_clone_check.sh [bench args...]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/clone"
cd "$work/clone"
start=$(date +%s)
HYBRIDCACHE_HOME="$work/home" bash scripts/demo.sh --no-progress "$@"
echo "quickstart 1 took $(( $(date +%s) - start )) s (install included)"
