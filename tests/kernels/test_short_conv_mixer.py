"""LFM2's gated short convolution (`layers/short_conv.ShortConv`: B | C | x = in_proj, C * conv(B * x), out_proj; the
conv through the backend's `causal_conv1d` without activation) against transformers' `Lfm2ShortConv` on random
weights (std 1/sqrt(fan_in)), fp32, through the reference backend.

rel_err(a, ref) = max|a - ref| / max|ref|. Several sequences of different lengths in one varlen step from slots that
hold garbage; a prefill continued from its saved state; decode steps; with and without biases, 3 and 4 taps.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.layers.short_conv import ShortConv
from hybridcache.models.random_weights import randomize_

from .mixer_checks import HIDDEN, TOLERANCE, check_varlen_step, hf_out, inputs, rel_err
from .mixer_runner import MixerRunner

GEOMETRIES = {"K3-bias": (3, True), "K4-nobias": (4, False)}  # taps (conv_L_cache), conv_bias


def hf_layer(kernel: int, bias: bool):
    import transformers
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    config = transformers.Lfm2Config(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, layer_types=["conv"], conv_L_cache=kernel, conv_bias=bias,
                                     vocab_size=32)
    layer = Lfm2ShortConv(config, 0).eval()
    randomize_(layer, 0)
    mixer = ShortConv(HIDDEN, conv_kernel_size=kernel, bias=bias)
    mixer.load_state_dict(layer.state_dict())
    return layer, mixer.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=list(GEOMETRIES), ids=list(GEOMETRIES))
def pair(request):
    return hf_layer(*GEOMETRIES[request.param])


def test_varlen_step_of_several_sequences_equals_transformers(pair):
    check_varlen_step(*pair, (157, 1, 2, 90))  # (a 2-token prompt: shorter than the conv's window)


def test_prefill_from_a_saved_state_and_decode_steps_equal_the_whole_prefill(pair):
    layer, mixer = pair
    x, other = inputs(170, seed=3), inputs(160, seed=4)
    want, want_other = hf_out(layer, x), hf_out(layer, other)
    runner = MixerRunner(mixer, 2)
    first, _ = runner.step([(0, x[:77]), (1, other[:150])])
    (second,) = runner.step([(0, x[77:78])])  # one token continuing a prefill, then the rest
    (third,) = runner.step([(0, x[78:])])
    assert rel_err(first, want[:77]) <= TOLERANCE
    assert rel_err(torch.cat([second, third]), want[77:]) <= TOLERANCE
    for pos in range(150, 156):  # decode rows
        (ours,) = runner.step([(1, other[pos : pos + 1])])
        assert rel_err(ours, want_other[pos : pos + 1]) <= TOLERANCE, pos


def test_the_comparison_notices_a_lost_state(pair):
    """Wiping the conv state between two chunks moves the first outputs after it past the tolerance."""
    layer, mixer = pair
    x = inputs(120, seed=8)
    want = hf_out(layer, x)
    runner = MixerRunner(mixer, 1)
    runner.step([(0, x[:100])])
    runner.pools.layers[0]["conv"].zero_()
    (ours,) = runner.step([(0, x[100:])])
    assert rel_err(ours[:1], want[100:101]) > 100 * TOLERANCE


def test_state_spec_is_the_convs_inputs():
    _, mixer = hf_layer(3, True)
    (conv,) = mixer.state_spec(torch.bfloat16, torch.float32).tensors
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (HIDDEN, 2), torch.bfloat16)
