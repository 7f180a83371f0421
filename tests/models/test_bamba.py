"""Bamba (`BambaForCausalLM`) vs transformers on tiny random models (half and a quarter of each head rotated, biases,
tied embeddings), fp32, and its config parsing and refusals.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the whole
sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class, load_model
from hybridcache.models.config import LayerKind

from .bamba_helpers import VARIANTS, bamba_config, bamba_model, make_bamba_pair
from .helpers import TOLERANCE, PagedRunner, random_tokens, rel_err
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `pair`
    test_decode_after_prefill_matches_full_and_incremental_forward,
    test_mixed_batch_of_prefill_chunks_and_decodes,
    test_single_prefill_and_chunked_prefill,
    test_the_comparison_notices_a_lost_recurrent_state,
)

# ibm-ai-platform/Bamba-9B's config.json (Bamba-9B-v2's has the same fields and sizes)
BAMBA_9B = {
    "architectures": ["BambaForCausalLM"], "attention_dropout": 0.0, "attn_layer_indices": [9, 18, 27],
    "attn_rotary_emb": 64, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_dt_rank": 256, "mamba_expand": 2,
    "mamba_n_groups": 1, "mamba_n_heads": 128, "mamba_proj_bias": False, "model_type": "bamba",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_logits_to_keep": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "transformers_version": "4.47.0.dev0",
    "use_cache": True, "use_mamba_kernels": True, "vocab_size": 128256,
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_bamba_pair(request.param)


def test_config_reads_the_published_bamba_9b_config():
    config = ModelConfig.from_dict(BAMBA_9B)
    attention = [i for i, kind in enumerate(config.layer_types) if kind is LayerKind.FULL_ATTENTION]
    assert attention == [9, 18, 27] and len(config.mamba2_layer_ids) == 29
    a, m = config.attention, config.mamba2
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (32, 8, 128, 64, 10000.0)
    assert a.use_rope and a.softmax_scale == 128**-0.5 and not a.bias
    assert (m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_kernel_size) == (128, 64, 1, 128, 4)
    assert config.mlp.intermediate_size == 14336 and config.mlp.num_experts == 0
    assert config.max_position_embeddings == 262144 and config.rms_norm_eps == 1e-5
    assert config.multipliers.embedding == config.multipliers.logits_scaling == 1.0


def test_config_rotates_half_the_head_whatever_the_top_level_says():
    """transformers' BambaConfig sets partial_rotary_factor 0.5 over a top-level value; rope_parameters' wins."""
    assert ModelConfig.from_dict({**BAMBA_9B, "partial_rotary_factor": 1.0}).attention.rotary_dim == 64
    quarter = {**BAMBA_9B, "attn_rotary_emb": 32,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}
    config = ModelConfig.from_dict(quarter)
    assert config.attention.rotary_dim == 32 and config.attention.rope_theta == 1e6
    import transformers

    hf = transformers.BambaConfig(**{k: v for k, v in quarter.items() if k != "transformers_version"})
    assert hf.rope_parameters["partial_rotary_factor"] == 0.25
    top = transformers.BambaConfig(**{k: v for k, v in BAMBA_9B.items() if k != "transformers_version"},
                                   partial_rotary_factor=1.0)
    assert top.rope_parameters["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("field, value, message", [
    ("attn_layer_indices", [9, 32], "attn_layer_indices"),
    ("attn_layer_indices", "9,18", "attn_layer_indices"),
    ("attn_rotary_emb", 128, "attn_rotary_emb 128 is not head_dim 128 x partial_rotary_factor 0.5"),
    ("mlp_bias", True, "mlp_bias true is not supported for Bamba"),
    ("hidden_act", "gelu", "hidden_act"),
    ("mamba_d_head", 32, "mamba_d_head"),
    ("mamba_n_groups", 3, "mamba_n_groups"),
    ("layers_block_type", ["mamba"] * 32, "disagrees with attn_layer_indices"),
])
def test_config_refuses_what_it_cannot_run(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BAMBA_9B, field: value})


def test_defaults_are_transformers_defaults():
    """The fields config.json may leave out take `BambaConfig`'s defaults; num_key_value_heads written null is
    num_attention_heads, as transformers reads it."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.BambaConfig()
    for key, value in DEFAULTS["bamba"].items():
        if key in ("rope_theta", "partial_rotary_factor"):
            assert value == hf.rope_parameters[key], key
            continue
        want = "auto" if key == "mamba_d_head" else getattr(hf, key)  # (hf resolves "auto" when built)
        assert value == want, key
    minimal = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "vocab_size": 256, "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 16, "mamba_n_heads": 8}
    config = ModelConfig.from_dict(minimal)
    assert config.attention.num_kv_heads == hf.num_key_value_heads == 8 and config.attention.head_dim == 4
    assert config.layer_types == (LayerKind.MAMBA2, LayerKind.MAMBA2) and config.attention.rotary_dim == 2
    assert ModelConfig.from_dict({**minimal, "num_key_value_heads": None}).attention.num_kv_heads == 16
    null_kv = transformers.BambaConfig(**{k: v for k, v in minimal.items() if k != "architectures"},
                                       num_key_value_heads=None)
    assert null_kv.num_key_value_heads == 16


def test_tensor_parallelism_and_fp8_are_refused_and_the_folder_loads(tmp_path):
    """save_pretrained writes the checkpoints' names (`final_layernorm`, `pre_ff_layernorm`, `feed_forward`)."""
    from safetensors import safe_open

    config = ModelConfig.from_dict(bamba_config("groups2").to_dict())
    with pytest.raises(ValueError, match="tensor parallelism"):
        get_model_class(config.architecture)(config, TensorParallel(rank=0, size=2))
    hf = bamba_model("bias-rope")
    hf.save_pretrained(tmp_path)
    for options, message in (({"quantization": "fp8"}, "FP8 weights"), ({"kv_fp8": True}, "an FP8 KV cache")):
        with pytest.raises(ValueError, match=f"BambaForCausalLM does not support {message}"):
            load_model(tmp_path, **options)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"model.final_layernorm.weight", "model.layers.0.pre_ff_layernorm.weight",
            "model.layers.0.feed_forward.gate_proj.weight"} <= names
    assert json.loads((tmp_path / "config.json").read_text())["attn_layer_indices"] == [1]
    ours = load_model(tmp_path)
    tokens = random_tokens(40, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(40)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE
