"""Piecewise prefill graphs (`engine/prefill_graphs.py`) with FP8 weights (and FP8 KV): the split forward (pieces on
the bucket's padded rows, the cores on the step's real rows) against the unsplit forward on the CPU, fp32, as
tests/engine/test_prefill_graphs.py does for dense weights. The FP8 linears and experts sit in the pieces, the
FP8 KV write and read in the attention cores."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.prefill_graphs import PrefillGraphs
from hybridcache.engine.runner import ModelRunner
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.layers.linear import Fp8Linear
from hybridcache.models import load_model

from .model_folders import write_tiny_model
from .test_decode_graphs import runner_state_pages
from .test_prefill_graphs import BLOCK, PAGE, split_and_unsplit, steps


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_split_forward_equals_unsplit_with_fp8_weights(tmp_path, kv_fp8):
    """Steps 1-2 fit their buckets exactly: bit-identical logits and pools; step 3 runs with 37 padding rows: the
    same within fp32 rounding and the same greedy tokens (a padding row leaking into a real row, or into the FP8
    KV pool, would differ by O(1))."""
    device = torch.device("cpu")
    model = load_model(write_tiny_model(tmp_path, "qwen3_next"), device=device, quantization="fp8", kv_fp8=kv_fp8)
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    runner = ModelRunner(model, num_blocks=40, block_size=BLOCK, kernel_block_size=PAGE, num_slots=4,
                         state_pages=runner_state_pages(model), dtype=torch.float32, state_dtype=torch.float32,
                         device=device, backend=ReferenceBackend(), max_model_len=400)
    assert (runner.pools.kv_groups[0].dtype == torch.float8_e4m3fn) == kv_fp8
    runner._prefill = PrefillGraphs(runner.model, runner.backend, runner.pools, (41, 190, 256), device)
    for index, (want, got, unsplit_pools, split_pools) in enumerate(split_and_unsplit(runner, (41, 190, 256),
                                                                                      replay=False)):
        assert got.shape == want.shape == (len(steps(device)[index].query_lens_cpu), 320)
        if index < 2:
            assert torch.equal(got, want), index
            assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(unsplit_pools, split_pools)), index
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            for a, b in zip(unsplit_pools, split_pools):
                torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5)
