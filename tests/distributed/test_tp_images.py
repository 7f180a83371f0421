"""Images under tensor parallelism on the CPU (gloo, 2 ranks), on the tiny dense image-text folder: a chat with two
images of different sizes, then a second turn that repeats the first turn and sends its first image again, gives
one rank's greedy tokens and logits, and the same cached tokens (the second turn hits through the image, its ViT
run skipped by the encoder cache on rank 0, the only rank that runs the tower), also with async scheduling. The
image embeddings reach the workers with the step's other inputs (`ForwardBatch.embeds`)."""

from __future__ import annotations

import random

import pytest

from hybridcache.images import MediaLimits
from hybridcache.mm_processor import image_prompt
from hybridcache.models.vl_folders import write_tiny_vl_model
from tests.engine.test_cache_equivalence import make_engine
from tests.engine.test_vision import _collapse, build_prompt, picture, run, text

from .test_tensor_parallel import REL_TOL, rel_err

PIL = pytest.importorskip("PIL.Image")


def conversation(engine) -> list:
    """Turn 1: two images (24 x 40 and 32 x 48 pixels) between text pieces; turn 2: turn 1's prompt and reply, a
    new user message and the first image again. Returns both turns' outputs."""
    rng = random.Random(3)
    first_image, second_image = picture(24, 40, seed=1), picture(32, 48, seed=2)
    ids, spans = build_prompt(engine, rng, [first_image, second_image], pieces=(40, 50, 60))
    assert len(ids) >= 150 and spans[0].num_tokens != spans[1].num_tokens
    first = run(engine, "turn1", ids, spans, max_tokens=5)
    follow = _collapse(ids, spans) + list(first.outputs[0].token_ids) + text(rng, 20)
    vision = engine.vision.tower.config
    follow += [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id] + text(rng, 10)
    ids2, spans2 = image_prompt(engine.image_processor, follow, [first_image, second_image, first_image],
                                MediaLimits())
    second = run(engine, "turn2", ids2, spans2, max_tokens=5)
    return [first, second]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl_tp"))


def test_image_chat_on_two_ranks_matches_one_rank(vl_dir):
    single = make_engine(vl_dir)
    want = conversation(single)
    tp = make_engine(vl_dir, tensor_parallel_size=2)
    try:
        got = conversation(tp)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
        assert got[1].num_cached_tokens >= len(got[0].prompt_token_ids)  # turn 2 hit through turn 1's images
        counts = (tp.vision.num_encoded_images, tp.vision.num_cache_hits)
        assert counts == (single.vision.num_encoded_images, single.vision.num_cache_hits) == (2, 2)  # no ViT in turn 2
        assert tp.logits.keys() == single.logits.keys()
        for key, logits in single.logits.items():
            assert rel_err(tp.logits[key], logits) <= REL_TOL, key
        tp.check_integrity()
        tp.clear_cache()  # async scheduling: a step with image rows queued while the one before runs
        tp.async_scheduling = True
        again = conversation(tp)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
        assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in want]
    finally:
        tp.runner.shutdown()
