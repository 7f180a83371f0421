"""`CudaBackend.selective_scan` (Mamba1) against `ReferenceBackend` on batches the engine builds: fresh, continuing and
decode sequences mixed, decode rows before prefill chunks, an all-decode step (a fresh one-token prompt among the rows),
one sequence, one sequence on a bucket of rows with NaN padding and the capture's host lengths (what a whole-step
graph runs), and fresh sequences whose slot rows hold NaN and inf (they start from zeros).

- CPU: on CPU tensors the backend takes the torch reference (Triton runs on CUDA only), and says so once.
- `test_interpreted_*`: the Triton scan (`kernels/mamba1/triton.py`) through the backend on CPU tensors under
  TRITON_INTERPRET=1, in a child process (`test_triton_scan_in_an_interpreter_subprocess`), fp32 inputs with fp32
  and bf16 state pools; verify rows still take the reference.
- `test_cuda_*` (skipped without CUDA): the same on the GPU, fp32 and bf16 inputs.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hybridcache.kernels.attention.reference_backend import ReferenceAttention
from hybridcache.kernels.backend import ReferenceBackend
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_mamba2_cuda import CASES, NUM_SLOTS, engine_batch

CHANNELS, STATE = 24, 16
PARAMETERS = ("A_log", "dt_bias", "D")
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def scan_inputs(tokens: int, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, to: torch.dtype = dtype) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(device, to)

    a_log = torch.empty(CHANNELS, STATE).uniform_(0.05, 2.0, generator=g).log().to(device)
    return {"x": rand(tokens, CHANNELS), "dt": rand(tokens, CHANNELS), "B": rand(tokens, STATE),
            "C": rand(tokens, STATE), "A_log": a_log, "dt_bias": rand(CHANNELS, scale=0.5, to=torch.float32),
            "D": rand(CHANNELS, to=torch.float32), "z": rand(tokens, CHANNELS)}


def pool(device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, CHANNELS, STATE, generator=torch.Generator().manual_seed(1)).to(device, dtype)


def cuda_backend():
    from hybridcache.kernels.cuda_backend import CudaBackend

    return CudaBackend(ReferenceAttention())


def compare_scans(backend, device: str, dtype: torch.dtype, raw, tol: dict, pool_dtype=torch.float32,
                  gated: bool = True) -> None:
    inputs = scan_inputs(raw.input_ids.shape[0], device, dtype)
    if not gated:
        inputs["z"] = None
    ssm, ssm_ref = pool(device, pool_dtype), pool(device, pool_dtype)
    got = backend.selective_scan(**inputs, ssm_layer=ssm, batch=backend.prepare(raw))
    want = ReferenceBackend().selective_scan(**inputs, ssm_layer=ssm_ref, batch=ReferenceBackend().prepare(raw))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol)
    # every slot, the untouched ones included (a bf16 pool: both round fp32 states that may differ in the last bit)
    state_tol = tol if pool_dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(ssm.float(), ssm_ref.float(), **state_tol)
    assert not torch.equal(ssm, pool(device, pool_dtype))


def compare_padded_bucket(backend, device: str, case, tol: dict) -> None:
    """As a whole-step graph runs a one-sequence step (`prefill_graphs.SequenceGraphs`): the rows of a bucket bigger
    than the sequence, the padding rows NaN (unwritten conv output), the host lengths those of the capture; the real
    rows' outputs and the state equal the reference's on the real step (the padding rows are the graph's to zero)."""
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
    torch.testing.assert_close(ssm, ssm_ref, **tol)


def compare_poisoned_fresh_rows(backend, device: str, tol: dict) -> None:
    """A fresh sequence starts from zeros whatever its slot's row holds: the rows of the mixed case's fresh sequences
    (a 70-token and a 1-token prompt) hold NaN and inf, as a former occupant that overflowed leaves them; outputs and
    final states are finite and equal the reference's, and the continuing sequences' rows are untouched by it."""
    raw = engine_batch(*CASES["mixed"], device=device)
    fresh_slots = [slot for (start, _), slot in zip(*CASES["mixed"], strict=True) if start == 0]
    assert len(fresh_slots) == 2
    inputs = scan_inputs(raw.input_ids.shape[0], device, torch.float32)
    ssm, ssm_ref = pool(device), pool(device)
    for state, poison in zip(fresh_slots, (float("nan"), float("inf")), strict=True):
        ssm[state], ssm_ref[state] = poison, poison
    got = backend.selective_scan(**inputs, ssm_layer=ssm, batch=backend.prepare(raw))
    want = ReferenceBackend().selective_scan(**inputs, ssm_layer=ssm_ref, batch=ReferenceBackend().prepare(raw))
    assert want.isfinite().all() and ssm_ref[fresh_slots].isfinite().all()
    assert got.isfinite().all() and ssm[fresh_slots].isfinite().all()
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(ssm, ssm_ref, **tol)


def verify_batch(device: str):
    """A verify row (1 + 3 tokens, 3 draft slots) before a prefill chunk."""
    raw = engine_batch([(40, 4), (0, 30)], [1, 3], device=device)
    return dataclasses.replace(raw, draft_slots_cpu=((5, 6, 7), ()), draft_rows=torch.tensor([0, 1, 2], device=device),
                               draft_slots=torch.tensor([5, 6, 7], device=device))


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cpu_tensors_take_the_reference_and_say_so_once(case, caplog) -> None:
    backend = cuda_backend()
    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_scans(backend, "cpu", torch.float32, engine_batch(*case, device="cpu"), FP32)
        compare_scans(backend, "cpu", torch.float32, engine_batch(*case, device="cpu"), FP32)
    said = [r.message for r in caplog.records if r.message.startswith("Mamba1 layers")]
    assert said == ["Mamba1 layers run the torch reference selective scan (the Triton scan runs on CUDA only)"]


@interpreted_in_child("interpreted")
def test_triton_scan_in_an_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """`CudaBackend` with the Triton scan taken for CPU tensors (the interpreter runs it)."""
    from hybridcache.kernels.mamba1 import triton as mamba1_triton

    monkeypatch.setattr(mamba1_triton, "runs_on", lambda x: True)
    return cuda_backend()


@needs_interpreter
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_interpreted_triton_scan_matches_the_reference(case, pool_dtype, triton_on_cpu, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hybridcache.kernels.cuda_backend"):
        compare_scans(triton_on_cpu, "cpu", torch.float32, engine_batch(*case, device="cpu"), FP32, pool_dtype)
    assert [r.message for r in caplog.records if r.message.startswith("Mamba1")] == [
        "Mamba1 layers run the Triton selective scan"]


@needs_interpreter
def test_interpreted_triton_scan_without_a_gate(triton_on_cpu) -> None:
    compare_scans(triton_on_cpu, "cpu", torch.float32, engine_batch(*CASES["mixed"], device="cpu"), FP32,
                  gated=False)


@needs_interpreter
@pytest.mark.parametrize("case", [CASES["one-fresh"], CASES["one-continuing"]], ids=["fresh", "continuing"])
def test_interpreted_triton_scan_reads_its_geometry_on_the_device(case, triton_on_cpu) -> None:
    compare_padded_bucket(triton_on_cpu, "cpu", case, FP32)


@needs_interpreter
def test_interpreted_triton_scan_starts_a_fresh_sequence_from_zeros_whatever_its_row_holds(triton_on_cpu) -> None:
    compare_poisoned_fresh_rows(triton_on_cpu, "cpu", FP32)


@needs_interpreter
def test_interpreted_verify_rows_take_the_reference(triton_on_cpu) -> None:
    """Verify rows keep the state after each draft position: the reference (`mamba1_scan`) runs them."""
    compare_scans(triton_on_cpu, "cpu", torch.float32, verify_batch("cpu"), FP32)


@needs_interpreter
def test_interpreted_mixer_on_the_cuda_backend_equals_transformers(triton_on_cpu) -> None:
    """Jamba's Mamba1 mixer with every op on `CudaBackend` (the Triton conv and scan, interpreted) against
    transformers' JambaMambaMixer: a varlen prefill (150 tokens, a 1-token prompt, 70), an all-decode step, then a
    mixed step (a decode row before a prefill chunk)."""
    from tests.kernels.mixer_checks import TOLERANCE, hf_out, inputs, rel_err
    from tests.kernels.mixer_runner import MixerRunner
    from tests.kernels.test_mamba1_mixer import GEOMETRIES, hf_layer, our_mixer

    config, layer = hf_layer(*GEOMETRIES["E2-N16-R6-K4"])
    runner = MixerRunner(our_mixer(config, layer), 3, backend=triton_on_cpu)
    hidden = [inputs(160, seed=i) for i in range(3)]
    want = [hf_out(layer, x) for x in hidden]
    for plan in ([(0, 150), (1, 1), (2, 70)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 29)]):
        feeds = [(seq, hidden[seq][runner.fed[seq] : runner.fed[seq] + count]) for seq, count in plan]
        starts = [runner.fed[seq] for seq, _ in plan]
        for (seq, count), start, ours in zip(plan, starts, runner.step(feeds), strict=True):
            assert rel_err(ours, want[seq][start : start + count]) <= TOLERANCE, (plan, seq)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cuda_selective_scan_matches_the_reference(case, dtype: torch.dtype) -> None:
    """fp32 arithmetic on both sides from the same inputs: only the order of operations differs."""
    compare_scans(cuda_backend(), "cuda", dtype, engine_batch(*case, device="cuda"), {"rtol": 1e-4, "atol": 1e-4})


@needs_cuda
def test_cuda_selective_scan_starts_a_fresh_sequence_from_zeros_whatever_its_row_holds() -> None:
    compare_poisoned_fresh_rows(cuda_backend(), "cuda", {"rtol": 1e-4, "atol": 1e-4})


@needs_cuda
def test_cuda_selective_scan_reads_its_geometry_on_the_device() -> None:
    compare_padded_bucket(cuda_backend(), "cuda", CASES["one-continuing"], {"rtol": 1e-4, "atol": 1e-4})
    compare_scans(cuda_backend(), "cuda", torch.float32, verify_batch("cuda"), {"rtol": 1e-4, "atol": 1e-4})
