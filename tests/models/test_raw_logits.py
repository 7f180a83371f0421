"""`HybridCausalLM.forward(raw=True)`, what a captured decode graph returns: the lm_head's output in the model's dtype,
an inference tensor that the runner widens to fp32 after each replay (`engine/runner.py`). The widening is exact, so
raw logits widened are the fp32 logits of `forward`, bit for bit; in bf16 the raw logits are the lm_head's bf16
values (the same argmax: MTP's drafts take it without widening)."""

from __future__ import annotations

import torch

from .helpers import MODEL_TYPES, PagedRunner, make_pair, random_tokens


def test_raw_logits_widened_are_the_forward_logits():
    model = make_pair(MODEL_TYPES[0]).ours
    feeds = [(0, random_tokens(157, seed=1)), (1, random_tokens(3, seed=2))]
    # two runners with the same seed: the same (garbage-filled) pools, so the same step twice
    plain_runner, raw_runner = (PagedRunner(model, 16, 8) for _ in range(2))
    plain = model(plain_runner.batch_for(feeds), plain_runner.pools, plain_runner.backend)
    raw = model(raw_runner.batch_for(feeds), raw_runner.pools, raw_runner.backend, raw=True)
    assert raw.is_inference() and not plain.is_inference()
    assert raw.shape == plain.shape == (2, model.config.vocab_size)
    assert torch.equal(raw.to(torch.float32, copy=True), plain)


def test_bf16_raw_logits_keep_the_lm_heads_dtype_and_values():
    model = make_pair(MODEL_TYPES[0]).ours.to(torch.bfloat16)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        raw, wide = model._logits(hidden, raw=True), model._logits(hidden)
    assert raw.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(raw.float(), wide)
    assert torch.equal(raw.argmax(dim=-1), wide.argmax(dim=-1))
