"""A model folder whose config.json asks for YaRN (rope_type "yarn", factor 4 over original_max_position_embeddings
64, max_position_embeddings 256) through the engine: logits equal transformers' past position 64, the cached run
equals the uncached one, and Qwen3.5's image path (3-D M-RoPE positions) equals transformers' too."""

from __future__ import annotations

import random

import pytest
import torch

from hybridcache.models.vl_folders import PREPROCESSOR, tiny_vl_hf_config, write_vl_model

from .markers import needs_cuda_engine
from .model_folders import load_hf_model, prompts_of, write_tiny_model
from .test_cache_equivalence import CUDA_FP32, REL_TOL, check_cached_equals_uncached, make_engine, run_workload

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25}
MAX_POSITIONS = 256


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def yarn_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(f"yarn_{request.param}"), request.param,
                            rope_parameters=YARN, max_position_embeddings=MAX_POSITIONS)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda_engine)])
def test_greedy_logits_equal_transformers_past_the_original_length(yarn_dir, device):
    """(On CUDA in fp32 with the decode graphs, which capture the scaled cos/sin table's use.)"""
    engine = make_engine(yarn_dir, caching=False, max_num_batched_tokens=64,
                         **({} if device == "cpu" else CUDA_FP32))
    (prompt,) = prompts_of([150], seed=5)
    engine.add_request("r", prompt, _greedy(8))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated = output.outputs[0].token_ids
    with torch.no_grad():
        full = prompt + list(generated)
        logits = load_hf_model(yarn_dir)(input_ids=torch.tensor([full]), position_ids=torch.arange(len(full))[None],
                                         use_cache=False).logits[0].float()
    for step, token in enumerate(generated):
        want = logits[len(prompt) + step - 1]
        ours = engine.logits[("r", 0, len(prompt) + step)].float().cpu()
        assert (ours - want).abs().max() / want.abs().max() <= REL_TOL, step
        assert int(want.argmax()) == token


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda_engine)])
def test_cached_run_equals_uncached_run(yarn_dir, device):
    check_cached_equals_uncached(yarn_dir, **({} if device == "cpu" else CUDA_FP32))


def test_image_prompt_with_yarn_equals_transformers(tmp_path):
    """Qwen3.5's image path: the image tokens' (t, h, w) positions turn YaRN's frequencies (M-RoPE)."""
    from .test_vision import build_prompt, hf_logits, load_hf, picture, run

    rope = {**YARN, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    path = write_vl_model(tmp_path / "vl_yarn", tiny_vl_hf_config(rope_parameters=rope,
                                                                   max_position_embeddings=MAX_POSITIONS),
                          PREPROCESSOR)
    engine = make_engine(path, caching=False, max_num_batched_tokens=64)
    ids, spans = build_prompt(engine, random.Random(1), [picture(48, 64, seed=0)], pieces=(60, 50))
    assert len(ids) >= 150 and spans[0].start < 64 < len(ids)
    generated = run(engine, "r", ids, spans, max_tokens=6).outputs[0].token_ids
    hf = load_hf(path)
    assert hf.model.language_model.rotary_emb.attention_scaling > 1.0  # transformers runs YaRN too
    logits = hf_logits(hf, ids + list(generated), spans, engine.vision.tower.config.image_token_id)
    for step in range(len(generated)):
        ours = engine.logits[("r", 0, len(ids) + step)]
        want = logits[len(ids) + step - 1]
        assert (ours - want).abs().max() / want.abs().max() <= REL_TOL, step
        assert int(want.argmax()) == generated[step]


def _greedy(max_tokens: int):
    from hybridcache.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_speculative_decoding_with_the_mtp_head_keeps_the_greedy_tokens(yarn_dir):
    """The MTP head turns its attention with the same YaRN table (models/mtp.py); verified drafts keep the tokens."""
    from .spec_helpers import make_engine as make_spec_engine
    from .spec_helpers import tokens_of

    plain = tokens_of(run_workload(make_spec_engine(yarn_dir, None)))
    speculative = make_spec_engine(yarn_dir, 2)
    assert tokens_of(run_workload(speculative)) == plain


def test_the_model_length_is_stretched_as_vllm_derives_it(yarn_dir, tmp_path):
    """vLLM derives the longest context from a scaled RoPE: YaRN's original_max_position_embeddings x factor
    (64 x 4 = 256 here), linear's max_position_embeddings x factor. Before, max_position_embeddings capped it
    whatever the scaling, so Qwen's card (YaRN factor 4 over 262,144, config.json's 262,144 left) gave no longer
    context."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.models.config import ModelConfig

    assert ModelConfig.from_model_dir(yarn_dir).max_model_len == 256
    stretched = write_tiny_model(tmp_path / "stretched", "qwen3_next", max_position_embeddings=64,
                                 rope_parameters={**YARN, "factor": 8.0})
    assert ModelConfig.from_model_dir(stretched).max_model_len == 512
    assert LLMEngine(stretched, EngineConfig(block_size=16, max_model_len=512, max_num_seqs=2)).max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len 513 exceeds the model's length 512"):
        LLMEngine(stretched, EngineConfig(block_size=16, max_model_len=513, max_num_seqs=2))
    linear = write_tiny_model(tmp_path / "linear", "qwen3_next", max_position_embeddings=64,
                              rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.25})
    assert ModelConfig.from_model_dir(linear).max_model_len == 128
