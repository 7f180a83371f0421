"""What the MTP head reads on image prompts (CPU, the tiny Qwen3.5 VL folder with a random MTP head): a catch-up
row at position p reads the input at p + 1, and where p + 1 is an image position that input is the image's
embedding there, as the target read it (vLLM's Qwen3_5MTP embeds its inputs with the image embeddings, gathered
one position on), not the `<|image_pad|>` token's embedding; in a prefill run in chunks (a chunk's last row reads
the next chunk's first position), after a cache hit, and with greedy outputs equal to those without MTP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.images import MediaLimits
from hybridcache.mm_processor import image_prompt
from hybridcache.models.mtp import write_random_mtp
from hybridcache.models.vl_folders import write_tiny_vl_model
from hybridcache.sampling import SamplingParams

from .spec_helpers import spec

PIL = pytest.importorskip("PIL.Image")
K = 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_mtp(write_tiny_vl_model(tmp_path_factory.mktemp("vl_mtp")))


def _engine(folder, k: int | None, chunk_len: int = 16) -> LLMEngine:
    """Prefill chunks of `chunk_len` tokens: chunk boundaries fall inside the images."""
    return LLMEngine(folder, EngineConfig(block_size=16, kernel_block_size=8, max_num_batched_tokens=chunk_len,
                                          max_num_seqs=4, max_model_len=300,
                                          speculative_config=spec(k) if k else None))


def _image(height: int, width: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(engine: LLMEngine) -> tuple[list[int], tuple]:
    """Two images of other grids with text between and after them."""
    vc = engine.vision.tower.config
    start, pad, end = vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id
    return image_prompt(engine.image_processor, [20, start, pad, end, 21, 22, start, pad, end, *range(60, 70)],
                        [_image(24, 40, 1), _image(40, 24, 2)], MediaLimits())


def _run(engine: LLMEngine, ids: list[int], spans: tuple, max_tokens: int = 10) -> dict:
    """The prompt sent as "first", run to its end, then again as "again" (a cache hit); request id -> tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = {}
    for request_id in ("first", "again"):
        engine.add_request(request_id, ids, params, mm_inputs=spans)
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
            engine.check_integrity()
    return outputs


def test_catch_up_rows_read_the_image_embeddings_one_position_on(folder):
    engine = _engine(folder, K)
    ids, spans = _prompt(engine)
    encoded = engine.vision.encode(spans)  # the embeddings the target reads (the encoder cache serves them again)
    pad_embedding = engine.runner.model.model.embed_tokens.weight[engine.vision.tower.config.image_token_id]
    fed = []  # (embeds, positions) of each catch-up pass (the head's calls without a step)

    def record(module, args, kwargs):
        if not kwargs.get("step", 0):
            fed.append((args[0].detach().clone(), args[2].positions.tolist()))

    handle = engine.runner.mtp_head.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _run(engine, ids, spans)
    finally:
        handle.remove()
    on_image, reads = 0, set()
    for embeds, positions in fed:
        for row, position in enumerate(positions):
            span = next((s for s in encoded if s.start <= position + 1 < s.end), None)
            if span is None:
                continue
            on_image += 1
            reads.add(position + 1)
            torch.testing.assert_close(embeds[row], span.embeds[position + 1 - span.start].to(embeds.dtype),
                                       msg=lambda m, p=position: f"row at position {p}: {m}")
            assert not torch.equal(embeds[row], pad_embedding.to(embeds.dtype))
    print(f"catch-up rows reading an image position: {on_image}")
    image_positions = {p for s in encoded if s.grid is not None for p in range(s.start, s.end)}
    assert reads == image_positions  # every image position read, the chunks' last rows among them


def test_greedy_outputs_on_image_prompts_equal_those_without_mtp(folder):
    engine = _engine(folder, K)
    ids, spans = _prompt(engine)
    drafted = []
    propose = engine.drafter.propose

    def recorded(chunks, drafting, *args):
        propose(chunks, drafting, *args)
        drafted.extend(seq.drafts for seq in drafting if seq.drafts)

    engine.drafter.propose = recorded
    got = _run(engine, ids, spans)
    assert drafted
    assert got == _run(_engine(folder, None), ids, spans)
