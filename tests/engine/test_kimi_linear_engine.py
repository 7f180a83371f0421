"""Kimi Linear (KDA, MLA and MoE layers) through the engine: its KDA layers' state is a conv and an ssm tensor like
gated DeltaNet's, its MLA layers paged KV, so the pools, the checkpoints and the prefix cache need no change; cached
and uncached runs compute the same thing, the cache hits at non-block-aligned steps; options that do not apply to it
(MTP, images, FP8, TP) are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.kimi_helpers import kimi_model

from .mamba2_hybrid_engine_checks import (  # noqa: F401 - collected here, on this file's `model_dir`
    test_cached_run_equals_uncached_run,
    test_cuda_fp32_cached_run_equals_uncached_run,
    test_llm_generate_with_and_without_the_prefix_cache,
    test_options_that_do_not_apply_are_clear_errors,
    test_shared_prefixes_of_unaligned_lengths_hit_at_the_divergence_step,
    test_split_forward_equals_unsplit_on_cpu,
    write_tiny_folder,
)


def write_tiny_kimi(path: Path, variant: str, seed: int = 0) -> Path:
    """A tiny random Kimi Linear folder over the byte tokenizer's 320 ids (transformers `save_pretrained`)."""
    return write_tiny_folder(kimi_model(variant, seed, vocab_size=320, eos_token_id=258), path)


@pytest.fixture(scope="module", params=["moe-groups", "qlora-dense2"])
def model_dir(request, tmp_path_factory):
    return write_tiny_kimi(tmp_path_factory.mktemp(request.param), request.param)
