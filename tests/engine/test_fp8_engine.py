"""FP8 through the engine on the CPU (fp32 compute): an FP8 checkpoint's cached run equals its uncached run
token for token, `quantization="fp8"` serves a dense folder as FP8, `kv_cache_dtype="fp8"` stores e4m3 KV
(a quarter of fp32's bytes per block, half of bf16's) and greedy decoding agrees with the model-dtype KV, and
the startup line and /health name the weight format and the KV dtype."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.sampling import SamplingParams
from hybridcache.server.engine_state import read_engine_state

from .model_folders import prompts_of, write_tiny_model
from .test_cache_equivalence import assert_same, make_engine, run_workload

# Qwen3-Next's DeltaNet heads are whole 128-row FP8 blocks, as in its FP8 checkpoints (its packed projections are
# read ungrouped, their block scales with them: docs/design.md).
WHOLE_BLOCKS = {"qwen3_next": {"linear_key_head_dim": 128, "linear_value_head_dim": 128}}


# The channel case is slow-marked (suite budget): its loading, logits and greedy tokens are checked against
# transformers in tests/models/test_fp8.py, and the cache sees the same engine either way.
@pytest.fixture(scope="module", params=[("qwen3_next", "block"),
                                        pytest.param(("qwen3_5_text", "channel"), marks=pytest.mark.slow)],
                ids=lambda p: "-".join(p))
def fp8_dir(request, tmp_path_factory):
    model_type, kind = request.param
    dense = write_tiny_model(tmp_path_factory.mktemp(f"dense-{model_type}"), model_type,
                             **WHOLE_BLOCKS.get(model_type, {}))
    return write_fp8_folder(dense, tmp_path_factory.mktemp(f"{kind}-{model_type}"), kind)


def test_fp8_cached_run_equals_uncached_run(fp8_dir):
    uncached = make_engine(fp8_dir, caching=False)
    cached = make_engine(fp8_dir)
    out_uncached = run_workload(uncached)
    out_cached = run_workload(cached, check_every_step=True)
    assert_same(cached, uncached, out_cached, out_uncached)
    assert sum(o.num_cached_tokens for o in out_cached.values()) > 0
    assert read_engine_state(cached).weights.startswith("fp8-")


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.check_integrity()
    return [list(done[f"r{i}"].outputs[0].token_ids) for i in range(len(prompts))]


def test_kv_cache_fp8_halves_the_block_and_agrees_greedily(tmp_path, caplog):
    """FP8 KV on a tiny random model (nearly flat logits, the hardest case for agreement): the pool is e4m3, a
    block a quarter of fp32's bytes, and the greedy tokens agree with fp32 KV at >= 90% of steps (compared up to
    each completion's first difference, where later tokens stop being comparable)."""
    folder = write_tiny_model(tmp_path / "dense", "qwen3_next")
    prompts = prompts_of([150, 170, 90, 200], seed=3)
    base = LLMEngine(folder, EngineConfig(block_size=16, kernel_block_size=8, max_num_batched_tokens=256))
    with caplog.at_level(logging.INFO, logger="hybridcache.engine"):
        fp8 = LLMEngine(folder, EngineConfig(block_size=16, kernel_block_size=8, max_num_batched_tokens=256,
                                             kv_cache_dtype="fp8"))
    assert "kv cache fp8_e4m3" in caplog.text and "weights dense" in caplog.text
    assert all(pool.dtype == torch.float8_e4m3fn for pool in fp8.runner.pools.kv_groups)
    def block_bytes(engine: LLMEngine) -> int:
        return engine.memory_plan.kv_bytes // engine.memory_plan.num_blocks

    assert block_bytes(fp8) * 4 == block_bytes(base)  # e4m3 against fp32 KV
    want, got = greedy_tokens(base, prompts, 24), greedy_tokens(fp8, prompts, 24)
    agree = total = 0
    for a, b in zip(want, got, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agree += first
        total += min(first + 1, len(a))
    assert agree / total >= 0.9, (want, got)
    assert read_engine_state(fp8).kv_cache_dtype == "fp8_e4m3"


def test_quantization_fp8_serves_a_dense_folder(tmp_path, caplog):
    folder = write_tiny_model(tmp_path / "dense", "qwen3_5_text")
    with caplog.at_level(logging.INFO, logger="hybridcache.engine"):
        engine = LLMEngine(folder, EngineConfig(block_size=16, kernel_block_size=8, quantization="fp8"))
    assert "weights fp8-block128x128 (quantized at load)" in caplog.text
    assert read_engine_state(engine).weights == "fp8-block128x128 (quantized at load)"
    (tokens,) = greedy_tokens(engine, prompts_of([160], seed=1), 8)
    assert len(tokens) == 8
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_the_mtp_head_keeps_fp8_kv_in_the_targets_pool(tmp_path):
    """With `kv_cache_dtype="fp8"` the MTP head's attention stores e4m3 KV too, as vLLM's draft layers follow the
    cache dtype: one KV tensor holds the target's attention layers and the head's (before, the head kept model-dtype
    KV in a second tensor, as many bytes a block as two FP8 layers), and greedy MTP equals the same engine without
    MTP."""
    folder = write_tiny_model(tmp_path / "dense", "qwen3_next")
    config = dict(block_size=16, kernel_block_size=8, max_num_batched_tokens=256, kv_cache_dtype="fp8")
    plain = LLMEngine(folder, EngineConfig(**config))
    mtp = LLMEngine(folder, EngineConfig(**config, speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    (target_kv,) = plain.runner.pools.kv_groups
    assert [(kv.dtype, kv.shape[0]) for kv in mtp.runner.pools.kv_groups] == [
        (torch.float8_e4m3fn, target_kv.shape[0] + len(mtp.runner.mtp_head.layers))]
    prompts = prompts_of([150, 170, 90], seed=5)
    assert greedy_tokens(mtp, prompts, 16) == greedy_tokens(plain, prompts, 16)
    assert mtp.drafter.stats.num_draft_tokens > 0
