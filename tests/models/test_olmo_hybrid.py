"""OLMo Hybrid (`OlmoHybridForCausalLM`) vs transformers on tiny random models (no RoPE with 2 key heads for 4 value
heads and beta up to 2, as the released checkpoints; RoPE with attention biases and the DeltaNet dims transformers
derives), fp32, and its config parsing, checkpoint names and refusals.

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

from .helpers import TOLERANCE, PagedRunner, random_tokens, rel_err
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `pair`
    test_decode_after_prefill_matches_full_and_incremental_forward,
    test_mixed_batch_of_prefill_chunks_and_decodes,
    test_single_prefill_and_chunked_prefill,
    test_the_comparison_notices_a_lost_recurrent_state,
)
from .olmo_hybrid_helpers import TINY_OLMO, VARIANTS, make_olmo_pair, olmo_config, olmo_model


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_olmo_pair(request.param)


def test_config_reads_the_olmo_fields():
    config = ModelConfig.from_dict(olmo_config("nope-gva").to_dict())
    assert config.layer_types == (LayerKind.LINEAR_ATTENTION, LayerKind.LINEAR_ATTENTION, LayerKind.FULL_ATTENTION,
                                  LayerKind.LINEAR_ATTENTION, LayerKind.FULL_ATTENTION)
    delta, attention = config.gated_delta, config.attention
    assert (delta.num_k_heads, delta.num_v_heads, delta.k_head_dim, delta.v_head_dim) == (2, 4, 16, 16)
    assert delta.allow_neg_eigval and delta.beta_scale == 2.0
    assert not attention.use_rope and (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 2, 16)
    assert config.mlp.intermediate_size == 96 and config.mlp.num_experts == 0 and not config.attention.bias
    rope = ModelConfig.from_dict(olmo_config("rope-bias").to_dict())
    assert rope.attention.use_rope and rope.attention.rotary_dim == 16 and rope.attention.rope_theta == 500000.0
    assert rope.attention.bias and rope.gated_delta.beta_scale == 1.0
    assert (rope.gated_delta.num_k_heads, rope.gated_delta.k_head_dim, rope.gated_delta.v_head_dim) == (4, 12, 24)


@pytest.mark.parametrize("rope_fields, use_rope", [
    ({"rope_parameters": {"rope_theta": None}}, False),  # the released checkpoints
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, False),
    ({"rope_theta": None}, False),  # OLMo-core's converter before its fix
    ({"rope_parameters": None}, True),  # transformers: its default RoPE, theta 10,000
    ({}, True),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 8.0}}, True),
])
def test_rope_follows_transformers(rope_fields, use_rope):
    """RoPE exactly where transformers' OlmoHybridModel builds its rotary embedding."""
    import transformers

    raw = {**olmo_config("rope-bias").to_dict(), "model_type": "olmo_hybrid"}
    raw.pop("rope_parameters")
    raw.update(rope_fields)
    assert ModelConfig.from_dict(raw).attention.use_rope is use_rope
    hf = transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig.from_dict(json.loads(json.dumps(raw))))
    assert (hf.model.rotary_emb is not None) is use_rope


def test_defaults_are_transformers_defaults():
    """The fields config.json may leave out take `OlmoHybridConfig`'s defaults, the derived ones included."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.OlmoHybridConfig()
    for key, value in DEFAULTS["olmo_hybrid"].items():
        if key not in ("rope_theta", "partial_rotary_factor"):  # (in rope_parameters: below)
            assert value == getattr(hf, key), key
    assert DEFAULTS["olmo_hybrid"]["rope_theta"] == hf.rope_parameters["rope_theta"]
    minimal = {"architectures": ["OlmoHybridForCausalLM"], "model_type": "olmo_hybrid", "vocab_size": 256,
               "hidden_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4}
    hf = transformers.OlmoHybridConfig(**minimal)
    config = ModelConfig.from_dict(minimal)
    assert config.layer_types == tuple(LayerKind(kind) for kind in hf.layer_types)
    delta = config.gated_delta
    assert (delta.num_k_heads, delta.num_v_heads, delta.k_head_dim, delta.v_head_dim, delta.conv_kernel_size) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    assert delta.allow_neg_eigval is hf.linear_allow_neg_eigval is True
    assert (config.attention.num_kv_heads, config.attention.head_dim) == (hf.num_key_value_heads, 96 // 4)
    assert config.attention.use_rope and not config.tie_word_embeddings and config.rms_norm_eps == hf.rms_norm_eps
    two = ModelConfig.from_dict({**minimal, "num_hidden_layers": 2})  # no fourth layer: the last one attends
    assert two.layer_types == (LayerKind.LINEAR_ATTENTION, LayerKind.FULL_ATTENTION)


@pytest.mark.parametrize("field, value, message", [
    ("layer_types", ["linear_attention"] * 5, "at least one 'linear_attention' and one 'full_attention'"),
    ("layer_types", ["full_attention"] * 5, "at least one 'linear_attention' and one 'full_attention'"),
    ("layer_types", ["linear_attention", "mamba", "full_attention", "linear_attention", "full_attention"],
     "layer_types"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5 is not supported for OLMo Hybrid"),
    ("hidden_act", "gelu", "hidden_act"),
    ("linear_allow_neg_eigval", "yes", "linear_allow_neg_eigval"),
    ("linear_num_key_heads", 3, "DeltaNet value heads"),
])
def test_config_refuses_what_it_cannot_run(field, value, message):
    raw = {**olmo_config("nope-gva").to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_tensor_parallelism_and_fp8_are_refused_with_a_clear_error(tmp_path):
    config = ModelConfig.from_dict(olmo_config("nope-gva").to_dict())
    with pytest.raises(ValueError, match="OlmoHybridForCausalLM does not run under tensor parallelism"):
        get_model_class(config.architecture)(config, TensorParallel(rank=0, size=2))
    olmo_model("nope-gva").save_pretrained(tmp_path)
    for options, message in (({"quantization": "fp8"}, "FP8 weights"), ({"kv_fp8": True}, "an FP8 KV cache")):
        with pytest.raises(ValueError, match=f"OlmoHybridForCausalLM does not support {message}"):
            load_model(tmp_path, **options)


def _saved(tmp_path, variant: str = "nope-gva"):
    """A saved tiny folder: (transformers' model, the checkpoint's tensors by name)."""
    from safetensors import safe_open

    hf = olmo_model(variant)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        return hf, {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _assert_loads_as(tmp_path, hf) -> None:
    ours = load_model(tmp_path)
    tokens = random_tokens(90, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(90)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE


def test_folder_loads_from_the_checkpoint_tensor_names(tmp_path):
    """save_pretrained writes the conv as the checkpoints do (q_conv1d, k_conv1d, v_conv1d) and the DeltaNet layers'
    norms as transformers' conversion mapping names them (attention_layer_norm, feedforward_layer_norm)."""
    hf, tensors = _saved(tmp_path)
    assert {"model.layers.0.linear_attn.q_conv1d.weight", "model.layers.0.linear_attn.v_conv1d.weight",
            "model.layers.0.attention_layer_norm.weight", "model.layers.0.linear_attn.o_norm.weight",
            "model.layers.2.self_attn.q_norm.weight"} <= set(tensors)
    assert "model.layers.0.linear_attn.conv1d.weight" not in tensors
    _assert_loads_as(tmp_path, hf)


def test_folder_loads_under_the_released_checkpoints_norm_names(tmp_path):
    """Olmo-Hybrid-7B's safetensors name the DeltaNet layers' norms input_layernorm / post_attention_layernorm (and
    the attention layers' post_attention_layernorm / post_feedforward_layernorm): those load too."""
    from safetensors.torch import save_file

    hf, tensors = _saved(tmp_path)
    renamed = {}
    for name, tensor in tensors.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        deltanet = layer is not None and hf.config.layer_types[layer] == "linear_attention"
        name = name.replace("attention_layer_norm", "input_layernorm") if deltanet else name
        name = name.replace("feedforward_layer_norm", "post_attention_layernorm")
        renamed[name] = tensor
    assert "model.layers.2.post_attention_layernorm.weight" in renamed
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _assert_loads_as(tmp_path, hf)


def test_conv_row_blocks_that_do_not_fit_are_named(tmp_path):
    from safetensors.torch import save_file

    from hybridcache.models.loader import load_weights

    hf, tensors = _saved(tmp_path)
    ours = get_model_class("OlmoHybridForCausalLM")(ModelConfig.from_dict(hf.config.to_dict()))
    q = "model.layers.0.linear_attn.q_conv1d.weight"
    without_k = {n: t for n, t in tensors.items() if n != "model.layers.0.linear_attn.k_conv1d.weight"}
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.linear_attn.k_conv1d.weight' \(with"):
        load_weights(ours, without_k)
    with pytest.raises(ValueError, match=r"shape mismatch for tensors 'model.layers.0.linear_attn.q_conv1d.weight'"):
        load_weights(ours, {**tensors, q: tensors[q][:-1]})
    both = {**tensors, "model.layers.0.linear_attn.conv1d.weight": hf.state_dict()[
        "model.layers.0.linear_attn.conv1d.weight"]}
    with pytest.raises(ValueError, match="linear_attn.conv1d.weight' given twice"):
        load_weights(ours, both)
    save_file(without_k, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_conv1d.weight"):
        load_model(tmp_path)


def test_beta_above_one_is_exercised_and_matters():
    """The tiny model's beta = 2 sigmoid(b) reaches past 1 (the negative eigenvalues the flag allows), and the same
    weights without the flag give other logits: the comparison above would catch a beta left unscaled."""
    pair = make_olmo_pair("nope-gva")
    layer = pair.hf.model.layers[0].linear_attn
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (2 * layer.b_proj(x).sigmoid()).max() > 1.5
    tokens = random_tokens(157, seed=5)
    (scaled,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    for module in pair.ours.modules():
        if hasattr(module, "beta_scale"):
            module.beta_scale = 1.0
    (unscaled,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(unscaled, scaled) > 100 * TOLERANCE


def test_state_specs_hold_the_deltanet_state_and_the_kv():
    config = ModelConfig.from_dict(olmo_config("nope-gva").to_dict())
    specs = get_model_class(config.architecture)(config).state_specs(torch.bfloat16, torch.float32)
    conv, ssm = specs[0].tensors
    assert (conv.shape, conv.dtype, ssm.shape, ssm.dtype) == ((2 * 32 + 64, 3), torch.bfloat16, (4, 16, 16),
                                                              torch.float32)
    assert (specs[2].num_kv_heads, specs[2].head_dim) == (2, 16)
    assert TINY_OLMO["num_hidden_layers"] == len(specs)


def test_dummy_weights_draw_its_norms_around_one(tmp_path):
    """`load_format="dummy"`: every OLMo norm (the layer norms, q_norm / k_norm, the DeltaNet's o_norm, the final
    norm) scales by its weight, so it is drawn around 1, not around 0 as Qwen's zero-centred norms; the DeltaNet's
    decay parameters as Qwen's; the logits finite."""
    olmo_config("nope-gva").save_pretrained(tmp_path)
    model = load_model(tmp_path, load_format="dummy")
    norms = {name: p for name, p in model.named_parameters() if name.endswith("norm.weight")}
    assert {"model.norm.weight", "model.layers.0.linear_attn.o_norm.weight", "model.layers.2.self_attn.q_norm.weight",
            "model.layers.2.post_feedforward_layernorm.weight"} <= set(norms)
    for name, weight in norms.items():
        assert 0.5 < weight.float().mean() < 1.5, name
    a_log = model.model.layers[0].linear_attn.A_log
    assert bool((a_log < 0).all()) and bool((model.model.layers[0].linear_attn.dt_bias.abs() <= 1).all())
    (logits,) = PagedRunner(model, 16, 8).step([(0, random_tokens(70, seed=2))])
    assert bool(torch.isfinite(logits).all()) and logits.std() > 0.1
