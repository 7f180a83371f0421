"""Nemotron-H (Mamba2, attention and stateless MLP layers) through the engine: its MLP layers hold no state (an
empty spec), so the pools, the checkpoints and the prefix cache need no change; cached and uncached runs compute
the same thing, the cache hits at non-block-aligned steps; options that do not apply to it (MTP, images, TP)
are clear errors (FP8: test_fp8_mamba2_hybrids_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from tests.models.nemotron_helpers import nemotron_model

from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `model_dir`
    compile_recorder,
    test_cached_run_equals_uncached_run,
    test_cuda_backend_takes_the_folder,
    test_cuda_fp32_cached_run_equals_uncached_run,
    test_llm_generate_with_and_without_the_prefix_cache,
    test_options_that_do_not_apply_are_clear_errors,
    test_serving_compiles_no_kernel_after_start_up,
    test_shared_prefixes_of_unaligned_lengths_hit_at_the_divergence_step,
    test_split_forward_equals_unsplit_on_cpu,
    tiny_model_dir_fixture,
)
from .test_cache_equivalence import finish_one, make_engine

# (transformers `save_pretrained` writes the hub checkpoints' `backbone.` names)
# FP8 weights and KV: served (the shared refusal test checks the model class's `supports_fp8` against it)
SERVES_FP8 = True
model_dir = tiny_model_dir_fixture(nemotron_model, ["groups2", "pattern-bias", "moe-groups", "moe-latent"])


def test_auto_ssm_cache_dtype_reads_mamba_ssm_cache_dtype(model_dir, tmp_path):
    """`--mamba-ssm-cache-dtype auto` takes the config's `mamba_ssm_cache_dtype` (Nemotron-H's name for it; the
    published configs say float32, as transformers' default) and the Mamba2 state pools follow it."""
    import shutil

    from hybridcache.engine_args import resolve_engine_config

    auto = {"mamba_ssm_cache_dtype": "auto", "device": "cpu"}
    assert resolve_engine_config(model_dir, auto).mamba_ssm_cache_dtype == "float32"
    folder = Path(shutil.copytree(model_dir, tmp_path / "bf16-state"))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "mamba_ssm_cache_dtype": "bfloat16"}))
    config = resolve_engine_config(folder, {**auto, "num_blocks": 64})
    assert config.mamba_ssm_cache_dtype == "bfloat16"
    engine = LLMEngine(folder, config)
    ssm = [state["ssm"] for state in engine.runner.pools.layers if isinstance(state, dict) and state]
    assert ssm and all(t.dtype == torch.bfloat16 for t in ssm)


def test_mtp_is_refused_where_the_folder_has_nemotron_mtp_layers(model_dir, tmp_path):
    """Nemotron 3's MTP layers (`num_nextn_predict_layers`, `mtp.*` tensors) are not the Qwen MTP head the engine
    drafts with: speculative 'mtp' is refused naming the architecture (it was a list of missing Qwen head tensors);
    without speculation the folder serves, its `mtp.*` tensors unread."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(model_dir, tmp_path / "with-mtp"))
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "mtp.layers.0.norm.weight": torch.ones(64)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="'mtp' is not supported for NemotronHForCausalLM"):
        LLMEngine(folder, EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 1}))
    assert len(finish_one(make_engine(folder), "plain", [5, 6, 7], 2).outputs[0].token_ids) == 2
