"""The CUDA kernels (gated delta rule via flash-linear-attention + the Triton step kernel, causal conv1d,
paged attention, grouped-GEMM MoE) against the torch reference, via `tests/kernels/cuda_checks.py`.

- `test_cuda_*` run on a CUDA device (skipped without one): the full varlen case, lengths 1, 17, 63, 64, 65,
  200 and 1,500 in one batch, cached history 0 (fresh) or not (initial state / prefix, chunks starting
  mid-page), bf16 and fp32.
- The Triton kernels of our own (not fla, not the grouped GEMM) also run on the CPU under TRITON_INTERPRET=1
  on small cases: `test_triton_interpreter_in_subprocess` starts a child pytest that runs the
  `test_interpreted_*` tests (this process never imports triton). The interpreter's bf16 matrix products are
  wrong, so attention is interpreted in fp32 only.

Tolerances (norm_rel = ||out - ref|| / ||ref||, max_rel = max |out - ref| / max |ref|; the reference is fp32
on the same rounded inputs). A single wrong row pushes max_rel to O(1), so max_rel catches indexing errors
that a norm over thousands of rows would dilute.
- fp32, our kernels: fp32 arithmetic in another order: 1e-5.
- bf16 outputs of our kernels: the output is rounded to bf16 once (relative step 2^-8 = 3.9e-3, half of it
  on average) and attention also rounds the probabilities to bf16 before P @ V: norm_rel 1e-2, max_rel 2e-2.
- fla's chunked rule keeps its WY factors and the chunk states in bf16 for bf16 inputs, and runs fp32 inputs
  through tf32 matrix products: 2e-2 (bf16) / 5e-3 (fp32) on outputs; the fp32 final state 2e-2 / 5e-3.
- Conv state rows are copies of inputs: exact. Pool rows outside the batch: exact (untouched).
- MoE bf16: bf16 GEMMs with the hidden activation rounded to bf16 between them: 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])

EXACT = (0.0, 0.0)
OURS = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}  # (norm_rel, max_rel)
FLA = {torch.float32: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}


def assert_within(stats: dict, bounds: dict) -> None:
    """Each named error within its (norm_rel, max_rel) bound; prints all of them on failure."""
    failed = {
        name: stats[name]
        for name, (norm_rel, max_rel) in bounds.items()
        if not (stats[name].norm_rel <= norm_rel and stats[name].max_rel <= max_rel)
    }
    assert not failed, f"out of bounds {bounds}: {failed}"


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")


@needs_cuda
@DTYPES
def test_cuda_gated_delta_chunk(dtype: torch.dtype, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_gated_delta

    stats = check_gated_delta(dtype, cuda)
    assert_within(stats, {"out": FLA[dtype], "final_state": FLA[dtype], "other_slots": EXACT})
    # a mixed step's leading decode rows (one fresh) before prefill chunks: the step kernel writes them into fla's
    # output, fla runs them as one throwaway sequence (`fla.mixed_gated_delta_rule`)
    stats = check_gated_delta(dtype, cuda, lengths=(1, 1, 1, 1, 17, 63, 200), history=(40, 0, 7, 130, 5, 0, 37))
    assert_within(stats, {"out": FLA[dtype], "final_state": FLA[dtype], "other_slots": EXACT})


@needs_cuda
@DTYPES
def test_cuda_decode_steps(dtype: torch.dtype, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_decode_step

    stats = check_decode_step(dtype, cuda)
    assert_within(stats, {
        "conv_out": OURS[dtype], "conv_state": EXACT, "conv_other_slots": EXACT,
        "gdn_out": OURS[dtype], "gdn_state": OURS[torch.float32], "gdn_other_slots": EXACT,
    })


@needs_cuda
@DTYPES
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_cuda_conv(dtype: torch.dtype, with_bias: bool, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_conv

    stats = check_conv(dtype, cuda, with_bias=with_bias)
    assert_within(stats, {"out": OURS[dtype], "final_state": EXACT, "other_slots": EXACT})


@needs_cuda
@DTYPES
def test_cuda_conv_without_activation(dtype: torch.dtype, cuda: torch.device) -> None:
    """LFM2's short conv (3 taps, no SiLU): the varlen and the decode kernels."""
    from tests.kernels.cuda_checks import check_conv, check_decode_step

    stats = check_conv(dtype, cuda, kernel=3, activation=None)
    assert_within(stats, {"out": OURS[dtype], "final_state": EXACT, "other_slots": EXACT})
    stats = check_decode_step(dtype, cuda, kernel=3, activation=None)
    assert_within(stats, {"conv_out": OURS[dtype], "conv_state": EXACT, "conv_other_slots": EXACT})


@needs_cuda
@DTYPES
def test_cuda_gated_conv_step_equals_torch_gates(dtype: torch.dtype, cuda: torch.device) -> None:
    """LFM2's gated short convolution's decode step in one launch: bit for bit torch's `c * conv(b * x)`."""
    from tests.kernels.cuda_checks import check_gated_conv_step

    assert_within(check_gated_conv_step(dtype, cuda), {"out": EXACT, "pool": EXACT})


@needs_cuda
@DTYPES
@pytest.mark.parametrize(("page", "heads", "head_dim"), [(16, (16, 2), 256), (64, (8, 2), 128)],
                         ids=["page16-d256", "page64-d128"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_cuda_attention(dtype: torch.dtype, page: int, heads: tuple[int, int], head_dim: int, decode: bool,
                        cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import HISTORY, LENGTHS, check_attention

    lengths, history = LENGTHS, HISTORY
    if decode:  # one new token after the prefix: contexts 1 (fresh) .. 1,631 keys
        history = tuple(h + n - 1 for h, n in zip(HISTORY, LENGTHS, strict=True))
        lengths = (1,) * len(LENGTHS)
    stats = check_attention(dtype, cuda, lengths, history, page=page, heads=heads, head_dim=head_dim)
    assert_within(stats, {"kv_write": EXACT, "out": OURS[dtype]})


@needs_cuda
@DTYPES
@pytest.mark.parametrize(("lengths", "history", "splits"), [
    (None, None, 4), (None, None, 7), ((200,), (16_000,), 9), ((200, 3, 130), (16_000, 900, 5_000), 16),
], ids=["varlen-4", "varlen-7", "long-9", "mixed-16"])
def test_cuda_attention_prefill_splits(dtype: torch.dtype, lengths, history, splits: int,
                                       cuda: torch.device) -> None:
    """The prefill kernel with its keys split (`_prefill_split_kernel` + the merge): the varlen case (splits
    past short contexts are empty; rows that see no key of a split) and short chunks over long contexts, as
    phase C's + 200 request (200 new tokens over 16,000 cached)."""
    from tests.kernels.cuda_checks import HISTORY, LENGTHS, check_attention

    stats = check_attention(dtype, cuda, lengths or LENGTHS, history or HISTORY, page=16, heads=(16, 2),
                            head_dim=256, num_splits=splits)
    assert_within(stats, {"kv_write": EXACT, "out": OURS[dtype]})


@needs_cuda
@DTYPES
@pytest.mark.parametrize("block_m", [None, 16, 64], ids=["grouped", "triton16", "triton64"])
def test_cuda_moe(dtype: torch.dtype, block_m: int | None, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_moe

    bound = (2e-2, 2e-2) if dtype == torch.bfloat16 else OURS[torch.float32]
    assert_within(check_moe(dtype, cuda, block_m=block_m), {"out": bound})
    if block_m is not None:  # decode-sized: fewer rows than one tile per expert
        assert_within(check_moe(dtype, cuda, num_tokens=5, top_k=4, block_m=block_m), {"out": bound})


@needs_cuda
@DTYPES
def test_cuda_norms(dtype: torch.dtype, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_norms

    stats = check_norms(dtype, cuda)
    # Same roundings as the modules; only the fp32 sum order differs, which can move a bf16 result by one step.
    assert_within(stats, {name: OURS[dtype] for name in stats})


@needs_cuda
@DTYPES
def test_cuda_rotary(dtype: torch.dtype, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_rotary

    stats = check_rotary(dtype, cuda)
    assert_within(stats, {"query": OURS[dtype], "key": OURS[dtype], "pass_through": EXACT})


@needs_cuda
@DTYPES
def test_cuda_delta_gates(dtype: torch.dtype, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_delta_gates

    stats = check_delta_gates(dtype, cuda)
    # g is fp32 from the same formula (exp/log approximations differ by ulps); beta is sigmoid rounded once to
    # the dtype, so in bf16 an ulp of fp32 can move it by one bf16 step.
    assert_within(stats, {"g": OURS[torch.float32], "beta": OURS[dtype]})


@needs_cuda
@DTYPES
def test_cuda_route(dtype: torch.dtype, cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_route

    for rows in (300, 2000):  # a decode's rows, one a program; a prefill's, 16 a program over 16 and 32 experts
        stats = check_route(dtype, cuda, rows=rows)
        # The same picks; fp32 softmax and renormalisation with another summation order, rounded once to the dtype.
        assert_within(stats, {name: EXACT if name.startswith("ids") else OURS[dtype] for name in stats})
    from tests.kernels.cuda_checks import check_route_of_bad_rows

    check_route_of_bad_rows(dtype, cuda)


@needs_cuda
def test_cuda_route_of_bf16_logits_is_the_route_of_their_upcast_rounded(cuda: torch.device) -> None:
    """Granite's gating (bf16 logits in, bf16 weights out) is the same bits as the fp32 launch rounded after it."""
    from hybridcache.kernels.moe.triton_route import route

    for rows in (64, 2000):  # the decode launch (a row a program) and the prefill one (16 rows a program)
        logits = (3 * torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))).to(cuda, torch.bfloat16)
        weights, ids = route(logits, 6, True)
        ref_weights, ref_ids = route(logits.float(), 6, True)
        assert weights.dtype == torch.bfloat16 and torch.equal(ids, ref_ids)
        assert torch.equal(weights, ref_weights.to(torch.bfloat16))


@needs_cuda
def test_cuda_route_sigmoid(cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_route_sigmoid

    for rows in (300, 2000):
        stats = check_route_sigmoid(cuda, rows=rows)
        # The same picks; sigmoid and the renormalising sum in fp32 in another order than torch's: a few ulps.
        assert_within(stats, {name: EXACT if name.startswith("ids") else OURS[torch.float32] for name in stats})


@needs_cuda
def test_cuda_sort_pairs(cuda: torch.device) -> None:
    from tests.kernels.cuda_checks import check_sort_pairs

    misses = check_sort_pairs(cuda)
    assert misses and all(count == 0 for count in misses.values()), misses  # the same order and counts, exactly


@needs_cuda
def test_cuda_no_host_sync(cuda: torch.device) -> None:
    """Every bf16 entry point, prefill and decode batches, runs without a host sync once warm."""
    from tests.kernels.cuda_checks import host_syncs

    report = host_syncs(cuda)
    assert report and all(result == "ok" for result in report.values()), report


# --- our Triton kernels on the CPU, interpreted ---------------------------------------------------------------

SMALL_LENGTHS = (1, 17, 5, 33)
SMALL_HISTORY = (0, 5, 16, 3)


def _interpreter_runs_our_kernels() -> bool:
    """Triton 3.6's interpreter (the H200 machine's, under its numpy) cannot index `range()` by an integer kernel
    argument (`TypeError: only 0-dimensional arrays can be converted to Python scalars`); CI's Triton 3.9 can. The
    compiled kernels are checked on the GPU by the `cuda` tests above."""
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 9)


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
@interpreted_in_child("interpreted")
def test_triton_interpreter_in_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@DTYPES
@pytest.mark.parametrize(("kernel", "activation"), [(4, "silu"), (3, None)], ids=["silu-k4", "none-k3"])
def test_interpreted_conv(dtype: torch.dtype, kernel: int, activation: str | None) -> None:
    """DeltaNet's / Mamba2's conv (SiLU) and LFM2's short conv (3 taps, no activation)."""
    from tests.kernels.cuda_checks import check_conv

    stats = check_conv(dtype, torch.device("cpu"), SMALL_LENGTHS, SMALL_HISTORY, channels=200, kernel=kernel,
                       activation=activation)
    # The interpreter emulates bf16 by truncation, so its bf16 rounding step is twice the hardware's.
    bound = OURS[dtype] if dtype == torch.float32 else (2e-2, 4e-2)
    assert_within(stats, {"out": bound, "final_state": EXACT, "other_slots": EXACT})


@needs_interpreter
def test_interpreted_conv_step_without_activation() -> None:
    from tests.kernels.cuda_checks import check_decode_step

    stats = check_decode_step(torch.float32, torch.device("cpu"), (1, 2, 17, 40), heads=(1, 2), dims=(32, 16),
                              channels=100, kernel=3, activation=None)
    assert_within(stats, {name: OURS[torch.float32] for name in stats})


@needs_interpreter
def test_interpreted_gated_conv_step_equals_torch_gates() -> None:
    """LFM2's gates inside the decode conv's launch: the same bits as torch's products around it (fp32: the
    interpreter's bf16 rounding is not the hardware's)."""
    from tests.kernels.cuda_checks import check_gated_conv_step

    stats = check_gated_conv_step(torch.float32, torch.device("cpu"), (1, 2, 17, 40), channels=100)
    assert_within(stats, {"out": EXACT, "pool": EXACT})


@needs_interpreter
def test_interpreted_decode_steps() -> None:
    from tests.kernels.cuda_checks import check_decode_step

    stats = check_decode_step(torch.float32, torch.device("cpu"), (1, 2, 17, 40), heads=(1, 2), dims=(32, 16),
                              channels=100)
    assert_within(stats, {name: OURS[torch.float32] for name in stats})


@needs_interpreter
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_interpreted_attention(decode: bool) -> None:
    from tests.kernels.cuda_checks import check_attention

    lengths, history = (SMALL_LENGTHS, SMALL_HISTORY) if not decode else ((1,) * 4, (0, 16, 40, 100))
    stats = check_attention(torch.float32, torch.device("cpu"), lengths, history, page=16, heads=(4, 2),
                            head_dim=32)
    assert_within(stats, {"kv_write": EXACT, "out": OURS[torch.float32]})


@needs_interpreter
def test_interpreted_attention_backend_runs_leading_decode_rows_in_the_decode_kernel() -> None:
    """The "triton" attention backend on a mixed step that starts with decode rows (one a fresh 1-token prompt)
    and ends with one: the prefill kernel skips the leading rows' blocks and the decode kernel writes their rows
    (`triton_backend`'s module docstring), against the reference backend."""
    from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.attention.triton_backend import TritonAttention
    from tests.kernels.cuda_checks import error_stats

    chunks, next_block = [], 30
    for slot, (start, num) in enumerate([(130, 1), (0, 1), (5, 1), (37, 40), (0, 20), (63, 1)]):
        blocks = -(-(start + num) // 16)
        chunks.append(SeqChunk(token_ids=[1] * num, start=start,
                               block_ids=list(range(next_block, next_block - blocks, -1)), slot=slot))
        next_block -= blocks
    batch = build_forward_batch(chunks, block_size=16, kernel_block_size=16)
    gen = torch.Generator().manual_seed(0)
    tokens = batch.input_ids.shape[0]
    pool = torch.randn(2, 32, 16, 2, 32, generator=gen)
    query, key, value = (torch.randn(tokens, heads, 32, generator=gen) for heads in (4, 2, 2))
    fast, slow = TritonAttention(), ReferenceAttention()
    meta = fast.prepare(batch)
    assert meta.lead == 3
    fast.write_kv(pool, key, value, batch)
    got = fast.attention(query, pool, batch, meta, scale=32**-0.5)
    want = slow.attention(query, pool, batch, slow.prepare(batch), scale=32**-0.5)
    assert_within({"out": error_stats(got, want)}, {"out": OURS[torch.float32]})


@needs_interpreter
@pytest.mark.parametrize("splits", [2, 3])
def test_interpreted_attention_prefill_splits(splits: int) -> None:
    """Key splits (fp32 tiles of 32 keys): a one-token sequence (every split past key 0 empty), a chunk over 150
    cached keys, and 40 rows over 100, whose first rows see no key of the last split."""
    from tests.kernels.cuda_checks import check_attention

    stats = check_attention(torch.float32, torch.device("cpu"), (1, 17, 5, 40), (0, 5, 150, 100), page=16,
                            heads=(4, 2), head_dim=32, num_splits=splits)
    assert_within(stats, {"kv_write": EXACT, "out": OURS[torch.float32]})


@needs_interpreter
def test_interpreted_norms() -> None:
    from tests.kernels.cuda_checks import check_norms

    stats = check_norms(torch.float32, torch.device("cpu"), rows=7)
    assert_within(stats, {name: OURS[torch.float32] for name in stats})


@needs_interpreter
@pytest.mark.parametrize("rotary_dim", [64, 32])  # Qwen3-Next's 0.25 of 256; Qwen3.5's 0.25 of 128
def test_interpreted_rotary(rotary_dim: int) -> None:
    from tests.kernels.cuda_checks import check_rotary

    stats = check_rotary(torch.float32, torch.device("cpu"), rows=9, heads=(3, 2), head_dim=4 * rotary_dim,
                         rotary_dim=rotary_dim)
    assert_within(stats, {"query": OURS[torch.float32], "key": OURS[torch.float32], "pass_through": EXACT})


@needs_interpreter
def test_interpreted_delta_gates() -> None:
    from tests.kernels.cuda_checks import check_delta_gates

    stats = check_delta_gates(torch.float32, torch.device("cpu"), rows=20, heads=6)
    assert_within(stats, {name: OURS[torch.float32] for name in stats})


@needs_interpreter
def test_interpreted_route() -> None:
    from tests.kernels.cuda_checks import check_route

    for launch in (None, (16, 4)):  # the decode launch (one row a program), and a prefill's (16 rows, 4 warps)
        stats = check_route(torch.float32, torch.device("cpu"), rows=20, launch=launch)
        assert_within(stats, {name: EXACT if name.startswith("ids") else OURS[torch.float32] for name in stats})


@needs_interpreter
def test_interpreted_route_sigmoid() -> None:
    from tests.kernels.cuda_checks import check_route_sigmoid

    stats = check_route_sigmoid(torch.device("cpu"), rows=20)
    assert_within(stats, {name: EXACT if name.startswith("ids") else OURS[torch.float32] for name in stats})


@needs_interpreter
def test_interpreted_route_of_nan_and_inf_rows() -> None:
    from tests.kernels.cuda_checks import check_route_of_bad_rows

    check_route_of_bad_rows(torch.float32, torch.device("cpu"))


@needs_interpreter
def test_interpreted_sort_pairs() -> None:
    from hybridcache.kernels.moe.triton_sort import MAX_EXPERTS, MAX_PAIRS, sort_pairs_triton
    from tests.kernels.cuda_checks import check_sort_pairs

    misses = check_sort_pairs(torch.device("cpu"))
    assert misses and all(count == 0 for count in misses.values()), misses
    with pytest.raises(ValueError, match="pairs"):  # beyond one program: grouped.sort_pairs uses torch there
        sort_pairs_triton(torch.zeros(MAX_PAIRS + 1, 1, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="experts"):
        sort_pairs_triton(torch.zeros(1, 2, dtype=torch.int64), MAX_EXPERTS + 1)


@needs_interpreter
@pytest.mark.parametrize("block_m", [16, 32])
def test_interpreted_moe(block_m: int) -> None:
    from tests.kernels.cuda_checks import check_moe

    for num_tokens in (5, 70):  # fewer rows than a tile per expert; runs of several tiles
        stats = check_moe(torch.float32, torch.device("cpu"), num_tokens=num_tokens, hidden=48, experts=6,
                          top_k=3, intermediate=40, block_m=block_m)
        assert_within(stats, {"out": OURS[torch.float32]})


@needs_interpreter
@torch.no_grad()
def test_interpreted_lfm2_moe_block_on_the_cuda_backend_equals_the_reference(monkeypatch) -> None:
    """LFM2-MoE's block (one-group sigmoid router with its expert bias, SiLU-gated experts) in fp32 on the CUDA
    backend (the router's `route_sigmoid` launch, the pair sort, the expert GEMMs, the combine) against the reference
    backend: the same picks and the output within fp32 rounding."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend
    from hybridcache.layers.step import StepContext
    from tests.models.lfm2_helpers import make_lfm2_pair

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    block = make_lfm2_pair("moe-norm").ours.model.layers[1].mlp
    assert block.gate.routing.num_groups == 1 and block.gate.e_score_correction_bias.abs().min() > 0
    x = torch.randn(37, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    reference, cuda = ReferenceBackend(), CudaBackend(ReferenceAttention())
    want_ids, got_ids = block.gate(x, reference)[1], block.gate(x, cuda)[1]
    assert torch.equal(got_ids.sort(dim=-1)[0], want_ids.sort(dim=-1)[0])
    want = block(x, StepContext(batch=None, backend=reference, rope=(None, None)))
    got = block(x, StepContext(batch=None, backend=cuda, rope=(None, None)))
    assert got.dtype == torch.float32 and (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


@needs_interpreter
def test_interpreted_decode_splits() -> None:
    from hybridcache.kernels.attention.triton_paged import decode_splits

    assert decode_splits(1, 2, 16000, 64, 132) == (125, 128)  # the docstring's example
    assert decode_splits(64, 2, 4096, 64, 132) == (3, 1408)  # 128 programs already: ceil(264/128) = 3 splits
    assert decode_splits(4, 2, 1, 64, 132) == (1, 64)  # never more splits than key blocks


@needs_interpreter
def test_interpreted_prefill_splits() -> None:
    from hybridcache.kernels.attention.triton_paged import prefill_splits

    assert prefill_splits(32, 16_200, 132) == 4  # the docstring's examples
    assert prefill_splits(128, 3_900, 132) == 1
    assert prefill_splits(48, 2_400, 132) == 2  # one wave: 96 programs
    assert prefill_splits(67, 100_000, 132) == 1  # the programs already fill half the SMs
    assert prefill_splits(16, 2_047, 132) == 1  # a short context
    assert prefill_splits(1, 1_000_000, 132) == 16  # at most MAX_PREFILL_SPLITS


def test_chunk_indices_and_fresh_mask() -> None:
    from hybridcache.kernels.varlen import chunk_indices, fresh_mask

    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    table = chunk_indices(cu, (3, 1, 5), 2)
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]]
    assert fresh_mask(cu, torch.tensor([3, 7, 5])).tolist() == [True, False, True]
