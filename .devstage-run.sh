set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 200 python benchmarks/step_profile.py --model next-1b --steps 30 --out $OUT 2>&1 | grep -v "Writing\|Loading" | tail -75
timeout 200 python benchmarks/gpu_engine.py --dtypes float32 --out $OUT 2>&1 | tail -5
