#!/usr/bin/env bash
# Developers, on a GPU machine without a package index: run CUDA test targets one pytest each, within a time budget.
#   bash scripts/gpu_tests.sh BUDGET_S TARGET...     e.g.  bash scripts/gpu_tests.sh 540 \
#       "tests/kernels/test_mamba1_cuda.py -k 'not interpreter'" "tests/engine/test_sampling_engine.py -k cuda"
# Each TARGET (paths and pytest options, quoted as one argument) runs with the time left, verbose, into
# $OUT/tN.log (OUT defaults to /tmp/gpu_tests), each failure's traceback as it happens (scripts/instafail.py: a
# target stopped at its limit still shows why); a target that would start with under 30 s left is skipped.
# Wheels from scripts/device_wheels.sh (.whl/) install once into /tmp/site; TRITON_CACHE_DIR is /tmp/tc, so a
# second call on the same warm machine reuses the first's compiles. A fresh machine spends minutes compiling
# before the first test ends (fla's autotuned kernels most of all): put the tests that matter first.
set -u
T0=$(date +%s); BUDGET=$1; shift
OUT=${OUT:-/tmp/gpu_tests}; mkdir -p "$OUT" /tmp/site /tmp/tc
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
if [ -z "$(ls /tmp/site)" ]; then
  for w in .whl/*.whl; do  # one at a time: a wheel that fails to install does not stop the others
    pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" > /dev/null 2>&1 || echo "wheel failed: $w"
  done
else
  echo "warm machine: /tmp/site kept, $(ls /tmp/tc | wc -l) Triton cache entries"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, fla; print(torch.__version__, triton.__version__, 'fla', fla.__version__)" 2>&1 | tail -1
i=0
for target in "$@"; do
  i=$((i + 1)); left=$(( BUDGET - ($(date +%s) - T0) - 25 ))
  if [ $left -lt 30 ]; then echo "skipped (time): $target"; continue; fi
  eval "timeout $left python -m pytest -v -rfE --tb=short -p no:cacheprovider -p instafail $target" > "$OUT/t$i.log" 2>&1
  echo "== t$i rc $? at $(( $(date +%s) - T0 )) s: $target"
  grep -E "(FAILED|ERROR) " "$OUT/t$i.log" | head -20; grep -E "^E " "$OUT/t$i.log" | sort | uniq -c | sort -rn | head -8
  tail -1 "$OUT/t$i.log"
done
