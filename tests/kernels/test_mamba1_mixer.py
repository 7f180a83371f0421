"""Jamba's Mamba1 mixer (`layers/mamba1.py`) and its scan (`kernels/mamba1/reference.py`) against transformers' torch
path (`JambaMambaMixer`, `mamba_selective_scan`, `mamba_selective_state_update`) on random weights (std
1/sqrt(fan_in); the dt / B / C norms' weights 1 + N(0, 0.1)), fp32.

rel_err(a, ref) = max|a - ref| / max|ref|. Several sequences of different lengths run in one varlen step, from slots
that hold garbage (a fresh sequence must not read its row); state continuation: prefill A, then B from A's state,
equals prefill A+B; decode steps equal the full prefill's last rows; verify rows keep the state after each draft.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.kernels.mamba1 import reference as ref
from hybridcache.kernels.mamba2.reference import discretized_dt
from hybridcache.layers.mamba1 import Mamba1Mixer
from hybridcache.models.random_weights import randomize_
from tests.kernels.mixer_checks import (
    HIDDEN,
    TOLERANCE,
    check_a_lost_ssm_state_is_noticed,
    check_decode_steps,
    check_prefill_from_a_saved_state,
    check_varlen_step,
    inputs,
    rel_err,
)
from tests.kernels.mixer_runner import MixerRunner

GEOMETRIES = {  # mamba_expand, d_state, dt_rank, d_conv, conv bias, in/out_proj bias
    "E2-N16-R6-K4": (2, 16, 6, 4, True, False),
    "E1-N8-R3-K3-biases": (1, 8, 3, 3, False, True),
}
NO_LIMIT = (0.0, float("inf"))


def hf_layer(expand: int, state: int, rank: int, kernel: int, conv_bias: bool, proj_bias: bool, seed: int = 0):
    import transformers
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    config = transformers.JambaConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, mamba_expand=expand,
        mamba_d_state=state, mamba_dt_rank=rank, mamba_d_conv=kernel, mamba_conv_bias=conv_bias,
        mamba_proj_bias=proj_bias, rms_norm_eps=1e-5, attn_layer_period=2, attn_layer_offset=1)
    layer = JambaMambaMixer(config, 0).eval()
    randomize_(layer, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for norm in (layer.dt_layernorm, layer.b_layernorm, layer.c_layernorm):
            norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=generator))
    return config, layer


def our_mixer(config, layer) -> Mamba1Mixer:
    mixer = Mamba1Mixer(
        HIDDEN, intermediate_size=config.mamba_expand * HIDDEN, state_size=config.mamba_d_state,
        dt_rank=config.mamba_dt_rank, conv_kernel_size=config.mamba_d_conv, conv_bias=config.mamba_conv_bias,
        proj_bias=config.mamba_proj_bias, eps=config.rms_norm_eps)
    mixer.load_state_dict(layer.state_dict())
    return mixer.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=list(GEOMETRIES), ids=list(GEOMETRIES))
def pair(request):
    config, layer = hf_layer(*GEOMETRIES[request.param])
    return layer, our_mixer(config, layer)


def test_state_spec_declares_conv_and_ssm_in_transformers_layout():
    config, layer = hf_layer(*GEOMETRIES["E2-N16-R6-K4"])
    spec = our_mixer(config, layer).state_spec(torch.bfloat16, torch.float32)
    (conv, ssm) = spec.tensors
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (2 * HIDDEN, 3), torch.bfloat16)
    assert (ssm.name, ssm.shape, ssm.dtype) == ("ssm", (2 * HIDDEN, 16), torch.float32)
    assert set(layer.state_dict()) == set(our_mixer(config, layer).state_dict())  # the checkpoint's names


def test_varlen_step_of_several_sequences_equals_transformers(pair):
    check_varlen_step(*pair, (157, 1, 64, 90))  # a single-token prompt, a block of 64, longer than the scan's block


def test_prefill_from_a_saved_state_equals_the_whole_prefill(pair):
    check_prefill_from_a_saved_state(*pair)


def test_decode_steps_equal_the_whole_prefill(pair):
    check_decode_steps(*pair)


def test_decode_equals_transformers_incremental_forward(pair):
    """transformers' own decode path (`mamba_selective_state_update` on its cache) after a 150-token prefill."""
    from transformers import DynamicCache

    layer, mixer = pair
    x = inputs(156, seed=9)
    runner = MixerRunner(mixer, 1)
    runner.step([(0, x[:150])])
    cache = DynamicCache(config=layer.config)
    with torch.no_grad():
        layer(x[None, :150], cache=cache)
        for pos in range(150, 156):
            want = layer(x[None, pos : pos + 1], cache=cache)[0]
            (ours,) = runner.step([(0, x[pos : pos + 1])])
            assert rel_err(ours, want) <= TOLERANCE, pos


def test_the_comparison_notices_a_lost_state(pair):
    check_a_lost_ssm_state_is_noticed(*pair)


def scan_inputs(length: int, channels: int = 12, state: int = 7, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(length, channels, generator=g), "dt_raw": torch.randn(length, channels, generator=g),
            "dt_bias": torch.rand(channels, generator=g) - 0.5,
            "A": -torch.empty(channels, state).uniform_(0.05, 2.0, generator=g),
            "B": torch.randn(length, state, generator=g), "C": torch.randn(length, state, generator=g),
            "D": torch.randn(channels, generator=g), "z": torch.randn(length, channels, generator=g),
            "initial": torch.randn(channels, state, generator=g)}


@pytest.mark.parametrize("gated", [True, False], ids=["gate", "no-gate"])
def test_scan_equals_transformers_scan_the_step_form_and_every_state(gated):
    """`selective_scan` (150 tokens, crossing its 64-token blocks) vs transformers' `mamba_selective_scan` (from zero
    state: it takes none) and `mamba_selective_state_update` token by token from an initial state; and
    `selective_states_after` keeps each of those states."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan, mamba_selective_state_update

    s = scan_inputs(150)
    z = s["z"] if gated else None
    dt = discretized_dt(s["dt_raw"], s["dt_bias"], NO_LIMIT)
    y, final = ref.selective_scan(s["x"], dt, s["A"], s["B"], s["C"], s["D"], z)
    want_y, want_final = mamba_selective_scan(
        s["x"].T[None], s["dt_raw"].T[None], s["A"], s["B"].T[None], s["C"].T[None], D=s["D"],
        z=None if z is None else z.T[None], delta_bias=s["dt_bias"], delta_softplus=True, return_last_state=True)
    assert rel_err(y, want_y[0].T) <= TOLERANCE and rel_err(final, want_final[0]) <= TOLERANCE

    y, final = ref.selective_scan(s["x"], dt, s["A"], s["B"], s["C"], s["D"], z, s["initial"])
    state, want_rows, want_states = s["initial"][None].clone(), [], []
    for t in range(150):
        want_rows.append(mamba_selective_state_update(
            state, s["x"][t : t + 1], s["dt_raw"][t : t + 1], s["A"], s["B"][t : t + 1], s["C"][t : t + 1], s["D"],
            z=None if z is None else z[t : t + 1], dt_bias=s["dt_bias"], dt_softplus=True)[0])
        want_states.append(state[0].clone())
    assert rel_err(y, torch.stack(want_rows)) <= TOLERANCE and rel_err(final, state[0]) <= TOLERANCE
    steps_y, states = ref.selective_states_after(s["x"], dt, s["A"], s["B"], s["C"], s["D"], z, s["initial"])
    assert rel_err(steps_y, y) <= TOLERANCE and rel_err(states, torch.stack(want_states)) <= TOLERANCE


def test_the_scans_worked_example():
    """The module docstring's example: I = 1, N = 2, A = (-1, -2), dt = x = 1, B = (1, 1), C = (1, 0), D = 0.5."""
    one = torch.ones(2, 1)
    y, state = ref.selective_scan(one, one, torch.tensor([[-1.0, -2.0]]), torch.ones(2, 2),
                                  torch.tensor([[1.0, 0.0]] * 2), torch.tensor([0.5]), None)
    e = torch.exp(torch.tensor(1.0))
    torch.testing.assert_close(y[:, 0], torch.stack([torch.tensor(1.5), 1 / e + 1.5]))
    torch.testing.assert_close(state[0], torch.stack([1 / e + 1, 1 / e**2 + 1]))


def test_verify_rows_keep_the_state_after_each_draft():
    """A verify row (speculative decoding: 1 + k tokens, k draft slots) through `ReferenceBackend.selective_scan`:
    its outputs equal a plain continuation's, the state after each of its first k positions lands in its draft
    rows and the final one in its slot, beside a plain decode row and a prefill."""
    channels, state_size = 12, 7
    s = scan_inputs(4 + 1 + 30, channels, state_size, seed=2)
    chunks = [SeqChunk([1] * 4, 40, [0] * 8, 1), SeqChunk([1], 9, [0] * 8, 2), SeqChunk([1] * 30, 0, [0] * 8, 3)]
    batch = build_forward_batch(chunks, block_size=16, kernel_block_size=16)
    verify = dataclasses.replace(batch, draft_slots_cpu=((5, 6, 7), (), ()), draft_slots=torch.tensor([5, 6, 7]),
                                 draft_rows=torch.tensor([0, 1, 2]))
    initial = torch.randn(8, channels, state_size, generator=torch.Generator().manual_seed(3))
    pool, plain_pool = initial.clone(), initial.clone()
    args = (s["x"], s["dt_raw"], s["B"], s["C"], (-s["A"]).log(), s["dt_bias"], s["D"], s["z"])
    got = ReferenceBackend().selective_scan(*args, pool, ReferenceBackend().prepare(verify))
    want = ReferenceBackend().selective_scan(*args, plain_pool, ReferenceBackend().prepare(batch))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 2, 3]], plain_pool[[1, 2, 3]], rtol=1e-5, atol=1e-5)
    dt = discretized_dt(s["dt_raw"], s["dt_bias"], NO_LIMIT)
    _, states = ref.selective_states_after(s["x"][:4], dt[:4], s["A"], s["B"][:4], s["C"][:4], s["D"], s["z"][:4],
                                           initial[1])
    torch.testing.assert_close(pool[[5, 6, 7]], states[:3], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(pool[5], pool[6])  # (distinct states: the check above can fail)
