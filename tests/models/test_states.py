"""The DeltaNet states in our pools equal transformers' cache states after the same tokens.

transformers' DynamicCache keeps, per DeltaNet layer, conv_states [1, C, K] (the last K pre-conv inputs)
and recurrent_states [1, Hv, Dk, Dv]; our pools keep conv [slot] = [C, K-1] (the last K-1 inputs) and
ssm [slot] = [Hv, Dk, Dv]. So ours must equal hf_conv[0, :, 1:] and hf_recurrent[0].
"""

from __future__ import annotations

import pytest
import torch

from .helpers import MODEL_TYPES, PagedRunner, make_pair, random_tokens, rel_err

STATE_TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request):
    return make_pair(request.param)


def hf_states_after(pair, tokens: list[int], chunk_lens: list[int]):
    """Run transformers incrementally over `tokens` in chunks; return its DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=pair.hf_config)
    start = 0
    with torch.no_grad():
        for length in chunk_lens:
            ids = torch.tensor([tokens[start : start + length]])
            positions = torch.arange(start, start + length)[None]
            pair.hf(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            start += length
    assert start == len(tokens)
    return cache


def assert_states_equal(pair, runner: PagedRunner, cache, seq: int) -> None:
    config = pair.ours.config
    slot = runner.slots[seq]
    for layer_id in config.linear_layer_ids:
        hf_layer = cache.layers[layer_id]
        hf_conv, hf_ssm = hf_layer.conv_states[0][0], hf_layer.recurrent_states[0][0]
        assert hf_conv.shape[-1] == config.gated_delta.conv_kernel_size
        state = runner.pools.layers[layer_id]
        ours_conv, ours_ssm = state["conv"][slot], state["ssm"][slot]
        assert rel_err(ours_conv, hf_conv[:, 1:]) <= STATE_TOLERANCE, f"conv state, layer {layer_id}"
        assert rel_err(ours_ssm, hf_ssm) <= STATE_TOLERANCE, f"recurrent state, layer {layer_id}"


@pytest.mark.parametrize("num_tokens", [37, 100, 157, 193])
def test_states_after_a_chunked_prefill(pair, num_tokens):
    tokens = random_tokens(num_tokens, seed=num_tokens)
    first = num_tokens // 3 + 1  # our chunks differ from transformers' single call on purpose
    runner = PagedRunner(pair.ours, 16, 8)
    runner.step([(0, tokens[:first])])
    runner.step([(0, tokens[first:])])
    assert_states_equal(pair, runner, hf_states_after(pair, tokens, [num_tokens]), seq=0)


def test_states_after_decode_steps_in_a_batch(pair):
    """Two sequences in the same forwards; states checked after prefill + 1, 2 and 3 decode tokens."""
    tokens_a, tokens_b = random_tokens(80, seed=30), random_tokens(140, seed=31)
    runner = PagedRunner(pair.ours, 64, 64)
    runner.step([(0, tokens_a[:77]), (1, tokens_b[:131])])
    for extra in (1, 2, 3):
        runner.step([(1, [tokens_b[130 + extra]]), (0, [tokens_a[76 + extra]])])
        assert_states_equal(
            pair, runner, hf_states_after(pair, tokens_a[: 77 + extra], [77] + [1] * extra), 0
        )
        assert_states_equal(
            pair, runner, hf_states_after(pair, tokens_b[: 131 + extra], [131] + [1] * extra), 1
        )


def test_a_sequence_starting_at_step_zero_ignores_its_slot(pair):
    """A new sequence whose slot holds another sequence's states starts from zero state anyway."""
    tokens = random_tokens(70, seed=40)
    runner = PagedRunner(pair.ours, 16, 8, max_seqs=2)
    runner.slots[1] = runner.slots[0]  # seq 1 reuses seq 0's slot after seq 0 is done
    runner.step([(0, random_tokens(90, seed=41))])
    (ours,) = runner.step([(1, tokens)])
    assert rel_err(ours, pair.hf_logits(tokens)) <= 1e-4
    assert_states_equal(pair, runner, hf_states_after(pair, tokens, [70]), seq=1)
