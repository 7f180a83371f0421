#!/usr/bin/env bash
# Developers: fetch the wheels a GPU machine without a package index needs for the CUDA tests and benchmarks
# (fla's kernels, the server and its benchmarks' client, structured output) into .whl/ (git-ignored), for
# CPython 3.12 on x86-64 Linux. (fastapi >= 0.165 imports opentelemetry-api.)
# (llguidance, structured output's fallback compiler, has manylinux_2_31 wheels only from 1.7: glibc 2.31 or newer.)
# On that machine: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    "fla-core>=0.6,<0.7" fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
    annotated-doc opentelemetry-api importlib-metadata zipp anyio sniffio idna httpx httpcore h11 certifi \
    prometheus-client jsonschema jsonschema-specifications referencing rpds-py xgrammar apache-tvm-ffi llguidance \
    einops "$@"
