"""`CudaBackend`'s Mamba2 ops (`ssd_scan`, `gated_group_rms_norm`, and the shared `causal_conv1d` at Mamba2's
widths) against `ReferenceBackend` on batches the engine builds: fresh, continuing and decode sequences mixed, and an
all-decode step (its graph-safe path, fresh one-token prompts among the rows). The scan's code runs on any device, so
the CPU half checks `CudaBackend.ssd_scan`'s own paths on CPU tensors; the CUDA half (skipped without CUDA) runs every
op on the GPU, the conv on its Triton kernels."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.attention.reference_backend import ReferenceAttention
from hybridcache.kernels.backend import ReferenceBackend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NUM_SLOTS = 8
BLOCK = 64
HEADS, HEAD_DIM, GROUPS, STATE = 8, 16, 2, 32

MIXED = ([(0, 70), (130, 1), (37, 200), (0, 1), (63, 65), (5, 1)], [4, 0, 2, 5, 7, 1])
DECODE = ([(130, 1), (0, 1), (63, 1), (200, 1)], [3, 6, 0, 1])  # one fresh 1-token prompt among them
FRESH = ([(0, 150)], [3])  # one sequence: the path a whole-step graph captures
CONTINUING = ([(37, 90)], [5])
CASES = {"mixed": MIXED, "decode": DECODE, "one-fresh": FRESH, "one-continuing": CONTINUING}


def engine_batch(lengths: list[tuple[int, int]], slots: list[int], device: str):
    """(tokens cached before, new tokens) per sequence; blocks handed out in reverse order."""
    chunks, next_block = [], 40
    for (start, num), slot in zip(lengths, slots, strict=True):
        blocks = -(-(start + num) // BLOCK)
        chunks.append(SeqChunk([1] * num, start, list(range(next_block, next_block - blocks, -1)), slot))
        next_block -= blocks
    return build_forward_batch(chunks, block_size=BLOCK, kernel_block_size=BLOCK // 4, device=device)


def scan_inputs(tokens: int, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, to: torch.dtype = dtype) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(device, to)

    return {"x": rand(tokens, HEADS, HEAD_DIM), "dt": rand(tokens, HEADS), "B": rand(tokens, GROUPS, STATE),
            "C": rand(tokens, GROUPS, STATE), "A_log": torch.rand(HEADS, generator=g).log().to(device),
            "dt_bias": rand(HEADS, scale=0.5, to=torch.float32), "D": rand(HEADS, to=torch.float32)}


def compare_scans(fast_backend, device: str, dtype: torch.dtype, case, tol: dict) -> None:
    raw = engine_batch(*case, device=device)
    fast, slow = fast_backend.prepare(raw), ReferenceBackend().prepare(raw)
    inputs = scan_inputs(raw.input_ids.shape[0], device, dtype)
    ssm = torch.randn(NUM_SLOTS, HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(1)).to(device)
    ssm_ref = ssm.clone()
    for limit in ((0.0, float("inf")), (0.01, 2.0)):
        got = fast_backend.ssd_scan(**inputs, ssm_layer=ssm, batch=fast, dt_limit=limit)
        want = ReferenceBackend().ssd_scan(**inputs, ssm_layer=ssm_ref, batch=slow, dt_limit=limit)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(ssm, ssm_ref, **tol)  # every slot, the untouched ones included


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_backend_scan_paths_match_the_reference_on_cpu(case, caplog) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    backend = CudaBackend(ReferenceAttention())
    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_scans(backend, "cpu", torch.float32, case, {"rtol": 1e-5, "atol": 1e-5})
    said = [r.message for r in caplog.records if "reference scan" in r.message]
    assert len(said) == 1, said  # one log line, on the first scan only


@pytest.mark.parametrize("case", [FRESH, CONTINUING], ids=["fresh", "continuing"])
def test_one_sequence_scan_reads_its_geometry_on_the_device(case) -> None:
    """As a whole-step graph runs it (`prefill_graphs.SequenceGraphs`): the rows of a bucket bigger than the
    sequence, the padding rows NaN (unwritten conv output), the host lengths those of the capture; the real rows'
    outputs and the state equal the reference's on the real step, and the padding rows' outputs are finite."""
    from hybridcache.kernels.cuda_backend import CudaBackend

    backend, bucket = CudaBackend(ReferenceAttention()), 256
    raw = engine_batch(*case, device="cpu")
    rows = raw.input_ids.shape[0]
    inputs = scan_inputs(rows, "cpu", torch.float32)
    padded = {name: torch.cat([t, torch.full((bucket - rows, *t.shape[1:]), float("nan"))])
              if t.shape[0] == rows and name not in ("A_log", "dt_bias", "D") else t for name, t in inputs.items()}
    captured = dataclasses.replace(raw, query_lens_cpu=(bucket,), context_lens_cpu=(bucket,))  # (a fresh capture)
    ssm = torch.randn(NUM_SLOTS, HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(1))
    ssm_ref = ssm.clone()
    limit = (0.0, float("inf"))
    got = backend.ssd_scan(**padded, ssm_layer=ssm, batch=backend.prepare(captured), dt_limit=limit)
    want = ReferenceBackend().ssd_scan(**inputs, ssm_layer=ssm_ref, batch=ReferenceBackend().prepare(raw),
                                       dt_limit=limit)
    torch.testing.assert_close(got[:rows], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, ssm_ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got[rows:]).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_backend_mamba2_ops_match_the_reference_on_cuda(case, dtype: torch.dtype) -> None:
    from hybridcache.kernels.backend import get_backend

    backend = get_backend("cuda")
    assert type(backend).__name__ == "CudaBackend"
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    compare_scans(backend, "cuda", dtype, case, tol)
    raw = engine_batch(*case, device="cuda")
    fast, slow = backend.prepare(raw), ReferenceBackend().prepare(raw)
    g = torch.Generator().manual_seed(2)
    channels = HEADS * HEAD_DIM + 2 * GROUPS * STATE  # the conv over x | B | C, with its bias
    x = torch.randn(raw.input_ids.shape[0], channels, generator=g).to("cuda", dtype)
    weight, bias = (0.5 * torch.randn(channels, 4, generator=g)).to("cuda", dtype), torch.randn(channels).to("cuda")
    conv = torch.randn(NUM_SLOTS, channels, 3, generator=g).to("cuda", dtype)
    conv_ref = conv.clone()
    torch.testing.assert_close(backend.causal_conv1d(x, weight, bias.to(dtype), conv, fast),
                               ReferenceBackend().causal_conv1d(x, weight, bias.to(dtype), conv_ref, slow), **tol)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    y, z = x[:, : HEADS * HEAD_DIM], x[:, -HEADS * HEAD_DIM:]
    norm_weight = torch.randn(HEADS * HEAD_DIM, generator=g).to("cuda", dtype)
    torch.testing.assert_close(backend.gated_group_rms_norm(y, z, norm_weight, 1e-5, HEADS * HEAD_DIM // GROUPS),
                               ReferenceBackend.gated_group_rms_norm(y, z, norm_weight, 1e-5,
                                                                     HEADS * HEAD_DIM // GROUPS), **tol)
