"""`CudaBackend`'s Mamba2 ops (`ssd_scan`, `gated_group_rms_norm`, and the shared `causal_conv1d` at Mamba2's
widths) against `ReferenceBackend` on batches the engine builds: fresh, continuing and decode sequences mixed, leading
decode rows before prefill chunks, and an all-decode step (its graph-safe path, fresh one-token prompts among the rows).

- CPU: `CudaBackend.ssd_scan` on CPU tensors (the torch step for all-decode steps; the reference per sequence for
  prefill rows: fla is Triton on CUDA).
- `test_interpreted_*`: fla's scan (`kernels/mamba2/fla.py`) on CPU tensors under TRITON_INTERPRET=1, in a child
  process (`test_fla_scan_in_a_triton_interpreter_subprocess`), fp32 only (the interpreter's bf16 dots multiply the
  raw bits); skipped where fla is not importable (CI: fla stays out of the CPU test environment). fla's autotuned
  kernels run one config there (the interpreter has no benchmarker), and its state kernel's loop counter is given
  the `.to` it calls (`fla_interpreted`).
- `test_cuda_*` (skipped without CUDA): every op on the GPU, the scan through fla. fp32 runs IEEE fp32 dots, as the
  engine does (`TRITON_F32_DEFAULT=ieee`); bf16 is compared by the error's norm against the output's (fla rounds
  dt * x, the chunk states and the decayed C B^T weights to bf16 before its products, as mamba_ssm's kernels do:
  a relative error of ~2.4e-3, emulated in torch on the test's shapes; an element whose terms cancel can be off by
  several bf16 steps of its terms, far beyond an elementwise 2e-2).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import pytest
import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.attention.reference_backend import ReferenceAttention
from hybridcache.kernels.backend import ReferenceBackend
from tests.kernels.interpreter import interpreted_in_child, needs_interpreter

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
NUM_SLOTS = 8
BLOCK = 64
HEADS, HEAD_DIM, GROUPS, STATE = 8, 16, 2, 32

MIXED = ([(0, 70), (130, 1), (37, 200), (0, 1), (63, 65), (5, 1)], [4, 0, 2, 5, 7, 1])
DECODE = ([(130, 1), (0, 1), (63, 1), (200, 1)], [3, 6, 0, 1])  # one fresh 1-token prompt among them
FRESH = ([(0, 150)], [3])  # one sequence: the path a whole-step graph captures
CONTINUING = ([(37, 90)], [5])
# two decode rows (one a fresh one-token prompt) before the prefill chunks: fla.mixed_ssd_scan
LEADING = ([(130, 1), (0, 1), (37, 200), (0, 64), (63, 65), (5, 1)], [3, 6, 0, 1, 5, 7])
CUDA_SCAN_TOL = {torch.float32: {"rtol": 2e-3, "atol": 2e-3}, torch.bfloat16: {"ratio": 1e-2}}  # docstring
CASES = {"mixed": MIXED, "decode": DECODE, "one-fresh": FRESH, "one-continuing": CONTINUING,
         "leading-decodes": LEADING}


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


def assert_near(got: torch.Tensor, want: torch.Tensor, tol: dict) -> None:
    """Elementwise (`rtol`, `atol`), or by the norms (`ratio`: ||got - want|| <= ratio ||want||, every element
    finite)."""
    if "ratio" not in tol:
        torch.testing.assert_close(got, want, **tol)
        return
    assert torch.isfinite(got).all()
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert error <= tol["ratio"], f"relative error {error:.3g} > {tol['ratio']}"


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
        assert_near(got, want, tol)
        assert_near(ssm, ssm_ref, tol)  # every slot, the untouched ones included


def compare_padded_bucket(backend, device: str, case, tol: dict) -> None:
    """As a whole-step graph runs a one-sequence step (`prefill_graphs.SequenceGraphs`): the rows of a bucket bigger
    than the sequence, the padding rows NaN (unwritten conv output), the host lengths those of the capture; the real
    rows' outputs and the state equal the reference's on the real step (the padding rows are the graph's to zero)."""
    bucket = 256
    raw = engine_batch(*case, device=device)
    rows = raw.input_ids.shape[0]
    inputs = scan_inputs(rows, device, torch.float32)
    padded = {name: torch.cat([t, torch.full((bucket - rows, *t.shape[1:]), float("nan"), device=device)])
              if t.shape[0] == rows and name not in ("A_log", "dt_bias", "D") else t for name, t in inputs.items()}
    captured = dataclasses.replace(raw, query_lens_cpu=(bucket,), context_lens_cpu=(bucket,))  # (a fresh capture)
    ssm = torch.randn(NUM_SLOTS, HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(1)).to(device)
    ssm_ref = ssm.clone()
    limit = (0.0, float("inf"))
    got = backend.ssd_scan(**padded, ssm_layer=ssm, batch=backend.prepare(captured), dt_limit=limit)
    want = ReferenceBackend().ssd_scan(**inputs, ssm_layer=ssm_ref, batch=ReferenceBackend().prepare(raw),
                                       dt_limit=limit)
    torch.testing.assert_close(got[:rows], want, **tol)
    torch.testing.assert_close(ssm, ssm_ref, **tol)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_backend_scan_paths_match_the_reference_on_cpu(case, caplog) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    backend = CudaBackend(ReferenceAttention())
    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_scans(backend, "cpu", torch.float32, case, {"rtol": 1e-5, "atol": 1e-5})
    said = [r.message for r in caplog.records if r.message.startswith("Mamba2 layers")]
    assert len(said) == 1, said  # one log line, on the first scan only


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_backend_mamba2_ops_match_the_reference_on_cuda(case, dtype: torch.dtype, monkeypatch) -> None:
    from hybridcache.kernels.backend import get_backend

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # as the engine runs fp32 (read when a kernel compiles)
    backend = get_backend("cuda")
    assert type(backend).__name__ == "CudaBackend"
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    compare_scans(backend, "cuda", dtype, case, CUDA_SCAN_TOL[dtype])
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


FLA_TOL = {"rtol": 1e-4, "atol": 1e-4}  # fp32 (the interpreter's dots are numpy's fp32 products)
# exp2 of the decay between a later and an earlier token, above the causal diagonal, overflows before it is masked
OVERFLOW_ABOVE_THE_DIAGONAL = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                                         "ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture
def fla_interpreted(monkeypatch):
    """fla's kernels on CPU tensors under the interpreter: `runs_on` says yes, each autotuned kernel keeps one
    config (the interpreter has no benchmarker to tune with), and the state kernel's `range` yields Triton scalars
    (it calls `.to(tl.int64)` on its loop counter; the interpreter's own `range` yields Python ints)."""
    import triton
    import triton.language as tl
    from fla.ops.common import chunk_h, chunk_o
    from fla.ops.utils import cumsum

    from hybridcache.kernels.mamba2 import fla as mamba2_fla

    monkeypatch.setattr(mamba2_fla, "runs_on", lambda x: True)
    for kernel in (cumsum.chunk_local_cumsum_scalar_kernel, chunk_h.chunk_fwd_kernel_h, chunk_o.chunk_fwd_kernel_o):
        while not isinstance(kernel, triton.runtime.Autotuner):
            kernel = kernel.fn
        monkeypatch.setattr(kernel, "configs", kernel.configs[-1:])

    def scalar_range(*bounds):
        for i in range(*(int(b) for b in bounds)):
            yield tl.full([], i, tl.int32)

    monkeypatch.setattr(chunk_h, "range", scalar_range, raising=False)


@needs_fla
@interpreted_in_child("test_interpreted_")
def test_fla_scan_in_a_triton_interpreter_subprocess() -> None:
    """Runs this file's `test_interpreted_*` tests under TRITON_INTERPRET=1 (see tests/kernels/interpreter.py)."""


@needs_interpreter
@needs_fla
@OVERFLOW_ABOVE_THE_DIAGONAL
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_interpreted_fla_scan_matches_the_reference(case, fla_interpreted) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    compare_scans(CudaBackend(ReferenceAttention()), "cpu", torch.float32, case, FLA_TOL)


@needs_interpreter
@needs_fla
@OVERFLOW_ABOVE_THE_DIAGONAL
@pytest.mark.parametrize("case", [FRESH, CONTINUING], ids=["fresh", "continuing"])
def test_interpreted_fla_scan_reads_its_geometry_on_the_device(case, fla_interpreted) -> None:
    from hybridcache.kernels.cuda_backend import CudaBackend

    compare_padded_bucket(CudaBackend(ReferenceAttention()), "cpu", case, FLA_TOL)


@needs_cuda
@needs_fla
@pytest.mark.parametrize("case", [FRESH, CONTINUING], ids=["fresh", "continuing"])
def test_cuda_fla_scan_reads_its_geometry_on_the_device(case, monkeypatch) -> None:
    from hybridcache.kernels.backend import get_backend

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    compare_padded_bucket(get_backend("cuda"), "cuda", case, CUDA_SCAN_TOL[torch.float32])


@needs_cuda
@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("widths", [(64, 64, 1, 128), (32, 64, 4, 128)], ids=lambda w: "H{}xP{}-G{}-N{}".format(*w))
def test_cuda_fla_scan_matches_the_reference_at_model_widths(widths, dtype: torch.dtype, monkeypatch) -> None:
    """`mamba2/fla.ssd_chunk_scan_varlen` against `reference.ssd_chunk_scan` per sequence at Granite-4.0-H's head
    and state widths (one group, as Granite; four), chunk-boundary lengths, fresh and continuing sequences."""
    from hybridcache.kernels.mamba2 import fla as mamba2_fla
    from hybridcache.kernels.mamba2 import reference as mamba2_ref

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    heads, head_dim, groups, state = widths
    lens, history = [1, 63, 64, 65, 300, 17], [9, 0, 64, 0, 130, 5]
    g = torch.Generator().manual_seed(3)
    total = sum(lens)
    x = torch.randn(total, heads, head_dim, generator=g).to("cuda", dtype)
    B, C = (torch.randn(total, groups, state, generator=g).to("cuda", dtype) for _ in range(2))  # noqa: N806
    dt = mamba2_ref.discretized_dt(torch.randn(total, heads, generator=g), torch.randn(heads, generator=g) - 2.0,
                                   (0.0, float("inf"))).cuda()
    A = -torch.linspace(1.0, 16.0, heads).cuda()  # noqa: N806 (Granite's A_log: log 1 .. log 16)
    D = torch.randn(heads, generator=g).cuda()  # noqa: N806
    pool = torch.randn(8, heads, head_dim, state, generator=g).cuda()
    slots = torch.tensor([6, 1, 3, 0, 7, 2], device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    context = [h + n for h, n in zip(history, lens, strict=True)]
    got_pool = pool.clone()
    got = mamba2_fla.ssd_chunk_scan_varlen(x, dt, A, B, C, D, got_pool, slots, cu,
                                           torch.tensor(context, device="cuda"), lens)
    want, want_pool = torch.empty_like(got), pool.clone()
    for i, before in enumerate(history):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        initial = want_pool[slots[i]] if before else None
        want[rows], final = mamba2_ref.ssd_chunk_scan(x[rows], dt[rows], A, B[rows], C[rows], D, initial)
        want_pool[slots[i]] = final
    print(f"{widths} {dtype}: output max error {(got - want).abs().max():.3g} (max |y| {want.abs().max():.3g}), "
          f"state max error {(got_pool - want_pool).abs().max():.3g}")
    assert_near(got, want, CUDA_SCAN_TOL[dtype])
    assert_near(got_pool, want_pool, CUDA_SCAN_TOL[dtype])
