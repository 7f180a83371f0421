"""Multimodal spans: embeddings injected at span positions, chunks never end inside a span, and the prefix
cache tells spans apart by content hash."""

from __future__ import annotations

import random

import pytest
import torch

from hybridcache.multimodal import MultimodalInput, placeholder_embeds
from hybridcache.sampling import SamplingParams

from .model_folders import load_hf_model, write_tiny_model
from .test_cache_equivalence import REL_TOL, make_engine, tokens

IMAGE_TOKEN = 300  # a placeholder id; the embeddings come from the span


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_5_text"), "qwen3_5_text")


def image_prompt(rng, prefix_len, image_len, suffix_len, content_hash):
    prefix = tokens(rng, prefix_len)
    prompt = prefix + [IMAGE_TOKEN] * image_len + tokens(rng, suffix_len)
    return prompt, MultimodalInput(prefix_len, prefix_len + image_len, content_hash)


def run(engine, requests):
    """requests: {request_id: (prompt, span, max_tokens)}, all queued at once; returns finished outputs."""
    for request_id, (prompt, span, max_tokens) in requests.items():
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           mm_inputs=[span])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    engine.check_integrity()
    return outputs


def test_span_embeddings_match_transformers_inputs_embeds(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=50)
    ends = []
    original = engine.scheduler.schedule

    def recording_schedule():
        output = original()
        ends.extend(c.end for c in output.chunks)
        return output

    engine.scheduler.schedule = recording_schedule
    prompt, span = image_prompt(random.Random(0), 33, 40, 90, content_hash="cat.png")
    run(engine, {"r": (prompt, span, 3)})
    assert not any(span.start < end < span.end for end in ends), ends
    hf = load_hf_model(model_dir)
    with torch.inference_mode():
        embeds = hf.get_input_embeddings()(torch.tensor([prompt]))
        embeds[0, span.start : span.end] = placeholder_embeds("cat.png", 40, embeds.shape[-1])
        logits = hf(inputs_embeds=embeds, position_ids=torch.arange(len(prompt))[None]).logits[0, -1]
    ours = engine.logits[("r", 0, len(prompt))]
    assert (ours - logits).abs().max() / logits.abs().max() <= REL_TOL


def test_cache_hits_across_the_same_image_and_misses_across_a_different_one(model_dir):
    cached, uncached = make_engine(model_dir), make_engine(model_dir, caching=False)
    rng = random.Random(1)
    prefix = tokens(rng, 21)
    requests = {}
    for name, content_hash in (("a", "cat.png"), ("b", "cat.png"), ("c", "cat.png"), ("d", "dog.png")):
        prompt = prefix + [IMAGE_TOKEN] * 30 + [200 + len(requests)] + tokens(rng, 12)
        requests[name] = (prompt, MultimodalInput(21, 51, content_hash), 4)
    results = {}
    for name, request in requests.items():  # one after the other, so each sees the earlier ones' checkpoints
        results[name] = run(cached, {name: request})[name]
        want = run(uncached, {name: request})[name]
        assert results[name].outputs[0].token_ids == want.outputs[0].token_ids
    # b diverges from a right after the image: a branch point at 51 that c then hits.
    assert results["c"].num_cached_tokens == 51
    # d has the same token ids as c up to 51 but another image: nothing inside or past its span is reused.
    assert results["d"].num_cached_tokens <= 21


@pytest.mark.parametrize(
    "span, message",
    [
        (MultimodalInput(5, 5, "x"), "empty or outside"),
        (MultimodalInput(10, 99, "x"), "empty or outside"),
        (MultimodalInput(2, 6, "x", embeds=torch.zeros(3, 64)), "embeddings of shape"),
    ],
)
def test_bad_spans_are_refused(model_dir, span, message):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", list(range(20)), SamplingParams(max_tokens=2), mm_inputs=[span])
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
