"""Falcon-H1 (`FalconH1ForCausalLM`) vs transformers on tiny random models (the gated norm after the gate, before
it, or none; every muP multiplier away from 1; biases, tied embeddings), fp32; its state layout (two state layers a
decoder layer); its config parsing and refusals.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the whole
sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class, load_model
from hybridcache.models.config import LayerKind
from hybridcache.state_spec import AttentionSpec, RecurrentSpec

from .falcon_h1_helpers import VARIANTS, falcon_config, falcon_model, make_falcon_pair
from .helpers import TOLERANCE, PagedRunner, random_tokens, rel_err
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `pair`
    test_decode_after_prefill_matches_full_and_incremental_forward,
    test_mixed_batch_of_prefill_chunks_and_decodes,
    test_single_prefill_and_chunked_prefill,
    test_the_comparison_notices_a_lost_recurrent_state,
)

# The fields of Falcon-H1-0.5B's config.json as a copy of it on the hub writes them (its ssm multipliers, cut off
# there, are left out: the default ones)
FALCON_H1_05B = {
    "architectures": ["FalconH1ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375, "attn_layer_indices": None, "bos_token_id": 1,
    "dtype": "bfloat16", "embedding_multiplier": 5.656854249492381, "eos_token_id": 11, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 2048,
    "key_multiplier": 0.39062499999999994, "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128,
    "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_d_state": 128,
    "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 24, "mamba_norm_before_gate": False,
    "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_use_mlp": True, "max_position_embeddings": 16384,
    "mlp_bias": False, "mlp_expansion_factor": 8, "mlp_multipliers": [0.8838834764831844, 0.5859375],
    "model_type": "falcon_h1", "num_attention_heads": 8, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "num_logits_to_keep": 1, "pad_token_id": 0, "projectors_bias": False, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 100000000000.0, "rope_type": "default"}, "vocab_size": 32784,
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_falcon_pair(request.param)


def test_config_reads_the_published_falcon_h1_config():
    config = ModelConfig.from_dict(FALCON_H1_05B)
    assert config.layer_types == (LayerKind.HYBRID,) * 36
    assert config.attention_layer_ids == config.mamba2_layer_ids == config.recurrent_layer_ids == tuple(range(36))
    a, m, x = config.attention, config.mamba2, config.multipliers
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (8, 2, 64, 64, 1e11)
    assert a.softmax_scale == 64**-0.5 and not a.bias
    assert (m.num_heads, m.head_dim, m.num_groups, m.state_size, m.intermediate_size) == (24, 64, 1, 128, 1536)
    assert not m.rms_norm and not m.proj_bias and m.out_proj_bias is False and m.in_multipliers == (1.0,) * 5
    assert (x.embedding, x.logits, x.key, x.attention_out, x.mlp_gate, x.mlp_down) == (
        5.656854249492381, 0.0390625, 0.39062499999999994, 0.9375, 0.8838834764831844, 0.5859375)
    assert x.residual == x.logits_scaling == x.attention_in == x.ssm_in == x.ssm_out == 1.0
    assert config.mlp.intermediate_size == 2048 and config.max_position_embeddings == 16384


def test_two_state_layers_a_decoder_layer():
    """Worked example (3 layers): state layers A R A R A R, layer i's attention at 2i and its Mamba2 state at 2i + 1;
    the pools stack them by spec (one KV group of 3 layers, a conv and an ssm group of 3), so a block id covers every
    layer's KV and a slot id every layer's Mamba2 state, as for any model."""
    from hybridcache.state_spec import DevicePools

    ours = make_falcon_pair("no-norm").ours
    specs = ours.state_specs(torch.float32, torch.float32)
    assert ours.num_state_layers == 6 and [type(s) for s in specs] == [AttentionSpec, RecurrentSpec] * 3
    layer = ours.model.layers[1]
    assert specs[2:4] == (layer.self_attn.state_spec(torch.float32, torch.float32),
                          layer.mamba.state_spec(torch.float32, torch.float32))
    pools = DevicePools.allocate(specs, num_pages=4, kernel_block_size=16, num_slots=3)
    (kv,) = pools.kv_groups
    conv, ssm = pools.state_groups
    assert kv.shape[0] == conv.shape[0] == ssm.shape[0] == 3
    assert pools.layers[2].data_ptr() == kv[1].data_ptr() and pools.layers[3]["ssm"].data_ptr() == ssm[1].data_ptr()


def test_the_comparison_notices_lost_kv(pair):
    """The attention half of each layer reads its own KV: wiping every KV page after a prefill moves the next
    chunk's logits far past the tolerance (as a lost Mamba2 state does, the shared check)."""
    tokens = random_tokens(157, seed=4)
    ref = pair.hf_logits(tokens)
    runner = PagedRunner(pair.ours, 16, 8)
    runner.step([(0, tokens[:100])])
    for group in runner.pools.kv_groups:
        group.zero_()
    (ours,) = runner.step([(0, tokens[100:])])
    assert rel_err(ours, ref[100:]) > 100 * TOLERANCE


def test_every_multiplier_moves_the_logits():
    """The comparisons above would notice a multiplier left out: each of them set to 1 alone (the muP scalars, the
    Mamba2 in_proj scales) moves the logits far past the tolerance."""
    import dataclasses

    from hybridcache.models import load_weights

    pair = make_falcon_pair("norm-first")
    config, tokens = pair.ours.config, random_tokens(157, seed=1)
    ref = pair.hf_logits(tokens)
    m = config.multipliers
    wrong = [dataclasses.replace(config, multipliers=dataclasses.replace(m, **{field: 1.0}))
             for field in ("embedding", "logits", "key", "attention_in", "attention_out", "ssm_in", "ssm_out",
                           "mlp_gate", "mlp_down")]
    wrong.append(dataclasses.replace(config, mamba2=dataclasses.replace(config.mamba2, in_multipliers=(1.0,) * 5)))
    for changed in wrong:
        ours = get_model_class(config.architecture)(changed)
        load_weights(ours, pair.hf.state_dict())
        (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
        assert rel_err(logits, ref) > 100 * TOLERANCE, changed


@pytest.mark.parametrize("field, value, message", [
    ("attn_layer_indices", [3], "attn_layer_indices"),
    ("layers_block_type", ["hybrid"] * 35 + ["attention"], "layers_block_type"),
    ("mamba_use_mlp", False, "mamba_use_mlp false"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e11, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5"),
    ("mlp_bias", True, "mlp_bias true is not supported for Falcon-H1"),
    ("ssm_multipliers", [1.0, 1.0, 1.0, 1.0], "ssm_multipliers"),
    ("mlp_multipliers", [1.0, "2"], "mlp_multipliers"),
    ("mamba_d_head", 60, "mamba_d_head 60 x mamba_n_heads 24 must be mamba_d_ssm 1536"),
    ("mamba_n_groups", 5, "mamba_n_groups"),
    ("hidden_act", "gelu", "hidden_act"),
    ("key_multiplier", -1.0, "key_multiplier"),
])
def test_config_refuses_what_it_cannot_run(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**FALCON_H1_05B, field: value})


def test_defaults_are_transformers_defaults():
    """The fields config.json may leave out take `FalconH1Config`'s defaults; mamba_d_ssm written null is
    mamba_expand * hidden_size, num_key_value_heads written null num_attention_heads, as transformers reads them."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.FalconH1Config()
    for key, value in DEFAULTS["falcon_h1"].items():
        if key in ("rope_theta", "partial_rotary_factor"):
            assert value == hf.rope_parameters.get(key, 1.0), key
            continue
        want = "auto" if key == "mamba_d_head" else getattr(hf, key)  # (hf resolves "auto" when built)
        assert value == want, key
    minimal = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "vocab_size": 256,
               "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 16, "mamba_n_heads": 8}
    config = ModelConfig.from_dict(minimal)
    assert config.attention.num_kv_heads == hf.num_key_value_heads == 8 and config.attention.head_dim == 4
    assert config.mamba2.intermediate_size == hf.mamba_d_ssm == 1024 and config.mamba2.head_dim == 128
    assert config.mamba2.norm_before_gate == hf.mamba_norm_before_gate and not config.mamba2.rms_norm
    nulls = {"num_key_value_heads": None, "mamba_d_ssm": None}
    config = ModelConfig.from_dict({**minimal, **nulls})
    hf_nulls = transformers.FalconH1Config(**{k: v for k, v in minimal.items() if k != "architectures"}, **nulls)
    assert config.attention.num_kv_heads == hf_nulls.num_key_value_heads == 16
    assert config.mamba2.intermediate_size == hf_nulls.mamba_d_head * 8 == 128


def test_tensor_parallelism_and_fp8_are_refused_and_the_folder_loads(tmp_path):
    """save_pretrained writes the checkpoints' names (`final_layernorm`, `mamba`, `self_attn`, `feed_forward`); no
    mup_vector (a non-persistent buffer in transformers, computed here from ssm_multipliers)."""
    from safetensors import safe_open

    config = ModelConfig.from_dict(falcon_config("norm-first").to_dict())
    with pytest.raises(ValueError, match="tensor parallelism"):
        get_model_class(config.architecture)(config, TensorParallel(rank=0, size=2))
    hf = falcon_model("gate-first")
    hf.save_pretrained(tmp_path)
    for options, message in (({"quantization": "fp8"}, "FP8 weights"), ({"kv_fp8": True}, "an FP8 KV cache")):
        with pytest.raises(ValueError, match=f"FalconH1ForCausalLM does not support {message}"):
            load_model(tmp_path, **options)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"model.final_layernorm.weight", "model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.norm.weight",
            "model.layers.0.self_attn.k_proj.bias", "model.layers.0.feed_forward.gate_proj.weight"} <= names
    assert not any("mup_vector" in name for name in names)
    ours = load_model(tmp_path)
    tokens = random_tokens(40, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(40)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE
