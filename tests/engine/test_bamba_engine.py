"""Bamba (Mamba2 + attention, Granite's layer under Bamba's names) through the engine: cached and uncached runs compute
the same thing, the cache hits at non-block-aligned steps, the split prefill equals the unsplit one; options that do
not apply to it (MTP, FP8, images) are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from tests.models.bamba_helpers import bamba_model

from .mamba2_hybrid_engine_checks import (  # noqa: F401 - collected here, on this file's `model_dir`
    test_cached_run_equals_uncached_run,
    test_cuda_fp32_cached_run_equals_uncached_run,
    test_llm_generate_with_and_without_the_prefix_cache,
    test_shared_prefixes_of_unaligned_lengths_hit_at_the_divergence_step,
    test_split_forward_equals_unsplit_on_cpu,
    write_tiny_folder,
)


def write_tiny_bamba(path: Path, variant: str, seed: int = 0) -> Path:
    """A tiny random Bamba folder over the byte tokenizer's 320 ids (transformers `save_pretrained`)."""
    return write_tiny_folder(bamba_model(variant, seed, vocab_size=320, eos_token_id=258), path)


@pytest.fixture(scope="module", params=["groups2", "bias-rope"])
def model_dir(request, tmp_path_factory):
    return write_tiny_bamba(tmp_path_factory.mktemp(request.param), request.param)


def test_options_that_do_not_apply_are_clear_errors(model_dir):
    for options, message in (
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
         "'mtp' needs a model with MTP layers; BambaForCausalLM has none"),
        ({"quantization": "fp8"}, "BambaForCausalLM does not support FP8 weights"),
        ({"kv_cache_dtype": "fp8"}, "BambaForCausalLM does not support an FP8 KV cache"),
    ):
        with pytest.raises(ValueError, match=message):
            LLMEngine(model_dir, EngineConfig(**options))
