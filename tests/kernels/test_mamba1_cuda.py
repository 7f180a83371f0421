"""`CudaBackend.selective_scan` (Mamba1, the torch reference with its geometry read on the device) against
`ReferenceBackend` on batches the engine builds: fresh, continuing and decode sequences mixed, an all-decode step (its
graph-safe path, a fresh one-token prompt among the rows), one sequence (the path a whole-step graph captures), and
that path on a bucket of rows with NaN padding and the capture's host lengths.

- CPU: the CUDA backend's paths on CPU tensors (they are torch ops).
- `test_cuda_*` (skipped without CUDA): the same on the GPU, fp32 and bf16 inputs.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hybridcache.kernels.attention.reference_backend import ReferenceAttention
from hybridcache.kernels.backend import ReferenceBackend
from tests.kernels.test_mamba2_cuda import CASES, NUM_SLOTS, engine_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CHANNELS, STATE, TOL = 24, 16, {"rtol": 1e-5, "atol": 1e-5}
PARAMETERS = ("A_log", "dt_bias", "D")


def scan_inputs(tokens: int, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, to: torch.dtype = dtype) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(device, to)

    return {"x": rand(tokens, CHANNELS), "dt": rand(tokens, CHANNELS), "B": rand(tokens, STATE),
            "C": rand(tokens, STATE), "A_log": torch.empty(CHANNELS, STATE).uniform_(0.05, 2.0, generator=g).log()
            .to(device), "dt_bias": rand(CHANNELS, scale=0.5, to=torch.float32), "D": rand(CHANNELS, to=torch.float32),
            "z": rand(tokens, CHANNELS)}


def pool(device: str) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, CHANNELS, STATE, generator=torch.Generator().manual_seed(1)).to(device)


def compare_scans(backend, device: str, dtype: torch.dtype, case, tol: dict) -> None:
    raw = engine_batch(*case, device=device)
    inputs = scan_inputs(raw.input_ids.shape[0], device, dtype)
    ssm, ssm_ref = pool(device), pool(device)
    got = backend.selective_scan(**inputs, ssm_layer=ssm, batch=backend.prepare(raw))
    want = ReferenceBackend().selective_scan(**inputs, ssm_layer=ssm_ref, batch=ReferenceBackend().prepare(raw))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(ssm, ssm_ref, **tol)  # every slot, the untouched ones included
    assert not torch.equal(ssm, pool(device))


def compare_padded_bucket(backend, device: str, case, tol: dict) -> None:
    """As a whole-step graph runs a one-sequence step (`prefill_graphs.SequenceGraphs`): the rows of a bucket bigger
    than the sequence, the padding rows NaN (unwritten conv output), the host lengths those of the capture; the real
    rows' outputs and the state equal the reference's on the real step, the padding rows' outputs are finite."""
    bucket = 256
    raw = engine_batch(*case, device=device)
    rows = raw.input_ids.shape[0]
    inputs = scan_inputs(rows, device, torch.float32)
    padded = {name: t if name in PARAMETERS else torch.cat([t, torch.full((bucket - rows, *t.shape[1:]),
                                                                          float("nan"), device=device)])
              for name, t in inputs.items()}
    captured = dataclasses.replace(raw, query_lens_cpu=(bucket,), context_lens_cpu=(bucket,))  # (a fresh capture)
    ssm, ssm_ref = pool(device), pool(device)
    got = backend.selective_scan(**padded, ssm_layer=ssm, batch=backend.prepare(captured))
    want = ReferenceBackend().selective_scan(**inputs, ssm_layer=ssm_ref, batch=ReferenceBackend().prepare(raw))
    torch.testing.assert_close(got[:rows], want, **tol)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(ssm, ssm_ref, **tol)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_backend_scan_paths_match_the_reference_on_cpu(case, caplog) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    backend = CudaBackend(ReferenceAttention())
    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_scans(backend, "cpu", torch.float32, case, TOL)
        compare_scans(backend, "cpu", torch.float32, case, TOL)
    said = [r.message for r in caplog.records if r.message.startswith("Mamba1 layers")]
    assert len(said) == 1, said  # one log line, on the first scan only


@pytest.mark.parametrize("case", [CASES["one-fresh"], CASES["one-continuing"]], ids=["fresh", "continuing"])
def test_one_sequence_path_reads_its_geometry_on_the_device(case) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    compare_padded_bucket(CudaBackend(ReferenceAttention()), "cpu", case, TOL)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_backend_selective_scan_matches_the_reference_on_cuda(case, dtype: torch.dtype) -> None:
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention as Attention
    from hybridcache.kernels.cuda_backend import CudaBackend

    compare_scans(CudaBackend(Attention()), "cuda", dtype, case, {"rtol": 1e-4, "atol": 1e-4})


@needs_cuda
def test_cuda_one_sequence_path_reads_its_geometry_on_the_device() -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    compare_padded_bucket(CudaBackend(ReferenceAttention()), "cuda", CASES["one-continuing"],
                          {"rtol": 1e-4, "atol": 1e-4})
