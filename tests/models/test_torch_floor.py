"""The package runs on the oldest torch its metadata accepts (torch >= 2.6): loading a model read
`torch.float8_e8m0fnu` (new in torch 2.7) for every parameter, so no model loaded on torch 2.6 (hunt 182). Checked by
running the built-in model in a process whose torch lacks that dtype."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybridcache.models.builtin import ensure_builtin_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import torch
import torch._inductor.utils  # (torch's own modules read the dtype at import)
from hybridcache import LLM, SamplingParams
import hybridcache.models.loader
del torch.float8_e8m0fnu  # as torch 2.6
llm = LLM(device="cpu", dtype="float32")
out = llm.generate(["the cache"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print(len(out[0].outputs[0].token_ids))
llm.close()
"""


def test_a_model_loads_without_torch_2_7s_e8m0_dtype():
    ensure_builtin_model()
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "4"
