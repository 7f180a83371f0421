"""The model-vs-transformers checks every hybrid family's test file runs on its own `pair` fixture (a `ModelPair`:
tests/models/helpers.py): single and chunked prefill, decode against the full and the incremental forward, a mixed
batch, and that the comparison notices a lost recurrent state (every state tensor of every recurrent layer zeroed).
A test file imports them by name (pytest collects them there, with that file's `pair`): test_granite.py,
test_nemotron_h.py, test_bamba.py, test_falcon_h1.py (Mamba2), test_jamba.py (Mamba1), test_olmo_hybrid.py (gated
DeltaNet), test_lfm2.py (short convolution), test_kimi_linear.py (KDA), and test_fp8_mamba2_hybrids.py on FP8 folders.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the whole
sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import torch

from .helpers import TOLERANCE, PagedRunner, random_tokens, rel_err


def test_single_prefill_and_chunked_prefill(pair):
    tokens = random_tokens(157, seed=1)
    ref = pair.hf_logits(tokens)
    (ours,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(ours, ref) <= TOLERANCE
    runner, start = PagedRunner(pair.ours, 64, 64), 0
    for length in (37, 50, 70):  # uneven, not block aligned; the last one crosses the 64-token chunk
        (ours,) = runner.step([(0, tokens[start : start + length])])
        assert rel_err(ours, ref[start : start + length]) <= TOLERANCE, f"chunk at {start}"
        start += length


def test_decode_after_prefill_matches_full_and_incremental_forward(pair):
    from transformers import DynamicCache

    tokens = random_tokens(158, seed=3)
    prompt_len = 152
    ref = pair.hf_logits(tokens)
    runner = PagedRunner(pair.ours, 16, 8)
    runner.step([(0, tokens[:prompt_len])])
    cache = DynamicCache(config=pair.hf_config)
    with torch.no_grad():
        pair.hf(input_ids=torch.tensor([tokens[:prompt_len]]), position_ids=torch.arange(prompt_len)[None],
                cache=cache, use_cache=True)
    for pos in range(prompt_len, len(tokens)):
        (ours,) = runner.step([(0, [tokens[pos]])])
        with torch.no_grad():
            incremental = pair.hf(input_ids=torch.tensor([[tokens[pos]]]), position_ids=torch.tensor([[pos]]),
                                  cache=cache, use_cache=True).logits[0].float()
        assert rel_err(ours, ref[pos : pos + 1]) <= TOLERANCE, f"decode at {pos} vs full forward"
        assert rel_err(ours, incremental) <= TOLERANCE, f"decode at {pos} vs incremental forward"


def test_mixed_batch_of_prefill_chunks_and_decodes(pair):
    """Four sequences step together; every step mixes prefill chunks, decode tokens and a new arrival."""
    seqs = {0: random_tokens(170, seed=10), 1: random_tokens(110, seed=11), 2: random_tokens(70, seed=12),
            3: random_tokens(10, seed=13)}
    refs = {seq: pair.hf_logits(tokens) for seq, tokens in seqs.items()}
    schedule = [[(0, 70), (1, 100)], [(0, 1), (1, 1), (2, 45)], [(2, 15), (1, 1), (0, 80), (3, 5)],
                [(0, 19), (1, 1), (2, 1), (3, 1)]]
    runner = PagedRunner(pair.ours, 16, 8, max_seqs=4)
    for step_id, plan in enumerate(schedule):
        feeds = [(seq, seqs[seq][runner.fed[seq] : runner.fed[seq] + count]) for seq, count in plan]
        starts = {seq: runner.fed[seq] for seq, _ in feeds}
        for (seq, tokens), ours in zip(feeds, runner.step(feeds), strict=True):
            expected = refs[seq][starts[seq] : starts[seq] + len(tokens)]
            assert rel_err(ours, expected) <= TOLERANCE, f"step {step_id}, seq {seq}"


def test_the_comparison_notices_a_lost_recurrent_state(pair):
    tokens = random_tokens(157, seed=4)
    ref = pair.hf_logits(tokens)
    runner = PagedRunner(pair.ours, 16, 8)
    runner.step([(0, tokens[:100])])
    k, recurrent = pair.ours.states_per_layer, pair.ours.config.recurrent_layer_ids
    # (every recurrent state is a recurrent layer's, a mapping of its tensors: Nemotron-H's MLP layers hold an empty
    # one; Falcon-H1: decoder layer i holds state layers 2i, its KV, and 2i + 1)
    assert sum(isinstance(state, dict) and bool(state) for state in runner.pools.layers) == len(recurrent)
    for layer_id in recurrent:
        (state,) = [state for state in runner.pools.layers[k * layer_id : k * (layer_id + 1)]
                    if isinstance(state, dict) and state]
        for tensor in state.values():
            tensor.zero_()
    (ours,) = runner.step([(0, tokens[100:])])
    assert rel_err(ours, ref[100:]) > 100 * TOLERANCE
