"""Images through the engine on tiny random Qwen3.5 image-text folders (dense and MoE): the vision tower, M-RoPE
positions and span embeddings against transformers' `Qwen3_5ForConditionalGeneration`, and the prefix cache and
encoder cache across conversation turns."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridcache.images import MediaLimits
from hybridcache.mm_processor import image_prompt
from hybridcache.models.vision import VisionTower
from hybridcache.models.vision_config import VisionConfig
from hybridcache.models.vision_loader import load_vision_weights
from hybridcache.models.vl_folders import tiny_vl_hf_config, write_tiny_vl_model
from hybridcache.multimodal import MultimodalInput, rope_positions, rope_shift
from hybridcache.sampling import SamplingParams

from .test_cache_equivalence import REL_TOL, make_engine

PIL = pytest.importorskip("PIL.Image")


def picture(height: int, width: int, seed: int):
    """A random RGB PIL image."""
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def vl_dir(request, tmp_path_factory):
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl_moe" if request.param else "vl_dense"), moe=request.param)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """The dense folder alone, for the cache tests (the MoE model changes nothing there; it is checked above)."""
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl_dense_cache"))


def text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def build_prompt(engine, rng, images, pieces=(40, 30, 50, 35)):
    """Text, then each image (<|vision_start|><|image_pad|><|vision_end|>) between text pieces; expanded."""
    vision = engine.vision.tower.config
    ids = text(rng, pieces[0])
    for i, _ in enumerate(images):
        ids += [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]
        ids += text(rng, pieces[(i + 1) % len(pieces)])
    return image_prompt(engine.image_processor, ids, images, MediaLimits())


def hf_logits(hf, ids, spans, image_token_id):
    """transformers' full forward with its own M-RoPE positions: logits [len(ids), vocab]."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if spans:
        kwargs = {"pixel_values": torch.cat([s.pixel_values for s in spans]),
                  "image_grid_thw": torch.tensor([s.grid for s in spans]),
                  "mm_token_type_ids": (input_ids == image_token_id).int()}
    with torch.inference_mode():
        return hf(input_ids=input_ids, use_cache=False, **kwargs).logits[0].float()


def load_hf(path):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def run(engine, request_id, ids, spans, max_tokens):
    engine.add_request(request_id, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                       mm_inputs=spans)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                result = output
    engine.check_integrity()
    return result


def test_vision_tower_matches_transformers():
    import transformers

    from hybridcache.models.random_weights import randomize_

    config = tiny_vl_hf_config()
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    randomize_(hf, seed=3)
    ours = VisionTower(VisionConfig.from_dict(config.to_dict()))
    load_vision_weights(ours, hf.state_dict())
    grids = [(1, 6, 10), (1, 4, 4), (1, 12, 2), (2, 4, 6)]  # 8 x 8 learned grid resampled up and down; 2 frames
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), ours.config.patch_dim)
    with torch.inference_mode():
        want = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got = torch.cat(ours(pixels, grids))
    assert got.shape == want.shape
    assert (got - want).abs().max() / want.abs().max() <= 1e-5


def test_rope_positions_match_transformers_rope_index():
    import transformers

    config = tiny_vl_hf_config()
    model = transformers.Qwen3_5Model(config)
    image = config.image_token_id
    spans = [MultimodalInput(5, 11, "a", grid=(1, 4, 6), merge=2),
             MultimodalInput(20, 28, "b", grid=(1, 8, 4), merge=2),
             MultimodalInput(29, 33, "c", grid=(1, 4, 4), merge=2)]  # (prompts separate images by vision_end/start)
    ids = torch.zeros(1, 40, dtype=torch.int64)
    for s in spans:
        ids[0, s.start:s.end] = image
    want, delta = model.get_rope_index(ids, mm_token_type_ids=(ids == image).int(),
                                       image_grid_thw=torch.tensor([s.grid for s in spans]))
    assert torch.equal(rope_positions(spans, 0, 40), want[:, 0])
    for start, end in ((0, 7), (7, 21), (21, 40), (39, 40)):  # any chunk of the prompt
        assert torch.equal(rope_positions(spans, start, end), want[:, 0, start:end])
    decode = rope_positions(spans, 45, 46)  # a generated token: its index + the prompt's delta, on all axes
    assert decode.tolist() == [[45 + int(delta)]] * 3


@pytest.mark.parametrize("sizes", [[(48, 64)], [(32, 32), (16, 56), (40, 24)]], ids=["1-image", "3-images"])
def test_logits_and_greedy_tokens_match_transformers(vl_dir, sizes):
    engine = make_engine(vl_dir, caching=False, max_num_batched_tokens=64)
    rng = random.Random(len(sizes))
    images = [picture(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    ids, spans = build_prompt(engine, rng, images, pieces=(60, 50, 40, 35))
    assert len(ids) >= 150 and len({s.num_tokens for s in spans}) == len(spans)
    ends, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: _recorded(schedule(), ends)
    result = run(engine, "r", ids, spans, max_tokens=6)
    assert len(ends) - 5 >= 3  # 5 decode steps; the prompt took chunks of at most 64 tokens, one ending at an image
    assert not any(s.start < end < s.end for s in spans for end in ends), ends
    generated = result.outputs[0].token_ids
    hf = load_hf(vl_dir)
    image_id = engine.vision.tower.config.image_token_id
    full = ids + list(generated)
    logits = hf_logits(hf, full, spans, image_id)  # image tokens only in the prompt; generated tokens are text
    for step in range(len(generated)):
        ours = engine.logits[("r", 0, len(ids) + step)]
        want = logits[len(ids) + step - 1]
        assert (ours - want).abs().max() / want.abs().max() <= REL_TOL, step
        assert int(want.argmax()) == generated[step]


def test_multi_turn_hits_through_the_image_and_skips_the_vit(dense_dir):
    cached, uncached = make_engine(dense_dir), make_engine(dense_dir, caching=False)
    rng = random.Random(7)
    image = picture(32, 48, seed=11)
    ids, spans = build_prompt(cached, rng, [image], pieces=(30, 60))
    first = run(cached, "turn1", ids, spans, max_tokens=5)
    assert cached.vision.num_encoded_images == 1
    # turn 2: turn 1's prompt and reply, then a new user message; the same image sent again
    follow = ids + list(first.outputs[0].token_ids) + text(rng, 25)
    ids2, spans2 = image_prompt(cached.image_processor, _collapse(follow, spans), [image], MediaLimits())
    assert ids2 == follow
    second = run(cached, "turn2", ids2, spans2, max_tokens=5)
    assert second.num_cached_tokens >= len(ids)  # all of turn 1's prompt, image included
    assert cached.vision.num_encoded_images == 1 and cached.vision.num_cache_hits == 1  # no ViT for turn 2
    assert cached.stats()["num_encoded_images"] == 1
    want = run(uncached, "turn2", ids2, image_prompt(uncached.image_processor, _collapse(follow, spans), [image],
                                                      MediaLimits())[1], max_tokens=5)
    assert second.outputs[0].token_ids == want.outputs[0].token_ids
    # a different image of the same size: no hit past the image's start
    other = picture(32, 48, seed=12)
    ids3, spans3 = image_prompt(cached.image_processor, _collapse(follow, spans), [other], MediaLimits())
    assert ids3 == follow and spans3[0].content_hash != spans2[0].content_hash
    third = run(cached, "turn2-other", ids3, spans3, max_tokens=5)
    assert third.num_cached_tokens <= spans3[0].start
    assert cached.vision.num_encoded_images == 2
    want = run(uncached, "turn2-other", ids3, image_prompt(uncached.image_processor, _collapse(follow, spans),
                                                           [other], MediaLimits())[1], max_tokens=5)
    assert third.outputs[0].token_ids == want.outputs[0].token_ids


def _collapse(ids, spans):
    """The ids with each image span collapsed back to one placeholder (what the chat template renders)."""
    out, previous = [], 0
    for s in spans:
        out += ids[previous:s.start + 1]
        previous = s.end
    return out + ids[previous:]


def _recorded(output, ends):
    ends.extend(c.end for c in output.chunks)
    return output


def test_decode_graph_buffers_take_the_shifted_text_positions():
    """A decode step of a sequence with an image: the CUDA decode graphs' static positions get M-RoPE row 0 (the
    token's index + the image's shift), which equals all three rows for a text token."""
    from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
    from hybridcache.engine.runner import _DecodeGraphs

    span = MultimodalInput(3, 27, "a", grid=(1, 8, 12), merge=2)  # 4 x 6 merged: the shift is 6 - 24 = -18
    assert rope_shift([span], 40) == -18 and rope_positions([span], 40, 41).tolist() == [[22]] * 3
    chunks = [SeqChunk([6], 10, [3], 1), SeqChunk([5], 40, [0, 1, 2], 0, rope_shift=rope_shift([span], 40))]
    batch = build_forward_batch(chunks, block_size=16, kernel_block_size=16)
    assert batch.rope_positions.tolist() == [[10, 22]] * 3 and batch.positions.tolist() == [10, 40]
    graphs = _DecodeGraphs((1, 2, 4), width=4, max_model_len=64, scratch_slot=7, scratch_page=9,
                           kernel_block_size=16, device=torch.device("cpu"))
    graphs.load(batch, 4)
    assert graphs.positions.tolist() == [10, 22, 0, 0]


def test_a_step_mixes_image_chunks_shifted_text_and_plain_text():
    """One batch: a plain text sequence, a prefill chunk over an image, and a decode row after an image; the
    [3, T] rotary positions equal each sequence's own `rope_positions` over its rows."""
    from hybridcache.engine.input_builder import SeqChunk, build_forward_batch

    spans = [MultimodalInput(2, 8, "a", grid=(1, 4, 6), merge=2), MultimodalInput(12, 20, "b", grid=(1, 8, 4), merge=2)]
    chunks = [SeqChunk([1, 2, 3], 5, [0], 0),
              SeqChunk([7] * 12, 4, [1, 2], 1, rope_positions=rope_positions(spans, 4, 16)),
              SeqChunk([9], 30, [3, 4], 2, rope_shift=rope_shift(spans, 30))]
    batch = build_forward_batch(chunks, block_size=16, kernel_block_size=16)
    want = torch.cat([torch.arange(5, 8).repeat(3, 1), rope_positions(spans, 4, 16), rope_positions(spans, 30, 31)],
                     dim=1)
    assert torch.equal(batch.rope_positions, want)
    alone = build_forward_batch(chunks[2:], block_size=16, kernel_block_size=16)  # a shifted chunk first and alone
    assert torch.equal(alone.rope_positions, rope_positions(spans, 30, 31))
    first = build_forward_batch(chunks[::-1], block_size=16, kernel_block_size=16)
    assert torch.equal(first.rope_positions, torch.cat([want[:, 15:], want[:, 3:15], want[:, :3]], dim=1))


def test_in_flight_sharing_through_an_image_and_never_across_different_ones(dense_dir):
    """n = 3 of one image prompt: one prefill of the prompt (the others wait and restore it); the same text
    with a different image, admitted in the same step, shares only up to the image's start. Greedy tokens equal
    the uncached engine's."""
    cached, uncached = make_engine(dense_dir), make_engine(dense_dir, caching=False)
    rng = random.Random(5)
    ids, spans = build_prompt(cached, rng, [picture(32, 40, seed=1)], pieces=(40, 30))
    other = image_prompt(cached.image_processor, _collapse(ids, spans), [picture(32, 40, seed=2)], MediaLimits())[1]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=3)
    results = {}
    for engine in (cached, uncached):
        engine.add_request("same", ids, params, mm_inputs=spans)
        engine.add_request("other", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           mm_inputs=other)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
        results[engine is cached] = done
    hit, miss = results[True], results[False]
    for name in ("same", "other"):
        assert [c.token_ids for c in hit[name].outputs] == [c.token_ids for c in miss[name].outputs]
    assert [c.num_cached_tokens for c in hit["same"].outputs][1:] == [len(ids)] * 2  # waited for the first one
    assert hit["other"].num_cached_tokens <= spans[0].start
    # prompts computed: the first completion's whole prompt, and "other" from at most the image start
    assert cached.num_prefill_tokens <= 2 * len(ids) - hit["other"].num_cached_tokens
    assert uncached.num_prefill_tokens == 4 * len(ids)


def test_encoder_batches_images_and_serves_repeats_from_its_cache(monkeypatch):
    """Images of one `encode` run through the tower together, at most MAX_PATCHES_PER_CALL patches a call; an
    image seen before (same content hash) is not encoded again; the embeddings equal one image at a time."""
    from hybridcache.engine import vision_encoder
    from hybridcache.engine.vision_encoder import VisionEncoder
    from hybridcache.models.random_weights import randomize_

    tower = VisionTower(VisionConfig.from_dict(tiny_vl_hf_config().to_dict()))
    randomize_(tower, seed=1)
    calls = []
    original = tower.forward
    monkeypatch.setattr(tower, "forward", lambda pixels, grids: calls.append(list(grids)) or original(pixels, grids))
    monkeypatch.setattr(vision_encoder, "MAX_PATCHES_PER_CALL", 100)
    grids = [(1, 6, 8), (1, 4, 4), (1, 8, 8), (1, 4, 6)]  # 48, 16, 64, 24 patches
    spans = [MultimodalInput(10 * i, 10 * i + t * h * w // 4, f"img{i}", grid=(t, h, w), merge=2,
                             pixel_values=torch.randn(t * h * w, tower.config.patch_dim))
             for i, (t, h, w) in enumerate(grids)]
    encoder = VisionEncoder(tower)
    out = encoder.encode(spans + [spans[1]])  # the repeat is encoded once
    assert calls == [[(1, 6, 8), (1, 4, 4)], [(1, 8, 8), (1, 4, 6)]] and encoder.num_encoded_images == 4
    for span, got in zip(spans, out, strict=False):
        assert got.pixel_values is None
        assert torch.allclose(got.embeds, original(span.pixel_values, [span.grid])[0], atol=1e-5)
    again = encoder.encode([spans[2]])
    assert len(calls) == 2 and encoder.num_cache_hits == 1 and torch.equal(again[0].embeds, out[2].embeds)
    # each cached image holds its own tokens' bytes: a view of the call's output kept the whole call's alive,
    # past the cap that the memory plan reserves (`cache_bytes`)
    for embeds in encoder._cache.values():
        assert embeds.untyped_storage().nbytes() == embeds.numel() * embeds.element_size()
