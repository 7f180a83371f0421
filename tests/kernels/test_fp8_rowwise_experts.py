"""Per-channel FP8 routed experts (issue 29): block-scaled experts re-quantised per output channel
(`reference.requantize_rows`, `Fp8ExpertWeights.share(per_channel=True)`), the SwiGLU + per-row quantisation kernel
(`triton_quant.swiglu_quantize_rows`) and the prefill path through torch's row-wise scaled grouped GEMM
(`triton_fp8_moe.rowwise_expert_rows`).

- `requantize_rows` is `reference.quantize(dequantize(...), channel)` of each expert, exactly.
- Interpreted (TRITON_INTERPRET=1 child, as test_fp8_kernels.py): `swiglu_quantize_rows` against torch; `share`
  with `per_channel` turns the modules into per-channel `Fp8Linear`s holding exactly the stack's weights, so the
  reference backend on the modules and the Triton experts on the stack agree to fp32 summation order (W8A16), and
  both stay within the re-quantisation's error of the block-scaled experts.
- On CUDA (skipped without one): the row-wise path against the same arithmetic in torch (x quantised per token,
  the GEMMs on the FP8 numbers, gate/up rounded to bf16, h quantised per row), with uneven expert counts and an
  expert with no rows, with full accumulation (5e-2 of the largest output, 1.5e-2 in the Frobenius norm) and with
  fast accumulation (1e-1, 5e-2); `fp8_grouped_experts` takes it for per-channel experts
  above the decode sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.fp8_format import BLOCK, CHANNEL
from hybridcache.kernels.gemm.reference import dequantize, quantize, quantize_rows, requantize_rows
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fp8_rowwise_kernels_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def test_requantize_rows_is_the_channel_quantisation_of_the_dequantised_blocks():
    generator = torch.Generator().manual_seed(3)
    # rows of very different block scales (one 128-column block 50x larger), partial blocks on both sides
    weights = [torch.randn(200, 300, generator=generator) * torch.where(torch.arange(300) < 128, 50.0, 1.0)
               for _ in range(3)]
    weights[1][7] = 0  # an all-zero row: scale 1, zeros
    blocks = [quantize(w, BLOCK) for w in weights]
    stacked = torch.stack([q for q, _ in blocks])
    scales = torch.stack([s for _, s in blocks])
    got, got_scale = requantize_rows(stacked, scales, BLOCK.block, chunk=2)
    assert got.dtype == stacked.dtype and got_scale.shape == (3, 200) and got_scale.dtype == torch.float32
    for e, (q, s) in enumerate(blocks):
        want, want_scale = quantize(dequantize(q, s, BLOCK, torch.float32), CHANNEL)
        assert torch.equal(got[e].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_scale[e], want_scale[:, 0])
        # each row's largest block keeps e4m3's relative rounding; small blocks lose precision, never range
        deq_block, deq_row = dequantize(q, s, BLOCK, torch.float32), dequantize(got[e], got_scale[e, :, None],
                                                                                CHANNEL, torch.float32)
        assert rel(deq_row, deq_block) <= 2.0**-4
    assert float(got_scale[1, 7]) == 1.0 and not got[1, 7].float().any()


@needs_interpreter
@pytest.mark.parametrize("activation", ["silu_gated", "relu2"])
@pytest.mark.parametrize("inter", [96, 128])
def test_interpreted_swiglu_quantize_rows_equals_torch(inter, activation):
    """silu(gate) * up (`swiglu_quantize_rows`; "relu2": relu(up)^2, `relu2_quantize_rows`) in fp32 quantised per
    row, against torch's `quantize_rows` of the same product: scales to fp32 rounding (sigmoid's last bit), the FP8
    values equal but for the interpreter's float32 -> e4m3 faults (the quantize_rows test in test_fp8_kernels.py)
    or a one-step flip from that scale difference."""
    from hybridcache.kernels.gemm import triton_quant

    generator = torch.Generator().manual_seed(inter)
    relu2 = activation == "relu2"
    h = torch.randn(9, inter if relu2 else 2 * inter, generator=generator) * 3
    h[4] = 0  # silu(0) * 0: an all-zero row
    if relu2:
        h[6] = -h[6].abs()  # all zeros after the relu
        got_q, got_s = triton_quant.relu2_quantize_rows(h)
        want_q, want_s = quantize_rows(F.relu(h).square())
    else:
        got_q, got_s = triton_quant.swiglu_quantize_rows(h)
        want_q, want_s = quantize_rows(F.silu(h[:, :inter]) * h[:, inter:])
    assert got_q.shape == (9, inter) and got_s.shape == (9,)
    assert torch.allclose(got_s, want_s[:, 0], rtol=1e-6, atol=0)
    got, want = got_q.float(), want_q.float()
    lost_carry = (want != 0) & (torch.frexp(want.abs())[0] == 0.5) & (got == want / 2)
    flushed = (want.abs() < 2.0**-6) & ((got - want).abs() <= 2.0**-9)
    one_step = (got - want).abs() <= want.abs() * 2.0**-3
    assert bool(((got == want) | lost_carry | flushed | one_step).all())
    assert float((got == want).float().mean()) > 0.9
    if relu2:
        assert not got[6].any() and torch.equal(got_s[6:7], want_s[6])  # a negative row: zeros, amax 1e-12
        with pytest.raises(ValueError, match="h \\[M, N\\]"):
            triton_quant.relu2_quantize_rows(h[0])
        return
    with pytest.raises(ValueError, match="h \\[M, 2N\\]"):
        triton_quant.swiglu_quantize_rows(h[:, :-1])


def block_experts(hidden: int, inter: int, num_experts: int, generator: torch.Generator,
                  fmt=BLOCK, gated: bool = True) -> nn.ModuleList:
    """`num_experts` SwiGLU experts (weights at std 1/sqrt(fan_in)) quantised to `fmt` (`Fp8Linear` modules);
    `gated` False: ungated ("relu2") experts, up_proj and down_proj alone (Nemotron-H's)."""
    from hybridcache.models.quant import quantize_linears_

    experts = nn.ModuleList()
    for _ in range(num_experts):
        expert = nn.Module()
        if gated:
            expert.gate_proj = nn.Linear(hidden, inter, bias=False)
        expert.up_proj = nn.Linear(hidden, inter, bias=False)
        expert.down_proj = nn.Linear(inter, hidden, bias=False)
        for proj in ([expert.gate_proj] if gated else []) + [expert.up_proj, expert.down_proj]:
            proj.weight.data = torch.randn(proj.weight.shape, generator=generator) / proj.in_features**0.5
        experts.append(expert)
    quantize_linears_(experts, [n for n, m in experts.named_modules() if isinstance(m, nn.Linear)], fmt)
    return experts


@needs_interpreter
def test_interpreted_share_per_channel_keeps_the_modules_and_the_stack_one(monkeypatch):
    """`share(per_channel=True)` of block-scaled experts: every module becomes a per-channel `Fp8Linear` viewing
    its slice of the stack, its scale the stack's row scale; the reference backend on the modules equals the
    Triton experts (W8A16) on the stack to fp32 summation order; both within the re-quantisation's error of the
    block-scaled experts (a second e4m3 rounding of most weights: here 5% of the largest output, as far from the
    block-scaled experts as those are from their bf16 weights; an indexing bug is O(1))."""
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts

    generator = torch.Generator().manual_seed(11)
    hidden, inter, num_experts, top_k, tokens = 256, 128, 4, 2, 9
    experts = block_experts(hidden, inter, num_experts, generator)
    x = torch.randn(tokens, hidden, generator=generator)
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    block_out = ReferenceBackend().moe(x, top_weights, top_ids, experts)
    stacked = Fp8ExpertWeights.share(experts, per_channel=True)
    assert stacked.block == (1, 128) and stacked.gate_up_rows.shape == (num_experts, 2 * inter)
    assert stacked.down_rows.shape == (num_experts, hidden)
    for e, expert in enumerate(experts):
        assert expert.gate_proj.fmt == CHANNEL and not hasattr(expert.gate_proj, "weight_scale_inv")
        assert expert.up_proj.weight.data_ptr() == stacked.gate_up[e, inter:].data_ptr()
        assert torch.equal(expert.up_proj.scale[:, 0], stacked.gate_up_rows[e, inter:])
        assert torch.equal(expert.down_proj.scale[:, 0], stacked.down_rows[e])
        assert torch.equal(stacked.down_scale[e, :, 0], stacked.down_rows[e])
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts)
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, w8a16=True)
    assert rel(got, want) <= 1e-5
    assert 1e-4 < rel(want, block_out) <= 1e-1


def emulated_rowwise(x, top_weights, top_ids, stacked) -> torch.Tensor:
    """The row-wise experts' arithmetic in torch on the device: x per token, each pick's gate/up on the FP8
    numbers in fp32 rounded to bf16, silu * up (a "relu2" stack's relu(up)^2) in fp32 quantised per row, the down
    GEMM, the weighted sum."""
    xq, xs = quantize_rows(x)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = stacked.down.shape[2]
    for t in range(x.shape[0]):
        for j in range(top_ids.shape[1]):
            e = int(top_ids[t, j])
            gu = (xq[t : t + 1].float() @ stacked.gate_up[e].float().T) * xs[t] * stacked.gate_up_rows[e]
            gu = gu.to(torch.bfloat16).float()
            hq, hs = quantize_rows(F.relu(gu).square() if stacked.activation == "relu2"
                                   else F.silu(gu[:, :inter]) * gu[:, inter:])
            y = ((hq.float() @ stacked.down[e].float().T) * hs * stacked.down_rows[e]).to(torch.bfloat16).float()
            out[t] += top_weights[t, j].float() * y[0]
    return out


@needs_cuda
@pytest.mark.parametrize("tokens", [700, 300])  # 175 and 75 mean rows per expert: above the decode tiles
def test_cuda_rowwise_experts_against_torch(tokens, monkeypatch):
    from hybridcache.kernels.gemm import fp8_tiles, triton_fp8_moe
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, compile_tiles, fp8_grouped_experts

    generator = torch.Generator().manual_seed(tokens)
    hidden, inter, num_experts, top_k = 256, 128, 8, 2
    experts = block_experts(hidden, inter, num_experts, generator).cuda()
    x = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16()
    # uneven counts: expert 0 takes most picks, expert 7 none
    top_ids = torch.stack([torch.tensor([0, 1 + int(torch.randint(6, (1,), generator=generator))])
                           for _ in range(tokens)]).cuda()
    top_weights = torch.rand(tokens, top_k, generator=generator).cuda().bfloat16()
    stacked = Fp8ExpertWeights.share(experts, per_channel=True)
    compile_tiles(x[:1], stacked, top_k)
    calls = []
    original = triton_fp8_moe.rowwise_expert_rows
    monkeypatch.setattr(triton_fp8_moe, "rowwise_expert_rows", lambda *a: calls.append(1) or original(*a))
    want = emulated_rowwise(x, top_weights, top_ids, stacked)
    # fast accumulation: Hopper's FP8 accumulator keeps fewer bits, so gate/up rounds to other bf16 values and a
    # row's h to other e4m3 ones (on the CPU, this emulation with gate/up and y off by 1e-4 relative is 2.3e-2
    # from it at the largest output, 5.5e-3 in the Frobenius norm; 1e-3: 2.6e-2, 1.4e-2); an indexing or scale
    # bug is O(1) everywhere
    monkeypatch.setattr(fp8_tiles, "ROWWISE_FAST_ACCUM", True)
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked)
    assert calls, "per-channel experts above the decode sizes take the row-wise scaled grouped GEMM"
    assert got.dtype == torch.bfloat16 and rel(got, want) <= 1e-1 and fro(got, want) <= 5e-2
    # full accumulation (forced: by itself it starts at ROWWISE_FULL_ACCUM_ROWS rows per expert): CUTLASS promotes
    # the FP8 MMA's accumulator to fp32 every few K steps, but between promotions Hopper's FP8 MMA keeps about 14
    # bits (DeepSeek-V3's report, 3.3.2): ~6e-5 relative on gate/up, not fp32 order alone (which the CPU puts at
    # 3e-3); a 1e-4 perturbation is 2.3e-2 / 5.5e-3 above, and R1 on the H200 measured 2.7e-2 at the largest
    # output (session 42), so the bounds are 5e-2 and 1.5e-2 in the Frobenius norm
    monkeypatch.setattr(fp8_tiles, "ROWWISE_FAST_ACCUM", False)
    full = fp8_grouped_experts(x, top_weights, top_ids, stacked, rowwise=True)
    print(f"full accumulation: {rel(full, want):.2e} of the largest output, {fro(full, want):.2e} Frobenius; "
          f"fast: {rel(got, want):.2e}, {fro(got, want):.2e}")
    assert rel(full, want) <= 5e-2 and fro(full, want) <= 1.5e-2
    triton_path = fp8_grouped_experts(x, top_weights, top_ids, stacked, rowwise=False)
    assert rel(got, triton_path) <= 1e-1  # per token against per token per 128 channels: e4m3 steps apart


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "routed-and-shared"])
def test_requantize_experts_per_channel_changes_the_experts_only(shared):
    """`models.quant.requantize_experts_per_channel_` (fp8_quality's `fp8-block-rowexp`): every routed expert's
    block-scaled linear becomes per-channel with `requantize_rows`' numbers, and with `shared` the shared
    expert's (as when it joins their stack, `fp8_tiles.SHARED_AS_EXPERT`); the other FP8 linears keep their
    block format."""
    from hybridcache.layers.linear import Fp8Linear
    from hybridcache.models.quant import requantize_experts_per_channel_

    generator = torch.Generator().manual_seed(5)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    mlp = model.layers[0].mlp = nn.Module()
    mlp.experts = block_experts(256, 128, 3, generator)
    mlp.shared_expert = block_experts(256, 128, 1, generator)[0]
    mlp.other = block_experts(256, 128, 1, generator)[0]
    before = {name: (module.weight.clone(), module.scale.clone()) for name, module in model.named_modules()
              if isinstance(module, Fp8Linear)}
    assert requantize_experts_per_channel_(model, shared=shared) == 9 + 3 * shared
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        weight, scale = before[name]
        if ".experts." not in name and not (shared and ".shared_expert." in name):
            assert module.fmt == BLOCK and torch.equal(module.weight.view(torch.uint8), weight.view(torch.uint8))
            continue
        want, want_scale = requantize_rows(weight[None], scale[None], BLOCK.block)
        assert module.fmt == CHANNEL and not hasattr(module, "weight_scale_inv")
        assert torch.equal(module.weight.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(module.weight_scale, want_scale[0, :, None])


@needs_interpreter
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with-shared"])
def test_interpreted_decode_tile_with_token_scales_equals_its_arithmetic(shared, monkeypatch):
    """Per-channel experts at decode sizes (`triton_fp8_moe.DECODE_TOKEN_SCALES`): x and h quantised per token
    (torch's quantisation here, `test_fp8_kernels.torch_quantisation`), the K loop an unscaled MMA chain scaled
    once after it (`scale_once`), against the same arithmetic in torch (fp32 order; h's e4m3 rounding may flip
    a step: 1e-4), and within the activations' rounding of the per-group path (what it replaces)."""
    from hybridcache.kernels.gemm import triton_fp8_moe, triton_quant
    from hybridcache.kernels.gemm.reference import quantize_groups as torch_groups
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts

    monkeypatch.setattr(triton_quant, "quantize_groups", torch_groups)
    generator = torch.Generator().manual_seed(13)
    hidden, inter, num_experts, top_k, tokens = 256, 128, 4, 2, 6
    experts = block_experts(hidden, inter, num_experts, generator)
    shared_expert = block_experts(hidden, inter, 1, generator)[0] if shared else None
    stacked = Fp8ExpertWeights.share(experts, per_channel=True, shared=shared_expert)
    x = torch.randn(tokens, hidden, generator=generator)
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    gate = torch.randn(tokens, 1, generator=generator) if shared else None
    ids, weights = top_ids, top_weights
    if shared:
        weights = torch.cat([top_weights, torch.sigmoid(gate)], dim=1)
        ids = torch.cat([top_ids, torch.full((tokens, 1), num_experts)], dim=1)
    xq, xs = quantize_rows(x)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = (xq[t : t + 1].float() @ stacked.gate_up[e].float().T) * xs[t] * stacked.gate_up_rows[e]
            hq, hs = quantize_rows(F.silu(gu[:, :inter]) * gu[:, inter:])
            want[t] += weights[t, j] * ((hq.float() @ stacked.down[e].float().T) * hs * stacked.down_rows[e])[0]
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, shared_gate=gate)
    assert rel(got, want) <= 1e-4
    monkeypatch.setattr(triton_fp8_moe, "DECODE_TOKEN_SCALES", False)
    per_group = fp8_grouped_experts(x, top_weights, top_ids, stacked, shared_gate=gate)
    assert 1e-4 < rel(per_group, got) <= 1e-1


@needs_interpreter
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with-shared"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interpreted_decode_launches_equal_session_42s(shared, dtype, monkeypatch):
    check_decode_launches(shared, dtype, 9, torch.device("cpu"), monkeypatch)


@needs_cuda
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with-shared"])
@pytest.mark.parametrize("tokens", [1, 64])
def test_cuda_decode_launches_equal_session_42s(shared, tokens, monkeypatch):
    check_decode_launches(shared, torch.bfloat16, tokens, torch.device("cuda"), monkeypatch)


def check_decode_launches(shared: bool, dtype: torch.dtype, tokens: int, device: torch.device, monkeypatch) -> None:
    """The decode experts with the shared sort (`SHARED_SORT`) and, on CUDA, the one-launch prologue
    (`DECODE_PROLOGUE`) give the output of session 42's launches (the sort of the [T, k + 1] ids, `with_shared`
    and x's quantisation apart) bit for bit."""
    from hybridcache.kernels.gemm import triton_fp8_moe
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts

    generator = torch.Generator().manual_seed(17)
    hidden, inter, num_experts, top_k = 256, 192, 4, 2  # 192: a partial last column tile of 64
    experts = [expert.to(device) for expert in block_experts(hidden, inter, num_experts, generator)]
    shared_expert = block_experts(hidden, inter, 1, generator)[0].to(device) if shared else None
    stacked = Fp8ExpertWeights.share(experts, per_channel=True, shared=shared_expert)
    x = (torch.randn(tokens, hidden, generator=generator) * 2).to(device, dtype)
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_ids = top_ids.to(device)
    top_weights = torch.rand(tokens, top_k, generator=generator).to(device, dtype)
    gate = torch.randn(tokens, 1, generator=generator).to(device, dtype) if shared else None
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, shared_gate=gate)
    monkeypatch.setattr(triton_fp8_moe, "SHARED_SORT", False)
    monkeypatch.setattr(triton_fp8_moe, "DECODE_PROLOGUE", False)
    assert torch.equal(got, fp8_grouped_experts(x, top_weights, top_ids, stacked, shared_gate=gate))


@needs_interpreter
def test_interpreted_decode_tiles_table_picks_the_launch_per_shape(monkeypatch):
    """`fp8_tiles.DECODE_TILES`: a shape's entry (here a plain 64-row tile for gate/up, a 3-stage swap-AB tile
    for down) is the launch each GEMM runs, and the result agrees with the `DECODE_*` launch's to fp32 order."""
    from hybridcache.kernels.gemm import fp8_tiles, triton_fp8_moe
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts

    generator = torch.Generator().manual_seed(19)
    hidden, inter, num_experts, top_k, tokens = 256, 128, 4, 2, 9
    stacked = Fp8ExpertWeights.share(block_experts(hidden, inter, num_experts, generator), per_channel=True,
                                     shared=block_experts(hidden, inter, 1, generator)[0])
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator).to(torch.bfloat16)
    gate = torch.randn(tokens, 1, generator=generator).to(torch.bfloat16)
    default = fp8_grouped_experts(x, top_weights, top_ids, stacked, shared_gate=gate)
    tiles = {(2 * inter, hidden, 16): fp8_tiles.DecodeTile(64, 64, 128, 4, 4, swap_ab=False),
             (hidden, inter, 16): fp8_tiles.DecodeTile(32, 64, 128, 4, 3)}
    monkeypatch.setattr(fp8_tiles, "DECODE_TILES", tiles)
    launches = []
    launch = triton_fp8_moe.fp8_expert_gemm
    monkeypatch.setattr(triton_fp8_moe, "fp8_expert_gemm", lambda *a, **k: launches.append(k) or launch(*a, **k))
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, shared_gate=gate)
    assert [(k["block_m"], k["swap_ab"], k["num_stages"]) for k in launches] == [(64, False, 4), (32, True, 3)]
    assert rel(got.float(), default.float()) <= 2e-2
