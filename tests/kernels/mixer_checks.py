"""What the mixer-vs-transformers tests share (test_mamba2_mixer.py, test_mamba1_mixer.py, test_olmo_deltanet_mixer.py,
test_short_conv_mixer.py): the error measure, the inputs, transformers' output of one sequence, and the checks the
recurrent mixers run alike through `MixerRunner` (each sequence from a slot that holds garbage).

rel_err(a, ref) = max|a - ref| / max|ref|; every check asks for at most `TOLERANCE` (fp32 on both sides).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.kernels.mixer_runner import MixerRunner

TOLERANCE = 1e-4
HIDDEN = 48  # every mixer's hidden size


def rel_err(ours: torch.Tensor, want: torch.Tensor) -> float:
    return ((ours.float() - want.float()).abs().max() / want.float().abs().max()).item()


@torch.no_grad()
def hf_out(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' `layer` on one sequence: hidden [n, HIDDEN] -> [n, HIDDEN]."""
    return layer(hidden[None])[0]


def inputs(length: int, seed: int) -> torch.Tensor:
    """Random hidden states [length, HIDDEN] of `seed`."""
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def check_varlen_step(layer: nn.Module, mixer: nn.Module, lengths: tuple[int, ...]) -> None:
    """Sequences of `lengths` in one varlen step, each equal to transformers' output of it alone."""
    hidden = [inputs(n, seed=i) for i, n in enumerate(lengths)]
    outputs = MixerRunner(mixer, len(lengths)).step(list(enumerate(hidden)))
    for i, (ours, x) in enumerate(zip(outputs, hidden, strict=True)):
        assert rel_err(ours, hf_out(layer, x)) <= TOLERANCE, f"sequence {i}"


def check_prefill_from_a_saved_state(layer: nn.Module, mixer: nn.Module) -> None:
    """A 77-token prefill (beside another sequence), then the rest from its saved state, equals the whole prefill."""
    x = inputs(170, seed=3)
    want = hf_out(layer, x)
    runner = MixerRunner(mixer, 2)
    first, _ = runner.step([(0, x[:77]), (1, inputs(20, seed=4))])
    (second,) = runner.step([(0, x[77:])])
    assert rel_err(first, want[:77]) <= TOLERANCE
    assert rel_err(second, want[77:]) <= TOLERANCE


def check_decode_steps(layer: nn.Module, mixer: nn.Module) -> None:
    """Two sequences prefilled to 150 tokens, then eight decode steps of both and a 2-token chunk each, equal the
    whole prefills' last rows."""
    x, other = inputs(160, seed=5), inputs(160, seed=6)
    want, want_other = hf_out(layer, x), hf_out(layer, other)
    runner = MixerRunner(mixer, 2)
    runner.step([(0, x[:150]), (1, other[:150])])
    for pos in range(150, 158):  # two decode rows batched through the step kernel
        ours, ours_other = runner.step([(0, x[pos : pos + 1]), (1, other[pos : pos + 1])])
        assert rel_err(ours, want[pos : pos + 1]) <= TOLERANCE, pos
        assert rel_err(ours_other, want_other[pos : pos + 1]) <= TOLERANCE, pos
    ours, ours_other = runner.step([(0, x[158:]), (1, other[158:])])  # 2-token chunks, continuing
    assert rel_err(ours, want[158:]) <= TOLERANCE and rel_err(ours_other, want_other[158:]) <= TOLERANCE


def check_a_lost_ssm_state_is_noticed(layer: nn.Module, mixer: nn.Module) -> None:
    """Sanity check of the set-up: wiping the recurrent ("ssm") state between two chunks moves the output far past
    the tolerance, so a broken state could not pass the checks above."""
    x = inputs(150, seed=8)
    want = hf_out(layer, x)
    runner = MixerRunner(mixer, 1)
    runner.step([(0, x[:100])])
    runner.pools.layers[0]["ssm"].zero_()
    (ours,) = runner.step([(0, x[100:])])
    assert rel_err(ours, want[100:]) > 100 * TOLERANCE
