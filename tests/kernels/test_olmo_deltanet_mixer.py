"""OLMo Hybrid's gated DeltaNet (`layers/gated_deltanet.SeparateGatedDeltaNet`: Qwen's mixer with separate q, k, v,
g, a, b projections, beta = 2 sigmoid(b), its gated norm's eps 1e-5) against transformers' `OlmoHybridGatedDeltaNet`
on random weights (std 1/sqrt(fan_in)), fp32, through the reference backend.

rel_err(a, ref) = max|a - ref| / max|ref|. Several sequences of different lengths in one varlen step from slots that
hold garbage; a prefill continued from its saved state; decode steps; and the allow_neg_eigval flag both ways.

The same mixer through `CudaBackend` on the CPU (`test_interpreted_cuda_backend_*`, in the child process that
`test_cuda_backend_in_a_triton_interpreter_subprocess` starts under TRITON_INTERPRET=1): the Triton conv, gates,
q / k l2norm (`qkv_prep`), decode step and gated norm kernels run interpreted at head dims that are not powers of
two (OLMo's 12 / 24, and one head of the 7B's 96 / 192); fla's chunked forward, which does not run on the CPU, is
replaced by the reference rule per sequence (`test_leading_decodes._reference_fla_forward`), so everything around it
(state gather, fresh rows, a mixed step's leading decode rows, the state scatter) is ours.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.layers.gated_deltanet import SeparateGatedDeltaNet
from hybridcache.models.random_weights import randomize_

from .interpreter import interpreted_in_child, needs_interpreter
from .mixer_checks import HIDDEN, TOLERANCE, check_varlen_step, hf_out, inputs, rel_err
from .mixer_runner import MixerRunner
from .test_cuda_kernels import _interpreter_runs_our_kernels

GEOMETRIES = {  # key heads, value heads, key head dim, value head dim, conv kernel
    "Hk2-Hv4-Dk16-Dv8-K4": (2, 4, 16, 8, 4),
    "Hk3-Hv3-Dk12-Dv24-K3": (3, 3, 12, 24, 3),  # OLMo's own shape: value head dim 2 x key head dim, not powers of 2
}


def hf_layer(key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int, neg_eigval: bool):
    import transformers
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

    config = transformers.OlmoHybridConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, layer_types=["linear_attention",
        "full_attention"], linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=key_dim, linear_value_head_dim=value_dim, linear_conv_kernel_dim=kernel,
        linear_allow_neg_eigval=neg_eigval, vocab_size=32, pad_token_id=0, eos_token_id=1)
    layer = OlmoHybridGatedDeltaNet(config, 0).eval()
    randomize_(layer, 0)
    with torch.no_grad():
        layer.o_norm.weight.copy_(1 + 0.1 * torch.randn(layer.o_norm.weight.shape))
    mixer = SeparateGatedDeltaNet(HIDDEN, num_k_heads=key_heads, num_v_heads=value_heads, k_head_dim=key_dim,
                                  v_head_dim=value_dim, conv_kernel_size=kernel, eps=1e-5,
                                  beta_scale=2.0 if neg_eigval else 1.0)
    mixer.load_state_dict(layer.state_dict())
    return layer, mixer.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=[(g, n) for g in GEOMETRIES for n in (True, False)],
                ids=[f"{g}-{'neg' if n else 'pos'}" for g in GEOMETRIES for n in (True, False)])
def pair(request):
    geometry, neg_eigval = request.param
    return hf_layer(*GEOMETRIES[geometry], neg_eigval)


def test_varlen_step_of_several_sequences_equals_transformers(pair):
    check_varlen_step(*pair, (157, 1, 64, 90))


def test_prefill_from_a_saved_state_and_decode_steps_equal_the_whole_prefill(pair):
    layer, mixer = pair
    x, other = inputs(170, seed=3), inputs(160, seed=4)
    want, want_other = hf_out(layer, x), hf_out(layer, other)
    runner = MixerRunner(mixer, 2)
    first, _ = runner.step([(0, x[:77]), (1, other[:150])])
    assert rel_err(first, want[:77]) <= TOLERANCE
    (second,) = runner.step([(0, x[77:])])
    assert rel_err(second, want[77:]) <= TOLERANCE
    for pos in range(150, 156):  # decode rows
        (ours,) = runner.step([(1, other[pos : pos + 1])])
        assert rel_err(ours, want_other[pos : pos + 1]) <= TOLERANCE, pos


def test_the_flag_decides_beta():
    """The same weights with and without allow_neg_eigval give different outputs (beta in (0, 2) vs (0, 1)), and
    ours follows the flag: a beta left unscaled would fail the comparisons above."""
    layer, mixer = hf_layer(*GEOMETRIES["Hk2-Hv4-Dk16-Dv8-K4"], True)
    x = inputs(150, seed=9)
    (scaled,) = MixerRunner(mixer, 1).step([(0, x)])
    mixer.beta_scale = 1.0
    (unscaled,) = MixerRunner(mixer, 1).step([(0, x)])
    layer.allow_neg_eigval = False
    assert rel_err(unscaled, hf_out(layer, x)) <= TOLERANCE
    assert rel_err(scaled, unscaled) > 100 * TOLERANCE


def test_state_spec_is_qwens():
    _, mixer = hf_layer(*GEOMETRIES["Hk2-Hv4-Dk16-Dv8-K4"], True)
    conv, ssm = mixer.state_spec(torch.bfloat16, torch.float32).tensors
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (2 * 32 + 32, 3), torch.bfloat16)
    assert (ssm.name, ssm.shape, ssm.dtype) == ("ssm", (4, 16, 8), torch.float32)


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
@interpreted_in_child("interpreted")
def test_cuda_backend_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@pytest.mark.parametrize("geometry", ["Hk3-Hv3-Dk12-Dv24-K3", "Hk1-Hv1-Dk96-Dv192-K4"])
@pytest.mark.parametrize("neg_eigval", [True, False], ids=["neg", "pos"])
def test_interpreted_cuda_backend_equals_transformers(geometry: str, neg_eigval: bool, monkeypatch) -> None:
    """Prefill chunks, a prefill continued beside a decode row that leads the step (beta in (0, 1): the step kernel
    makes that row's gates, `fla.mixed_gated_delta_rule`; in (0, 2): the gates, then the rule, fla's for the whole
    step), then all-decode steps (the step kernel), each against transformers on the whole sequence."""
    from hybridcache.kernels.attention.triton_backend import TritonAttention
    from hybridcache.kernels.cuda_backend import CudaBackend

    from .fake_fla import install_fake_fla
    from .test_leading_decodes import _reference_fla_forward

    install_fake_fla(monkeypatch, _reference_fla_forward)
    shape = GEOMETRIES.get(geometry) or (1, 1, 96, 192, 4)
    layer, mixer = hf_layer(*shape, neg_eigval)
    x, other = inputs(160, seed=5), inputs(158, seed=6)
    want, want_other = hf_out(layer, x), hf_out(layer, other)
    runner = MixerRunner(mixer, 2, backend=CudaBackend(TritonAttention()))
    first, first_other = runner.step([(0, x[:70]), (1, other[:150])])
    assert rel_err(first, want[:70]) <= TOLERANCE and rel_err(first_other, want_other[:150]) <= TOLERANCE
    lead, rest = runner.step([(1, other[150:151]), (0, x[70:150])])
    assert rel_err(lead, want_other[150:151]) <= TOLERANCE and rel_err(rest, want[70:150]) <= TOLERANCE
    for pos in range(150, 157):  # decode rows
        ours, ours_other = runner.step([(0, x[pos:pos + 1]), (1, other[pos + 1:pos + 2])])
        assert rel_err(ours, want[pos:pos + 1]) <= TOLERANCE, pos
        assert rel_err(ours_other, want_other[pos + 1:pos + 2]) <= TOLERANCE, pos
