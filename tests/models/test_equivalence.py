"""Our models vs transformers on tiny random models (weights at std 1/sqrt(fan_in)), fp32.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over
the whole sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import pytest
import torch

from .helpers import MODEL_TYPES, TOLERANCE, PagedRunner, make_pair, random_tokens, rel_err

BLOCK_GEOMETRIES = [(16, 8), (64, 64)]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("block_size,kernel_block_size", BLOCK_GEOMETRIES, ids=["B16-k8", "B64-k64"])
def test_single_prefill(pair, block_size, kernel_block_size):
    tokens = random_tokens(157, seed=1)
    runner = PagedRunner(pair.ours, block_size, kernel_block_size)
    (ours,) = runner.step([(0, tokens)])
    assert rel_err(ours, pair.hf_logits(tokens)) <= TOLERANCE


@pytest.mark.parametrize("block_size,kernel_block_size", BLOCK_GEOMETRIES, ids=["B16-k8", "B64-k64"])
def test_chunked_prefill(pair, block_size, kernel_block_size):
    tokens = random_tokens(157, seed=2)
    ref = pair.hf_logits(tokens)
    runner = PagedRunner(pair.ours, block_size, kernel_block_size)
    start = 0
    for length in (37, 50, 70):  # uneven, not block aligned; the last one crosses the 64-token chunk
        (ours,) = runner.step([(0, tokens[start : start + length])])
        assert rel_err(ours, ref[start : start + length]) <= TOLERANCE, f"chunk at {start}"
        start += length


def test_decode_after_prefill_matches_full_and_incremental_forward(pair):
    from transformers import DynamicCache

    tokens = random_tokens(160, seed=3)
    prompt_len = 150
    ref = pair.hf_logits(tokens)
    runner = PagedRunner(pair.ours, 16, 8)
    runner.step([(0, tokens[:prompt_len])])
    cache = DynamicCache(config=pair.hf_config)
    with torch.no_grad():
        pair.hf(
            input_ids=torch.tensor([tokens[:prompt_len]]),
            position_ids=torch.arange(prompt_len)[None],
            cache=cache,
            use_cache=True,
        )
    for pos in range(prompt_len, len(tokens)):
        (ours,) = runner.step([(0, [tokens[pos]])])
        with torch.no_grad():
            incremental = (
                pair.hf(
                    input_ids=torch.tensor([[tokens[pos]]]),
                    position_ids=torch.tensor([[pos]]),
                    cache=cache,
                    use_cache=True,
                )
                .logits[0]
                .float()
            )
        assert rel_err(ours, ref[pos : pos + 1]) <= TOLERANCE, f"decode at {pos} vs full forward"
        assert rel_err(ours, incremental) <= TOLERANCE, f"decode at {pos} vs incremental forward"


def test_mixed_batch_of_prefill_chunks_and_decodes(pair):
    """Four sequences step together; every step mixes prefill chunks, decode tokens and a new arrival."""
    seqs = {
        0: random_tokens(170, seed=10),
        1: random_tokens(110, seed=11),
        2: random_tokens(70, seed=12),
        3: random_tokens(10, seed=13),
    }
    refs = {seq: pair.hf_logits(tokens) for seq, tokens in seqs.items()}
    schedule = [  # (seq, number of new tokens) per step
        [(0, 70), (1, 100)],
        [(0, 1), (1, 1), (2, 45)],  # seq 0 decodes early: only its prompt's first 70 tokens are in
        [(2, 15), (1, 1), (0, 80), (3, 5)],
        [(0, 19), (1, 1), (2, 1), (3, 1)],
    ]
    runner = PagedRunner(pair.ours, 16, 8, max_seqs=4)
    for step_id, plan in enumerate(schedule):
        feeds = [(seq, seqs[seq][runner.fed[seq] : runner.fed[seq] + count]) for seq, count in plan]
        starts = {seq: runner.fed[seq] for seq, _ in feeds}
        outputs = runner.step(feeds)
        for (seq, tokens), ours in zip(feeds, outputs, strict=True):
            expected = refs[seq][starts[seq] : starts[seq] + len(tokens)]
            assert rel_err(ours, expected) <= TOLERANCE, f"step {step_id}, seq {seq}"


def test_default_logits_are_one_row_per_sequence_at_its_last_token(pair):
    first, second = random_tokens(90, seed=20), random_tokens(33, seed=21)
    runner = PagedRunner(pair.ours, 16, 8)
    batch = runner.batch_for([(0, first), (1, second)])
    logits = pair.ours(batch, runner.pools, runner.backend)
    assert logits.shape == (2, pair.ours.config.vocab_size) and logits.dtype == torch.float32
    expected = torch.stack([pair.hf_logits(first)[-1], pair.hf_logits(second)[-1]])
    assert rel_err(logits, expected) <= TOLERANCE


def test_the_comparison_notices_a_lost_recurrent_state(pair):
    """Sanity check of the test set-up: wiping the DeltaNet state between chunks moves the logits far
    beyond the tolerance (so a broken state would not go unnoticed)."""
    tokens = random_tokens(157, seed=4)
    ref = pair.hf_logits(tokens)
    runner = PagedRunner(pair.ours, 16, 8)
    runner.step([(0, tokens[:100])])
    for layer_id in pair.ours.config.linear_layer_ids:
        runner.pools.layers[layer_id]["ssm"].zero_()
    (ours,) = runner.step([(0, tokens[100:])])
    assert rel_err(ours, ref[100:]) > 100 * TOLERANCE


def test_forward_runs_without_autograd_and_returns_an_ordinary_tensor(pair):
    runner = PagedRunner(pair.ours, 16, 8)
    batch = runner.batch_for([(0, random_tokens(20, seed=5))])
    logits = pair.ours(batch, runner.pools, runner.backend)
    assert not logits.requires_grad and not pair.ours.training
    assert not torch.is_inference(logits)
    logits.div_(2.0)  # samplers may scale logits in place
