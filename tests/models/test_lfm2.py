"""LFM2 (`Lfm2ForCausalLM`) and LFM2-MoE (`Lfm2MoeForCausalLM`) vs transformers on tiny random models (3-tap convs
with biases and tied embeddings; 4-tap convs from full_attn_idxs, untied; MoE blocks after one or two dense layers,
weights renormalised and scaled or not, a nonzero expert_bias), fp32, and their config parsing (transformers' aliases
and MLP width), checkpoint names and refusals.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the whole
sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.backend import ReferenceBackend
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
from .lfm2_helpers import MOE_VARIANTS, VARIANTS, lfm2_config, lfm2_model, make_lfm2_pair

CONV, ATTENTION = LayerKind.SHORT_CONV, LayerKind.FULL_ATTENTION

# LFM2-1.2B's config.json as published (the fields read here; transformers reads block_ff_dim over intermediate_size)
LFM2_1_2B = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "block_auto_adjust_ff_dim": True, "block_dim": 2048,
    "block_ff_dim": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "block_norm_eps": 1e-05,
    "bos_token_id": 1, "conv_L_cache": 3, "conv_bias": False, "conv_dim": 2048, "conv_dim_out": 2048, "eos_token_id": 7,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 2048, "max_position_embeddings": 128000, "norm_eps": 1e-05,
    "num_attention_heads": 32, "num_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pad_token_id": 0,
    "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "use_cache": True, "use_pos_enc": True, "vocab_size": 65536,
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_lfm2_pair(request.param)


def test_config_reads_the_lfm2_fields():
    config = ModelConfig.from_dict(lfm2_config("bias-k3").to_dict())
    assert config.layer_types == (CONV, CONV, ATTENTION, CONV, ATTENTION)
    assert config.recurrent_layer_ids == (0, 1, 3) and config.linear_layer_ids == ()
    assert (config.short_conv.conv_kernel_size, config.short_conv.bias, config.short_conv.conv_width) == (3, True, 2)
    assert config.mlp.intermediate_size == 96 and config.tie_word_embeddings and config.rms_norm_eps == 1e-5
    a = config.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta, a.bias) == (4, 2, 16, 16, 1e6, False)
    older = ModelConfig.from_dict(lfm2_config("idxs-k4").to_dict())
    assert older.layer_types == (CONV, ATTENTION, CONV, ATTENTION, CONV)
    assert older.mlp.intermediate_size == 80 and not older.tie_word_embeddings and not older.short_conv.bias
    moe = ModelConfig.from_dict(lfm2_config("moe-norm").to_dict())
    assert moe.model_type == "lfm2_moe" and [moe.is_moe_layer(i) for i in range(5)] == [False] + [True] * 4
    mlp = moe.mlp
    assert (mlp.intermediate_size, mlp.num_experts, mlp.num_experts_per_tok) == (96, 8, 3)
    assert mlp.moe_intermediate_size == 32
    assert mlp.norm_topk_prob and mlp.shared_expert_intermediate_size == 0
    routing = mlp.grouped_routing
    assert (routing.num_groups, routing.topk_groups, routing.scaling_factor, routing.renorm_eps) == (1, 1, 2.5, 1e-6)
    raw = ModelConfig.from_dict(lfm2_config("moe-raw").to_dict())
    assert [raw.is_moe_layer(i) for i in range(5)] == [False, False, True, True, True] and not raw.mlp.norm_topk_prob


@pytest.mark.parametrize("changes", [
    {},  # as published
    {"layer_types": None},
    {"tie_embedding": False, "tie_word_embeddings": True},  # transformers: tie_embedding wins
    {"intermediate_size": 8192},  # block_ff_dim still wins
    {"block_ff_dim": None, "intermediate_size": 10752, "block_auto_adjust_ff_dim": False},  # LFM2-2.6B's way
    {"block_ffn_dim_multiplier": 1.5, "block_multiple_of": 100},
    {"rms_norm_eps": 1e-3, "norm_eps": 1e-6},  # (rms_norm_eps is not read)
    {"full_attn_idxs": None},  # every layer attends
    {"head_dim": 128},
])
def test_published_spellings_read_as_transformers_reads_them(changes):
    """LFM2-1.2B's config.json with the aliases transformers' Lfm2Config takes (block_ff_dim, tie_embedding,
    full_attn_idxs, norm_eps): the layer kinds, the MLP width transformers' Lfm2MLP builds, the tie, the eps and the
    heads come out as transformers' model has them."""
    import transformers

    raw = {k: v for k, v in {**LFM2_1_2B, **changes}.items() if v is not None}
    small = {**raw, "hidden_size": 256, "block_dim": 256, "vocab_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2}  # (smaller, the same rules)
    ours = ModelConfig.from_dict(small)
    with torch.device("meta"):  # (the modules' shapes are what is compared)
        hf = transformers.Lfm2ForCausalLM(transformers.Lfm2Config.from_dict(dict(small)))
    layers = hf.model.layers
    assert ours.layer_types == tuple(ATTENTION if layer.is_attention_layer else CONV for layer in layers)
    assert ours.mlp.intermediate_size == layers[0].feed_forward.w1.out_features
    assert ours.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ours.rms_norm_eps == layers[0].operator_norm.variance_epsilon
    attention = next(layer.self_attn for layer in layers if layer.is_attention_layer)
    kv_heads = attention.k_proj.out_features // attention.head_dim
    assert (ours.attention.head_dim, ours.attention.num_kv_heads) == (attention.head_dim, kv_heads)
    assert ours.eos_token_ids == (7,) and ours.attention.use_rope


def test_defaults_are_transformers_defaults():
    """The fields config.json may leave out take `Lfm2Config`'s defaults."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.Lfm2Config()
    for key, value in DEFAULTS["lfm2"].items():
        if key in ("rope_theta", "partial_rotary_factor"):
            continue  # (in rope_parameters: below)
        assert value == getattr(hf, "norm_eps" if key == "rms_norm_eps" else key), key
    assert DEFAULTS["lfm2"]["rope_theta"] == hf.rope_parameters["rope_theta"]
    minimal = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 256, "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 16}  # (num_key_value_heads 8 by default)
    config = ModelConfig.from_dict(minimal)
    assert config.layer_types == (ATTENTION, ATTENTION) and config.tie_word_embeddings
    assert config.attention.head_dim == 4 and config.short_conv.conv_kernel_size == hf.conv_L_cache
    assert not config.short_conv.bias and config.mlp.intermediate_size == 8192  # (12,288 adjusted: 2/3, x 1.0, /256)


@pytest.mark.parametrize("field, value, message", [
    ("layer_types", ["conv", "mamba", "full_attention", "conv", "full_attention"], "layer_types"),
    ("layer_types", ["conv"] * 4, "layer_types"),
    ("conv_L_cache", 1, "conv_L_cache 1 must be at least 2"),
    ("attention_bias", True, "attention_bias true is not supported for LFM2"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5 is not supported for LFM2"),
    ("conv_bias", "no", "conv_bias"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_config_refuses_what_it_cannot_run(field, value, message):
    raw = {**lfm2_config("bias-k3").to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("field, value, message", [
    ("layer_types", None, "config.json has no layer_types"),
    ("use_expert_bias", False, "use_expert_bias false is not supported for LFM2-MoE"),
    ("num_experts_per_tok", 9, "num_experts_per_tok 9 must be between 1 and num_experts 8"),
    ("num_dense_layers", -1, "num_dense_layers -1 must be at least 0"),
])
def test_moe_config_refuses_what_it_cannot_run(field, value, message):
    raw = {**lfm2_config("moe-norm").to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_moe_defaults_are_transformers_defaults():
    """The fields an LFM2-MoE config.json may leave out take `Lfm2MoeConfig`'s defaults; no width adjustment, no
    block_ff_dim alias (Lfm2MoeMLP is intermediate_size wide)."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.Lfm2MoeConfig()
    for key, value in DEFAULTS["lfm2_moe"].items():
        if key not in ("rope_theta", "partial_rotary_factor"):
            assert value == getattr(hf, "norm_eps" if key == "rms_norm_eps" else key), key
    assert DEFAULTS["lfm2_moe"]["rope_theta"] == hf.rope_parameters["rope_theta"]
    minimal = {"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "vocab_size": 256,
               "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 16, "layer_types": ["conv"] * 3,
               "block_ff_dim": 99}
    config = ModelConfig.from_dict(minimal)
    assert config.mlp.intermediate_size == hf.intermediate_size and config.mlp.num_experts == hf.num_experts
    assert config.mlp.mlp_only_layers == (0, 1) and config.tie_word_embeddings is hf.tie_word_embeddings
    assert config.mlp.grouped_routing.scaling_factor == hf.routed_scaling_factor


def test_moe_router_equals_transformers_and_its_bias_changes_the_picks():
    """Our router (Nemotron-H's, one group) against transformers' Lfm2MoeTopKRouter with the block's expert_bias, on
    300 tokens: the same picks and weights; the bias changes some tokens' picks (so the model comparisons exercise
    it)."""
    pair = make_lfm2_pair("moe-norm")
    block = pair.hf.model.layers[1].feed_forward
    ours = pair.ours.model.layers[1].mlp.gate
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(5))
    backend = ReferenceBackend()
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(x, block.expert_bias)
        weights, ids = ours(x, backend)
        assert torch.equal(ids.sort(-1)[0], want_ids.sort(-1)[0])
        torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), want_weights.gather(1, want_ids.argsort(-1)),
                                   rtol=1e-6, atol=1e-7)
        picks = {(t, e) for t, row in enumerate(ids.tolist()) for e in row}
        bias = ours.e_score_correction_bias.detach().clone()
        ours.e_score_correction_bias.zero_()
        unbiased = {(t, e) for t, row in enumerate(ours(x, backend)[1].tolist()) for e in row}
        ours.e_score_correction_bias.copy_(bias)
    assert picks != unbiased


def test_full_attn_idxs_must_be_layer_indices():
    raw = {k: v for k, v in LFM2_1_2B.items()}
    with pytest.raises(ValueError, match="full_attn_idxs"):
        ModelConfig.from_dict({**raw, "full_attn_idxs": "2,5"})


@pytest.mark.parametrize("variant", ["bias-k3", "moe-norm"])
def test_tensor_parallelism_and_fp8_are_refused_with_a_clear_error(tmp_path, variant):
    config = ModelConfig.from_dict(lfm2_config(variant).to_dict())
    arch = config.architecture
    with pytest.raises(ValueError, match=f"{arch} does not run under tensor parallelism"):
        get_model_class(arch)(config, TensorParallel(rank=0, size=2))
    lfm2_model(variant).save_pretrained(tmp_path)
    for options, message in (({"quantization": "fp8"}, "FP8 weights"), ({"kv_fp8": True}, "an FP8 KV cache")):
        with pytest.raises(ValueError, match=f"{arch} does not support {message}"):
            load_model(tmp_path, **options)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_folder_loads_from_the_checkpoint_tensor_names(tmp_path, variant):
    """save_pretrained writes LFM2's names (operator_norm, ffn_norm, feed_forward.w1/w2/w3, self_attn.out_proj,
    q_layernorm / k_layernorm, conv.in_proj / conv / out_proj, model.embedding_norm; LFM2-MoE's feed_forward.gate,
    expert_bias and experts one by one, feed_forward.experts.{e}.w1/w3/w2), which the loader reads onto ours."""
    from safetensors import safe_open

    hf = lfm2_model(variant)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())  # noqa: SIM118
    attention, conv = hf.config.layer_types.index("full_attention"), hf.config.layer_types.index("conv")
    assert {"model.embedding_norm.weight", "model.layers.0.operator_norm.weight", "model.layers.0.ffn_norm.weight",
            "model.layers.0.feed_forward.w3.weight", f"model.layers.{conv}.conv.in_proj.weight",
            f"model.layers.{conv}.conv.conv.weight", f"model.layers.{attention}.self_attn.out_proj.weight",
            f"model.layers.{attention}.self_attn.q_layernorm.weight"} <= names
    assert ("lm_head.weight" in names) is not hf.config.tie_word_embeddings
    if variant in MOE_VARIANTS:
        moe = hf.config.num_dense_layers
        assert {f"model.layers.{moe}.feed_forward.gate.weight", f"model.layers.{moe}.feed_forward.expert_bias",
                f"model.layers.{moe}.feed_forward.experts.1.w3.weight"} <= names
    ours = load_model(tmp_path)
    assert type(ours).__name__ == hf.config.architectures[0]
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) is hf.config.tie_word_embeddings
    tokens = random_tokens(90, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(90)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE


def test_state_specs_hold_the_conv_state_and_the_kv():
    config = ModelConfig.from_dict(lfm2_config("bias-k3").to_dict())
    specs = get_model_class(config.architecture)(config).state_specs(torch.bfloat16, torch.float32)
    (conv,) = specs[0].tensors
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (64, 2), torch.bfloat16)
    assert (specs[2].num_kv_heads, specs[2].head_dim) == (2, 16)


def test_dummy_weights_draw_its_norms_around_one(tmp_path):
    """`load_format="dummy"`: LFM2's norms (operator / ffn norms, q / k layernorms, the final embedding_norm) scale by
    their weight, so they are drawn around 1; the logits finite."""
    lfm2_config("bias-k3").save_pretrained(tmp_path)
    model = load_model(tmp_path, load_format="dummy")
    norms = {name: p for name, p in model.named_parameters() if name.endswith("norm.weight")}
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.2.self_attn.q_norm.weight",
            "model.layers.2.post_attention_layernorm.weight"} <= set(norms)
    for name, weight in norms.items():
        assert 0.5 < weight.float().mean() < 1.5, name
    (logits,) = PagedRunner(model, 16, 8).step([(0, random_tokens(70, seed=2))])
    assert bool(torch.isfinite(logits).all()) and logits.std() > 0.1


def test_an_untied_head_under_tie_embedding_names_the_field_that_ties(tmp_path, caplog):
    """A checkpoint whose lm_head.weight differs from the embedding under `tie_embedding: true` is used untied (as
    transformers does), and the warning names LFM2's `tie_embedding`, which wins over `tie_word_embeddings` (it
    said to set only tie_word_embeddings false, which leaves LFM2 tied: hunt 224)."""
    import json
    import logging

    from safetensors.torch import load_file, save_file

    lfm2_model("bias-k3").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_embedding": True, "tie_word_embeddings": False}))
    with caplog.at_level(logging.WARNING, logger="hybridcache.models.loader"):
        model = load_model(tmp_path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert any("tie_embedding" in record.message for record in caplog.records)
