"""The Mamba2 mixer (`layers/mamba2.py`) and its scan (`kernels/mamba2/reference.py`) against transformers' torch path
(`GraniteMoeHybridMambaLayer`, `mamba2_chunk_scan`, `mamba2_selective_state_update`) on random weights (std
1/sqrt(fan_in)), fp32; and Falcon-H1's variant of it (`FalconH1Mixer`: its muP vector on in_proj's output, the gated
norm before or after the gate or none at all, out_proj's own bias).

rel_err(a, ref) = max|a - ref| / max|ref|. Several sequences of different lengths run in one varlen step, from slots
that hold garbage (a fresh sequence must not read its row); state continuation: prefill A, then B from A's state,
equals prefill A+B; decode steps equal the full prefill's last rows.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.mamba2 import reference as ref
from hybridcache.layers.mamba2 import Mamba2Mixer
from hybridcache.models.random_weights import randomize_
from tests.kernels.mixer_checks import (
    HIDDEN,
    TOLERANCE,
    check_a_lost_ssm_state_is_noticed,
    check_decode_steps,
    check_prefill_from_a_saved_state,
    check_varlen_step,
    hf_out,
    inputs,
    rel_err,
)
from tests.kernels.mixer_runner import MixerRunner

GEOMETRIES = {  # heads, head dim, groups, state size, conv kernel (heads x head dim = 2 x HIDDEN: mamba_expand 2)
    "H8-P12-G2-N16-K4": (8, 12, 2, 16, 4),
    "H4-P24-G1-N8-K3": (4, 24, 1, 8, 3),
}


def hf_layer(heads: int, head_dim: int, groups: int, state: int, kernel: int, seed: int = 0):
    import transformers
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    config = transformers.GraniteMoeHybridConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, layer_types=["mamba"], mamba_n_heads=heads,
        mamba_d_head=head_dim, mamba_expand=heads * head_dim // HIDDEN, mamba_n_groups=groups, mamba_d_state=state,
        mamba_d_conv=kernel, mamba_chunk_size=32, rms_norm_eps=1e-5)
    layer = GraniteMoeHybridMambaLayer(config, 0).eval()
    randomize_(layer, seed)
    with torch.no_grad():
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(layer.norm.weight.shape))
    return config, layer


# Falcon-H1's mixer: the norm (mamba_rms_norm, mamba_norm_before_gate), biases (mamba_proj_bias: in_proj,
# projectors_bias: out_proj); heads x head dim = mamba_d_ssm (96 or 72, not 2 x HIDDEN); its five ssm_multipliers
# away from 1 (the layer applies ssm_in_multiplier, tests/models/test_falcon_h1.py)
FALCON_MIXERS = {
    "falcon-norm-first": {"mamba_rms_norm": True, "mamba_norm_before_gate": True, "mamba_n_heads": 8,
                          "mamba_d_ssm": 96, "mamba_n_groups": 2, "projectors_bias": True},
    "falcon-gate-first": {"mamba_rms_norm": True, "mamba_norm_before_gate": False, "mamba_n_heads": 6,
                          "mamba_d_ssm": 72, "mamba_n_groups": 3, "mamba_proj_bias": True},
    "falcon-no-norm": {"mamba_rms_norm": False, "mamba_n_heads": 8, "mamba_d_ssm": 96, "mamba_n_groups": 1,
                       "mamba_conv_bias": False},
}
SSM_MULTIPLIERS = [0.5, 1.7, 0.3, 2.2, 0.6]  # z, x, B, C, dt


def falcon_layer(variant: str, seed: int = 0):
    import transformers
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

    config = transformers.FalconH1Config(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=32, rms_norm_eps=1e-5, ssm_multipliers=SSM_MULTIPLIERS, **FALCON_MIXERS[variant])
    layer = FalconH1Mixer(config, 0).eval()
    layer.register_buffer("mup_vector", compute_mup_vector(config), persistent=False)  # (FalconH1Model's doing)
    randomize_(layer, seed)
    if config.mamba_rms_norm:
        with torch.no_grad():
            layer.norm.weight.copy_(1 + 0.1 * torch.randn(layer.norm.weight.shape))
    return config, layer


def our_mixer(config, layer) -> Mamba2Mixer:
    falcon = {} if config.model_type != "falcon_h1" else {
        "rms_norm": config.mamba_rms_norm, "norm_before_gate": config.mamba_norm_before_gate,
        "out_proj_bias": config.projectors_bias, "in_multipliers": tuple(config.ssm_multipliers)}
    mixer = Mamba2Mixer(
        HIDDEN, num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head, num_groups=config.mamba_n_groups,
        state_size=config.mamba_d_state, conv_kernel_size=config.mamba_d_conv, conv_bias=config.mamba_conv_bias,
        proj_bias=config.mamba_proj_bias, eps=config.rms_norm_eps, **falcon)
    mixer.load_state_dict(layer.state_dict())
    mixer.fold_multipliers_()  # (what the model's after_loading_ does)
    return mixer.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=[*GEOMETRIES, *FALCON_MIXERS])
def pair(request):
    if request.param in FALCON_MIXERS:
        config, layer = falcon_layer(request.param)
    else:
        config, layer = hf_layer(*GEOMETRIES[request.param])
    return layer, our_mixer(config, layer)


def test_state_spec_declares_conv_and_ssm_in_transformers_layout():
    config, layer = hf_layer(*GEOMETRIES["H8-P12-G2-N16-K4"])
    spec = our_mixer(config, layer).state_spec(torch.bfloat16, torch.float32)
    (conv, ssm) = spec.tensors
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (layer.conv_dim, 3), torch.bfloat16)
    assert (ssm.name, ssm.shape, ssm.dtype) == ("ssm", (8, 12, 16), torch.float32)


def test_varlen_step_of_several_sequences_equals_transformers(pair):
    check_varlen_step(*pair, (157, 1, 64, 90))  # a single-token prompt, a chunk-aligned one, longer than a chunk


def test_prefill_from_a_saved_state_equals_the_whole_prefill(pair):
    check_prefill_from_a_saved_state(*pair)


def test_decode_steps_equal_the_whole_prefill(pair):
    check_decode_steps(*pair)


def test_the_comparison_notices_a_lost_state(pair):
    check_a_lost_ssm_state_is_noticed(*pair)


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.5)], ids=["no-limit", "clamped"])
def test_chunk_scan_equals_transformers_scan_and_the_step_form(limit):
    """`ssd_chunk_scan` vs transformers' `mamba2_chunk_scan` (its own chunk size, from an initial state) and vs
    `ssd_step` token by token: outputs and final states."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    g = torch.Generator().manual_seed(0)
    length, heads, head_dim, groups, state = 150, 6, 5, 3, 7
    x = torch.randn(length, heads, head_dim, generator=g)
    dt_raw = torch.randn(length, heads, generator=g)
    dt_bias, D = torch.rand(heads, generator=g) - 0.5, torch.randn(heads, generator=g)  # noqa: N806
    A = -torch.empty(heads).uniform_(0.05, 1.0, generator=g)  # noqa: N806
    B, C = torch.randn(length, groups, state, generator=g), torch.randn(length, groups, state, generator=g)  # noqa: N806
    initial = torch.randn(heads, head_dim, state, generator=g)
    dt = ref.discretized_dt(dt_raw, dt_bias, limit)
    y, final = ref.ssd_chunk_scan(x, dt, A, B, C, D, initial)
    want_y, want_final = mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk_size=32, D=D,
                                           dt_bias=dt_bias, initial_states=initial[None], dt_softplus=True,
                                           dt_limit=limit, return_final_states=True)
    assert rel_err(y, want_y[0]) <= TOLERANCE and rel_err(final, want_final[0]) <= TOLERANCE
    steps_y, states = ref.ssd_states_after(x, dt, A, B, C, D, initial)
    assert rel_err(steps_y, y) <= TOLERANCE and rel_err(states[-1], final) <= TOLERANCE


def test_falcon_mixer_without_its_mup_vector_would_fail():
    """The muP vector matters: the same mixer without `in_multipliers` (or without the norm order, or with a norm it
    does not have) is far from transformers' FalconH1Mixer, so the tests above check them."""
    config, layer = falcon_layer("falcon-norm-first")
    x = inputs(120, seed=9)
    want = hf_out(layer, x)
    assert rel_err(MixerRunner(our_mixer(config, layer), 1).step([(0, x)])[0], want) <= TOLERANCE
    for wrong in ({"ssm_multipliers": [1.0] * 5}, {"mamba_norm_before_gate": False}):
        mixer = our_mixer(transformers_config(config, **wrong), layer)
        assert rel_err(MixerRunner(mixer, 1).step([(0, x)])[0], want) > 100 * TOLERANCE, wrong


def transformers_config(config, **changes):
    import transformers

    return transformers.FalconH1Config(**{**config.to_dict(), **changes})


def test_gated_norm_after_the_norm_is_falcons():
    """`norm_before_gate`: weight * group_norm(x) * silu(gate), transformers' FalconH1RMSNormGated's default."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    g = torch.Generator().manual_seed(2)
    x, gate = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g)
    for before in (True, False):
        norm = FalconH1RMSNormGated(24, eps=1e-5, n_groups=3, norm_before_gate=before)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(24, generator=g))
            want = norm(x, gate)
        ours = ref.gated_group_rms_norm(x, gate, norm.weight, 1e-5, 8, norm_before_gate=before)
        assert rel_err(ours, want) <= 1e-6, before


def test_gated_norm_puts_the_gate_before_a_per_group_norm():
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridRMSNormGated

    g = torch.Generator().manual_seed(1)
    x, gate = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g)
    norm = GraniteMoeHybridRMSNormGated(24, group_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
        want = norm(x, gate)
    assert rel_err(ref.gated_group_rms_norm(x, gate, norm.weight, 1e-5, 8), want) <= 1e-6
