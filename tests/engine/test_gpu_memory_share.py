"""`gpu_memory_utilization` on CUDA is the engine's own share of the device (vLLM's meaning), whatever another
process holds: with half of the free memory held elsewhere, an engine asking for 80 % of what is left starts
(counting the other process against it, as the engine once did, left nothing for the cache) and holds no more than
its share; one asking for 120 % of it is refused before loading, naming the numbers. The arithmetic is
`test_memory.py`'s."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hybridcache import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_share_ignores_another_process_and_is_kept():
    free, total = torch.cuda.mem_get_info()
    held = free // 2
    # the holder lives until its stdin closes: killed with this test's process too, it does not outlive it
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, torch; x = torch.empty({held}, dtype=torch.uint8, device='cuda'); "
         "print('held', flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        left = torch.cuda.mem_get_info()[0]
        options = dict(device="cuda", enforce_eager=True, max_num_seqs=4, max_model_len=1024)
        utilization = 0.8 * left / total
        with LLM(gpu_memory_utilization=utilization, **options) as llm:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            out = llm.generate(["hello world", "the cache"], params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
            ours = left - torch.cuda.mem_get_info()[0]
            assert llm.engine.memory_plan.budget_bytes > 0 and ours <= utilization * total, (ours, utilization)
        with pytest.raises(ValueError, match=r"gpu_memory_utilization .* GiB were free when the engine started"):
            LLM(gpu_memory_utilization=min(1.0, 1.2 * left / total), **options)
    finally:
        holder.kill()
        holder.wait()
