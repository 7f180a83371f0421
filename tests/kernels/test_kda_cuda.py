"""`CudaBackend.gated_delta_rule` with a per-channel decay g [T, H, K] (Kimi Delta Attention) against
`ReferenceBackend` on batches the engine builds: fresh and continuing sequences, 1-token prompts, decode rows mixed
in, leading decode rows before prefill chunks (`fla.mixed_gated_delta_rule`), all-decode steps (the step kernel's
per-channel decay), and a one-sequence step padded to a bucket (a whole-step graph). Every state row is random
before the step, so a fresh sequence that read its row would show.

- CPU: CudaBackend on CPU tensors takes the torch reference (fla is Triton on CUDA), and `kda_kernels=False`
  takes it even where the kernels would run.
- `test_interpreted_*`: fla 0.6's chunked KDA forward (`chunk_kda_fwd`) and our step kernel on CPU tensors under
  TRITON_INTERPRET=1, in a child process (`test_kda_kernels_in_a_triton_interpreter_subprocess`), fp32 only;
  skipped where fla is not importable. fla's autotuned kernels keep one config each (the interpreter has no
  benchmarker) and its state kernel's loop counter gets the `.to` it calls (`fla_kda_interpreted`).
- `test_cuda_*` (skipped without CUDA): the same on the GPU, fp32 (IEEE dots: `TRITON_F32_DEFAULT=ieee`, fla's
  solve set to IEEE by `fla_kda_forward`) elementwise, bf16 by the error's norm against the output's (fla keeps its
  chunk's Aqk / Akk matrices in the inputs' dtype), at the tests' widths and Kimi-Linear-48B's (32 heads of 128).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F

from hybridcache.kernels.attention.reference_backend import ReferenceAttention
from hybridcache.kernels.backend import ReferenceBackend
from tests.kernels.interpreter import interpreted_in_child, needs_interpreter
from tests.kernels.test_mamba2_cuda import NUM_SLOTS, assert_near, engine_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
HEADS, K_DIM, V_DIM = 2, 16, 16

# (tokens cached before, new tokens) per sequence, and its state slot
MIXED = ([(0, 70), (130, 1), (37, 40), (0, 1), (63, 5), (5, 1)], [4, 0, 2, 5, 7, 1])
DECODE = ([(130, 1), (0, 1), (63, 1), (200, 1)], [3, 6, 0, 1])  # a fresh 1-token prompt among them
LEADING = ([(130, 1), (0, 1), (37, 70), (0, 1), (63, 5)], [3, 6, 0, 1, 5])  # two decode rows first
FRESH = ([(0, 80)], [3])
CONTINUING = ([(37, 70)], [5])
CASES = {"mixed": MIXED, "decode": DECODE, "leading-decodes": LEADING, "one-fresh": FRESH,
         "one-continuing": CONTINUING}
INTERPRETED_TOL = {"rtol": 1e-4, "atol": 1e-4}  # fp32: the interpreter's dots are numpy's fp32 products
CUDA_TOL = {torch.float32: {"rtol": 1e-3, "atol": 1e-3}, torch.bfloat16: {"ratio": 2e-2}}


def kda_inputs(tokens: int, device: str, dtype: torch.dtype, heads: int = HEADS, dims: tuple[int, int] = (K_DIM, V_DIM),
               seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v in `dtype`; g as Kimi's gate makes it, -exp(A_log) softplus(x) [T, H, K] fp32 with exp(A_log) in
    1 .. 16 (decays down to e^-50 a token: a chunk's cumulated decay far past fp32's exp range); beta in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    k_dim, v_dim = dims
    rate = torch.linspace(1.0, 16.0, heads)[None, :, None]
    return {"q": torch.randn(tokens, heads, k_dim, generator=g).to(device, dtype),
            "k": torch.randn(tokens, heads, k_dim, generator=g).to(device, dtype),
            "v": torch.randn(tokens, heads, v_dim, generator=g).to(device, dtype),
            "g": (-rate * F.softplus(torch.randn(tokens, heads, k_dim, generator=g))).to(device),
            "beta": torch.rand(tokens, heads, generator=g).to(device, dtype)}


def random_pool(device: str, heads: int = HEADS, dims: tuple[int, int] = (K_DIM, V_DIM)) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, heads, *dims, generator=torch.Generator().manual_seed(1)).to(device)


def compare_rules(backend, device: str, dtype: torch.dtype, case, tol: dict, heads: int = HEADS,
                  dims: tuple[int, int] = (K_DIM, V_DIM)) -> None:
    """Two steps of the case (the second continues every sequence from the first's states) against the reference:
    outputs and every state row, the untouched ones included."""
    raw = engine_batch(*case, device=device)
    pool = random_pool(device, heads, dims)
    pool_ref = pool.clone()
    for seed in (0, 1):
        inputs = kda_inputs(raw.input_ids.shape[0], device, dtype, heads, dims, seed)
        got = backend.gated_delta_rule(**inputs, ssm_layer=pool, batch=backend.prepare(raw))
        want = ReferenceBackend().gated_delta_rule(**inputs, ssm_layer=pool_ref, batch=ReferenceBackend().prepare(raw))
        assert got.dtype == dtype
        assert_near(got, want, tol)
        assert_near(pool, pool_ref, tol)
        lens = [(start + num, num) for start, num in case[0]]  # the next step continues every sequence
        raw = engine_batch(lens, case[1], device=device)


def compare_padded_bucket(backend, device: str, case, tol: dict) -> None:
    """A one-sequence step as a whole-step graph runs it (`prefill_graphs.SequenceGraphs`): the rows of a bucket
    bigger than the sequence, the padding rows NaN, the host lengths those of the capture; the real rows' outputs
    and the state equal the reference's on the real step."""
    bucket = 128
    raw = engine_batch(*case, device=device)
    rows = raw.input_ids.shape[0]
    inputs = kda_inputs(rows, device, torch.float32)
    padded = {name: torch.cat([t, torch.full((bucket - rows, *t.shape[1:]), float("nan"), device=device)])
              for name, t in inputs.items()}
    captured = dataclasses.replace(raw, query_lens_cpu=(bucket,), context_lens_cpu=(bucket,))  # (a fresh capture)
    pool = random_pool(device)
    pool_ref = pool.clone()
    got = backend.gated_delta_rule(**padded, ssm_layer=pool, batch=backend.prepare(captured))
    want = ReferenceBackend().gated_delta_rule(**inputs, ssm_layer=pool_ref, batch=ReferenceBackend().prepare(raw))
    torch.testing.assert_close(got[:rows], want, **tol)
    torch.testing.assert_close(pool, pool_ref, **tol)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_backend_kda_on_cpu_tensors_takes_the_reference(case, caplog) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_rules(CudaBackend(ReferenceAttention()), "cpu", torch.float32, case, {"rtol": 1e-5, "atol": 1e-5})
    said = [r.message for r in caplog.records if r.message.startswith("Kimi Delta Attention")]
    assert said == ["Kimi Delta Attention layers run the torch reference of the per-channel gated delta rule"]


def test_kda_kernels_off_keeps_the_torch_reference_where_the_kernels_would_run(monkeypatch, caplog) -> None:
    """`kda_kernels=False` with fla 'running' on CPU tensors: the reference still runs (the kernels cannot run on
    CPU tensors outside the interpreter, so taking them would fail here)."""
    from hybridcache.kernels import cuda_backend
    from hybridcache.kernels.gated_delta import fla as delta_fla

    monkeypatch.setattr(delta_fla, "runs_on", lambda x: True)
    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_rules(cuda_backend.CudaBackend(ReferenceAttention(), kda_kernels=False), "cpu", torch.float32, MIXED,
                      {"rtol": 1e-5, "atol": 1e-5})
    assert any("torch reference" in r.message for r in caplog.records)


def test_kda_kernels_off_forbids_one_sequence_steps_on_padded_rows() -> None:
    """Whole-step prefill graphs (`prefill_graphs.SequenceGraphs`) run a one-sequence step on a bucket of rows and
    tell the layers it is fresh, trusting the kernels to read the real length and freshness on the device. The
    torch reference of the per-channel rule reads the host's (hunt 226: a prefix hit or a later chunk started from
    zeros, and the padding rows ran through the recurrence), so `kda_kernels=False` must not allow them."""
    from hybridcache.kernels.cuda_backend import CudaBackend

    class GraphSafe(ReferenceAttention):
        graph_safe = True

    assert CudaBackend(GraphSafe()).masks_padding_rows
    assert not CudaBackend(GraphSafe(), kda_kernels=False).masks_padding_rows
    assert not CudaBackend(ReferenceAttention()).masks_padding_rows


@pytest.fixture
def fla_kda_interpreted(monkeypatch):
    """fla's KDA kernels and our step kernel on CPU tensors under the interpreter: `runs_on` says yes, the torch
    fallback raises (so every case takes the kernels), each autotuned kernel of the KDA forward keeps one config
    (the interpreter has no benchmarker to tune with), and the state kernel's `range` yields Triton scalars (it
    calls `.to(tl.int64)` on its loop counter; the interpreter's own `range` yields Python ints). Yields the list of
    the mixed steps' leading decode counts."""
    import triton
    import triton.language as tl

    from hybridcache.kernels import cuda_backend
    from hybridcache.kernels.gated_delta import fla as delta_fla

    monkeypatch.setattr(delta_fla, "runs_on", lambda x: True)

    def no_fallback(*args, **kwargs):
        raise AssertionError("the torch reference ran where the kernels should")

    monkeypatch.setattr(cuda_backend, "per_channel_delta_scan", no_fallback)
    leads = []
    mixed = cuda_backend.mixed_gated_delta_rule

    def counted(*args, **kwargs):
        leads.append(args[8].count)
        return mixed(*args, **kwargs)

    monkeypatch.setattr(cuda_backend, "mixed_gated_delta_rule", counted)
    for name in ("fla.ops.utils.cumsum", "fla.ops.kda.chunk_intra", "fla.ops.kda.chunk_intra_token_parallel",
                 "fla.ops.kda.wy_fast", "fla.ops.common.chunk_delta_h", "fla.ops.gla.chunk"):
        for kernel in list(vars(importlib.import_module(name)).values()):
            while kernel is not None and not isinstance(kernel, triton.runtime.Autotuner):
                kernel = getattr(kernel, "fn", None) if isinstance(kernel, triton.runtime.KernelInterface) else None
            if kernel is not None:
                monkeypatch.setattr(kernel, "configs", kernel.configs[-1:])

    def scalar_range(*bounds):
        for i in range(*(int(b) for b in bounds)):
            yield tl.full([], i, tl.int32)

    monkeypatch.setattr(importlib.import_module("fla.ops.common.chunk_delta_h"), "range", scalar_range, raising=False)
    return leads


@pytest.mark.slow  # ~100 s on two shared cores (fla's token-parallel kernel interprets a program per row)
@needs_fla
@interpreted_in_child("test_interpreted_")
def test_kda_kernels_in_a_triton_interpreter_subprocess() -> None:
    """Runs this file's `test_interpreted_*` tests under TRITON_INTERPRET=1 (see tests/kernels/interpreter.py)."""


# exp2 of the decay between a later and an earlier token, above the causal diagonal, overflows before it is masked
OVERFLOW_ABOVE_THE_DIAGONAL = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@needs_interpreter
@needs_fla
@OVERFLOW_ABOVE_THE_DIAGONAL
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_interpreted_kda_kernels_match_the_reference(case, fla_kda_interpreted, caplog) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_rules(CudaBackend(ReferenceAttention()), "cpu", torch.float32, case, INTERPRETED_TOL)
    assert any("fla's chunked KDA kernels" in r.message for r in caplog.records)
    assert fla_kda_interpreted == ([2, 2] if case is LEADING else [])  # each step's two leading decode rows


@needs_interpreter
@needs_fla
@OVERFLOW_ABOVE_THE_DIAGONAL
@pytest.mark.parametrize("case", [FRESH, CONTINUING], ids=["fresh", "continuing"])
def test_interpreted_kda_kernels_read_their_geometry_on_the_device(case, fla_kda_interpreted) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    compare_padded_bucket(CudaBackend(ReferenceAttention()), "cpu", case, INTERPRETED_TOL)


@needs_cuda
@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_kda_kernels_match_the_reference(case, dtype: torch.dtype, monkeypatch) -> None:
    from hybridcache.kernels.backend import get_backend

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # as the engine runs fp32 (read when a kernel compiles)
    backend = get_backend("cuda")
    assert type(backend).__name__ == "CudaBackend"
    compare_rules(backend, "cuda", dtype, case, CUDA_TOL[dtype])


@needs_cuda
@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", [MIXED, DECODE, LEADING], ids=["mixed", "decode", "leading-decodes"])
def test_cuda_kda_kernels_match_the_reference_at_kimi_widths(case, dtype: torch.dtype, monkeypatch) -> None:
    """Kimi-Linear-48B-A3B's KDA layer: 32 heads, head dim 128 (the pool fp32, as the engine keeps it)."""
    from hybridcache.kernels.backend import get_backend

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    compare_rules(get_backend("cuda"), "cuda", dtype, case, CUDA_TOL[dtype], heads=32, dims=(128, 128))


@needs_cuda
@needs_fla
@pytest.mark.parametrize("case", [FRESH, CONTINUING], ids=["fresh", "continuing"])
def test_cuda_kda_kernels_read_their_geometry_on_the_device(case, monkeypatch) -> None:
    from hybridcache.kernels.backend import get_backend

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    compare_padded_bucket(get_backend("cuda"), "cuda", case, CUDA_TOL[torch.float32])
