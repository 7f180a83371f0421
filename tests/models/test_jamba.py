"""Jamba (`JambaForCausalLM`) vs transformers on tiny random models (Mamba1 layers with Jamba's dt / B / C norms,
attention without RoPE; a dense MLP after every mixer, or MoE blocks of top-2-of-4 softmax routing not renormalised
at every second layer; tied and untied lm_head), fp32, and its config parsing and refusals.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the whole
sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class, load_model
from hybridcache.models.config import LayerKind

from .helpers import TOLERANCE, PagedRunner, random_tokens, rel_err
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `pair`
    test_decode_after_prefill_matches_full_and_incremental_forward,
    test_mixed_batch_of_prefill_chunks_and_decodes,
    test_single_prefill_and_chunked_prefill,
    test_the_comparison_notices_a_lost_recurrent_state,
)
from .jamba_helpers import VARIANTS, jamba_config, jamba_model, make_jamba_pair

MAMBA, ATTENTION = LayerKind.MAMBA1, LayerKind.FULL_ATTENTION
# ai21labs/Jamba-v0.1's config.json as published (AI21-Jamba-1.5-Mini's writes the same fields, with eos_token_id
# [2, 518])
JAMBA_V01 = {
    "architectures": ["JambaForCausalLM"], "attention_dropout": 0.0, "attn_layer_offset": 4, "attn_layer_period": 8,
    "bos_token_id": 1, "eos_token_id": 2, "expert_layer_offset": 1, "expert_layer_period": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "mamba_conv_bias": True,
    "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_dt_rank": 256, "mamba_expand": 2, "mamba_proj_bias": False,
    "max_position_embeddings": 262144, "model_type": "jamba", "num_attention_heads": 32, "num_experts": 16,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_logits_to_keep": 1,
    "output_router_logits": False, "pad_token_id": 0, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
    "use_cache": True, "use_mamba_kernels": True, "vocab_size": 65536,
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_jamba_pair(request.param)


def test_the_model_holds_the_layers_the_config_names(pair):
    """Mamba1 mixers where transformers has JambaMambaDecoderLayer, MoE blocks where it has JambaSparseMoeBlock; the
    state of a slot is the Mamba1 layers' conv [I, K-1] and ssm [I, N]."""
    config = pair.ours.config
    for layer_id, (ours, theirs) in enumerate(zip(pair.ours.model.layers, pair.hf.model.layers, strict=True)):
        assert (config.layer_types[layer_id] is MAMBA) == hasattr(theirs, "mamba")
        assert (type(ours.mlp).__name__ == "JambaMoE") == (type(theirs.feed_forward).__name__ == "JambaSparseMoeBlock")
    m = config.mamba1
    runner = PagedRunner(pair.ours, 16, 8)
    slot_floats = sum(t.numel() // t.shape[1] for t in runner.pools.state_groups)  # per slot, every group
    assert slot_floats == len(config.mamba1_layer_ids) * m.intermediate_size * (m.conv_width + m.state_size)


def test_config_reads_the_jamba_fields():
    config = ModelConfig.from_dict(jamba_config("moe").to_dict())
    assert config.layer_types == (MAMBA, ATTENTION, MAMBA, MAMBA, ATTENTION, MAMBA)
    assert config.mamba1_layer_ids == config.recurrent_layer_ids == (0, 2, 3, 5)
    assert config.attention_layer_ids == (1, 4) and config.mamba2 is None and config.linear_layer_ids == ()
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert all(config.has_feed_forward(i) for i in range(6))
    mlp = config.mlp
    assert (mlp.num_experts, mlp.num_experts_per_tok, mlp.moe_intermediate_size) == (4, 2, 96)
    assert not mlp.norm_topk_prob and mlp.shared_expert_intermediate_size == 0 and mlp.intermediate_size == 96
    m = config.mamba1
    assert (m.intermediate_size, m.state_size, m.dt_rank, m.conv_kernel_size) == (128, 16, 8, 4)
    assert m.conv_bias and not m.proj_bias
    a = config.attention
    assert not a.use_rope and a.head_dim == 16 and a.num_kv_heads == 2 and a.softmax_scale == 16**-0.5
    assert config.rms_norm_eps == 1e-5 and config.tie_word_embeddings and config.mamba_ssm_dtype is None
    dense = ModelConfig.from_dict(jamba_config("dense").to_dict())
    assert not any(dense.is_moe_layer(i) for i in range(6)) and dense.mlp.num_experts == 0
    assert dense.attention.head_dim == 24 and dense.mamba1.proj_bias and not dense.mamba1.conv_bias


def test_config_reads_the_published_configs():
    """Jamba-v0.1's config.json: attention at layers 4, 12, 20, 28, MoE at every odd layer, dt rank 256; the older
    fields (`mamba_inner_layernorms` true, `n_ctx`, `calc_logits_for_entire_prompt`, `sliding_window` null) read or
    left; a `layers_block_type` that agrees is taken; `mamba_dt_rank` "auto" is ceil(hidden_size / 16)."""
    config = ModelConfig.from_dict(JAMBA_V01)
    assert config.attention_layer_ids == (4, 12, 20, 28) and len(config.mamba1_layer_ids) == 28
    assert [i for i in range(32) if config.is_moe_layer(i)] == list(range(1, 32, 2))
    assert config.mamba1.dt_rank == 256 and config.mamba1.intermediate_size == 8192
    assert config.attention.head_dim == 128 and config.max_position_embeddings == 262144
    older = {**JAMBA_V01, "mamba_inner_layernorms": True, "n_ctx": 262144, "calc_logits_for_entire_prompt": False,
             "layers_block_type": ["attention" if i % 8 == 4 else "mamba" for i in range(32)], "mamba_dt_rank": "auto"}
    assert ModelConfig.from_dict(older).layer_types == config.layer_types
    assert ModelConfig.from_dict(older).mamba1.dt_rank == 256
    assert ModelConfig.from_dict({**older, "hidden_size": 2600}).mamba1.dt_rank == 163
    assert ModelConfig.from_dict({**JAMBA_V01, "eos_token_id": [2, 518]}).eos_token_ids == (2, 518)
    one_expert = ModelConfig.from_dict({**JAMBA_V01, "num_experts": 1})
    assert not any(one_expert.is_moe_layer(i) for i in range(32))


def test_defaults_are_transformers_defaults():
    """The fields config.json may leave out take `JambaConfig`'s defaults."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.JambaConfig()
    for key, value in DEFAULTS["jamba"].items():
        if key not in ("rope_theta", "partial_rotary_factor", "mamba_dt_rank"):  # (no RoPE; dt rank resolved)
            assert value == getattr(hf, key), key
    minimal = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "vocab_size": 256, "hidden_size": 64,
               "num_hidden_layers": 8, "num_attention_heads": 16}
    config = ModelConfig.from_dict(minimal)
    hf = transformers.JambaConfig(**{k: v for k, v in minimal.items() if k != "architectures"})
    assert config.layer_types == tuple(MAMBA if kind == "mamba" else ATTENTION for kind in hf.layers_block_type)
    assert [config.is_moe_layer(i) for i in range(8)] == [n > 1 for n in hf.layers_num_experts]
    assert config.mamba1.dt_rank == hf.mamba_dt_rank and config.attention.head_dim == 4
    assert config.attention.num_kv_heads == hf.num_key_value_heads and config.mamba1.state_size == hf.mamba_d_state


@pytest.mark.parametrize("field, value, message", [
    ("attn_layer_offset", 3, "attn_layer_offset 3 must be smaller than attn_layer_period 3"),
    ("expert_layer_offset", 2, "expert_layer_offset 2 must be smaller than expert_layer_period 2"),
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
    ("layers_block_type", ["mamba"] * 6, "layers_block_type"),
    ("mamba_inner_layernorms", False, "mamba_inner_layernorms"),
    ("num_experts_per_tok", 5, "num_experts_per_tok 5"),
    ("mamba_d_conv", 1, "mamba_d_conv"),
    ("mamba_dt_rank", "full", "mamba_dt_rank"),
])
def test_config_refuses_what_it_cannot_run(field, value, message):
    raw = {**jamba_config("moe").to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


# the fields read for Jamba that JambaConfig requires a value of (`config.jamba.JAMBA_NOT_NULL`)
NOT_NULL = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "num_experts", "num_local_experts",
    "num_experts_per_tok", "expert_layer_period", "expert_layer_offset", "attn_layer_period", "attn_layer_offset",
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank", "mamba_conv_bias", "mamba_proj_bias",
)


@pytest.mark.parametrize("field", NOT_NULL)
def test_config_refuses_the_nulls_jambaconfig_refuses(field):
    """A field JambaConfig types without None, written null, is refused naming it (not read as its default: a null
    num_key_value_heads was 8, rms_norm_eps 1e-6), as transformers' strict JambaConfig refuses it (a null
    `num_local_experts`, its alias, leaves it no expert count)."""
    import transformers

    raw = {**jamba_config("moe").to_dict(), field: None}
    if field == "num_local_experts":
        assert transformers.JambaConfig(**raw).num_experts is None
    else:
        with pytest.raises(Exception, match=field):
            transformers.JambaConfig(**raw)
    with pytest.raises(ValueError, match=f"config.json {field} is null: transformers' JambaConfig requires a value"):
        ModelConfig.from_dict(raw)


def test_every_default_jambaconfig_requires_is_refused_when_null():
    """Each JambaConfig field with a default here (`DEFAULTS["jamba"]`) whose type excludes None is refused null
    (`JAMBA_NOT_NULL`, the fields tested above); a null head_dim (no JambaConfig field) still means hidden_size /
    num_attention_heads."""
    import dataclasses

    import transformers

    from hybridcache.models.config.defaults import DEFAULTS
    from hybridcache.models.config.jamba import JAMBA_NOT_NULL

    assert JAMBA_NOT_NULL == NOT_NULL
    required = {f.name for f in dataclasses.fields(transformers.JambaConfig) if "None" not in str(f.type)}
    assert required & set(DEFAULTS["jamba"]) <= set(NOT_NULL)
    assert set(NOT_NULL) - {"num_local_experts"} <= required
    assert ModelConfig.from_dict({**jamba_config("moe").to_dict(), "head_dim": None}).attention.head_dim == 16


def test_tensor_parallelism_and_fp8_are_refused_with_a_clear_error(tmp_path):
    config = ModelConfig.from_dict(jamba_config("moe").to_dict())
    with pytest.raises(ValueError, match="tensor parallelism"):
        get_model_class(config.architecture)(config, TensorParallel(rank=0, size=2))
    jamba_model("moe").save_pretrained(tmp_path)
    for options, message in (({"quantization": "fp8"}, "FP8 weights"), ({"kv_fp8": True}, "an FP8 KV cache")):
        with pytest.raises(ValueError, match=f"JambaForCausalLM does not support {message}"):
            load_model(tmp_path, **options)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_folder_loads_from_the_checkpoint_tensor_names(variant, tmp_path):
    """save_pretrained writes the hub checkpoints' names (model.final_layernorm, the experts one by one under
    feed_forward.experts.{e}, feed_forward.router, the Mamba1 layers' x_proj / dt_proj / dt_layernorm ...);
    load_model reads them (the in-memory stacked form is what the other tests load)."""
    from safetensors import safe_open

    hf = jamba_model(variant)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"model.final_layernorm.weight", "model.layers.0.mamba.x_proj.weight", "model.layers.0.mamba.A_log",
            "model.layers.0.mamba.dt_layernorm.weight", "model.layers.4.pre_ff_layernorm.weight"} <= names
    if variant == "moe":
        assert {"model.layers.1.feed_forward.router.weight", "model.layers.5.feed_forward.experts.3.up_proj.weight",
                "model.layers.3.feed_forward.experts.0.gate_proj.weight"} <= names
        assert "lm_head.weight" not in names  # (tied)
    ours = load_model(tmp_path)
    assert type(ours).__name__ == "JambaForCausalLM"
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (variant == "moe")
    tokens = random_tokens(40, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(40)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE


def test_num_local_experts_is_read_as_transformers_reads_it(tmp_path):
    """`num_local_experts` is JambaConfig's alias of `num_experts` (its attribute_map): a config.json writing it gets
    that many experts, as transformers builds (not the default 16); one writing both, different, is refused."""
    import json

    import transformers

    raw = jamba_config("moe").to_dict()
    raw["num_local_experts"] = raw.pop("num_experts")
    assert raw["num_local_experts"] == 4
    assert ModelConfig.from_dict(raw).mlp.num_experts == transformers.JambaConfig(**raw).num_experts == 4
    assert ModelConfig.from_dict({**raw, "num_experts": 4}).mlp.num_experts == 4
    with pytest.raises(ValueError, match="num_local_experts 4 and num_experts 16 disagree"):
        ModelConfig.from_dict({**raw, "num_experts": 16})
    hf = jamba_model("moe")
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_model(tmp_path)
    assert ours.config.mlp.num_experts == 4
    tokens = random_tokens(40, seed=9)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    reloaded = transformers.JambaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = reloaded(input_ids=torch.tensor([tokens]), position_ids=torch.arange(40)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE


def test_the_comparison_notices_renormalised_routing(monkeypatch):
    """Routing that renormalises the top-k weights (Qwen's, Granite's) moves the MoE model's logits well past the
    tolerance: the comparisons above check that Jamba's are left as the softmax gives them."""
    from hybridcache.kernels.backend import ReferenceBackend

    pair = make_jamba_pair("moe")
    tokens = random_tokens(157, seed=8)
    ref = pair.hf_logits(tokens)
    (ours,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(ours, ref) <= TOLERANCE
    route = ReferenceBackend.route
    monkeypatch.setattr(ReferenceBackend, "route", staticmethod(lambda logits, k, renormalize: route(logits, k, True)))
    (ours,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(ours, ref) > 100 * TOLERANCE
