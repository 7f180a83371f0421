"""ModelConfig parsing: transformers-5 and older layouts, nesting, derived sizes, errors; no torch import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridcache.models import ModelConfig
from hybridcache.state_spec import AttentionSpec, RecurrentSpec

from .helpers import make_pair


def base_dict(**changes) -> dict:
    raw = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 96,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "rope_theta": 5000.0,
        "partial_rotary_factor": 0.5,
        "eos_token_id": [5, 6],
        "torch_dtype": "bfloat16",
    }
    raw.update(changes)
    return raw


def test_older_layout_with_defaults():
    config = ModelConfig.from_dict(base_dict())
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    assert config.linear_layer_ids == (0, 1, 2, 4, 5, 6) and config.attention_layer_ids == (3, 7)
    assert (config.attention.rope_theta, config.attention.partial_rotary_factor, config.attention.rotary_dim) == (
        5000.0,
        0.5,
        16,
    )
    assert config.eos_token_ids == (5, 6) and config.torch_dtype == "bfloat16"
    assert config.gated_delta.conv_dim == 2 * 32 + 32 and config.gated_delta.conv_width == 3
    # sparse on odd layers (decoder_sparse_step 2) except layer 3 (mlp_only_layers)
    assert [config.is_moe_layer(i) for i in range(8)] == [False, True, False, False, False, True, False, True]


def test_transformers5_rope_parameters_and_multimodal_nesting():
    text = base_dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        model_type="qwen3_5_moe_text",
        dtype="float32",
    )
    raw = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": True,
        "eos_token_id": 9,
    }
    config = ModelConfig.from_dict(raw)
    assert config.model_type == "qwen3_5_moe_text" and config.architecture == raw["architectures"][0]
    assert (config.attention.rope_theta, config.attention.rotary_dim, config.torch_dtype) == (1e7, 8, "float32")
    assert config.tie_word_embeddings and config.eos_token_ids == (9,)
    assert all(config.is_moe_layer(i) for i in range(8))  # Qwen3.5-MoE: every layer


def test_round_trip_of_a_transformers_config_gives_matching_state_specs():
    pair = make_pair("qwen3_5_text")
    specs = pair.ours.state_specs(torch.float32, torch.float32)
    hf = pair.hf_config
    assert sum(isinstance(s, RecurrentSpec) for s in specs) == hf.layer_types.count("linear_attention")
    assert sum(isinstance(s, AttentionSpec) for s in specs) == hf.layer_types.count("full_attention")
    conv = pair.hf.model.layers[0].linear_attn.conv1d.weight
    (conv_spec,) = (t for t in specs[0].tensors if t.name == "conv")
    assert conv_spec.shape == (conv.shape[0], conv.shape[-1] - 1)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"architectures": []}, "architectures"),
        ({"model_type": "mamba2"}, "unsupported model_type"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),  # yarn: test_scaled_rope.py
        ({"hidden_act": "gelu"}, "gelu"),
        ({"layer_types": ["linear_attention"] * 7}, "layer_types"),
        ({"num_key_value_heads": 3}, "kv heads"),
    ],
)
def test_unsupported_settings_raise(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(base_dict(**changes))


def test_generation_config_eos_ids_are_merged(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(base_dict(eos_token_id=5)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (5, 7)


def test_config_module_does_not_import_torch():
    code = "import sys; from hybridcache.models import ModelConfig; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env
    )
    assert result.stdout.strip() == "False"


# the fields that size the model: config.json must give them (transformers' classes have defaults for them too)
_REQUIRED = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
_TRANSFORMERS_CLASSES = {"qwen3_5_text": "Qwen3_5TextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
                         "qwen3_next": "Qwen3NextConfig"}


@pytest.mark.parametrize("model_type", sorted(_TRANSFORMERS_CLASSES))
def test_fields_left_out_take_transformers_defaults(model_type):
    """A config.json that leaves out num_experts_per_tok (and the rest) routes as transformers' class does."""
    import transformers

    hf = getattr(transformers, _TRANSFORMERS_CLASSES[model_type])(**_REQUIRED)
    ours = ModelConfig.from_dict({"architectures": ["X"], "model_type": model_type, **_REQUIRED})
    attention, delta, mlp = ours.attention, ours.gated_delta, ours.mlp
    assert ours.layer_types == tuple(hf.layer_types)
    assert (ours.max_position_embeddings, ours.rms_norm_eps, ours.tie_word_embeddings) == (
        hf.max_position_embeddings, hf.rms_norm_eps, hf.tie_word_embeddings)
    assert (attention.num_kv_heads, attention.head_dim, attention.bias) == (
        hf.num_key_value_heads, hf.head_dim, hf.attention_bias)
    assert (attention.rope_theta, attention.partial_rotary_factor) == (
        hf.rope_parameters["rope_theta"], hf.rope_parameters["partial_rotary_factor"])
    assert (delta.num_k_heads, delta.num_v_heads, delta.k_head_dim, delta.v_head_dim, delta.conv_kernel_size) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    assert mlp.intermediate_size == getattr(hf, "intermediate_size", None)
    if model_type != "qwen3_5_text":
        assert (mlp.num_experts, mlp.num_experts_per_tok, mlp.moe_intermediate_size,
                mlp.shared_expert_intermediate_size) == (hf.num_experts, hf.num_experts_per_tok,
                                                         hf.moe_intermediate_size, hf.shared_expert_intermediate_size)
        assert mlp.num_experts_per_tok > 0


def _write_folder(path: Path, config, generation=None) -> Path:
    import json

    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(
            generation if isinstance(generation, str) else json.dumps(generation))
    return path


def _without(key: str) -> dict:
    raw = base_dict()
    del raw[key]
    return raw


@pytest.mark.parametrize("config,message", [
    ("{not json", r"config\.json is not valid JSON"),
    ("[1, 2]", r"config\.json must hold a JSON object"),
    (_without("num_hidden_layers"), "config.json has no 'num_hidden_layers'"),
    (_without("num_attention_heads"), "config.json has no 'num_attention_heads'"),
    (base_dict(num_hidden_layers="eight"), "config.json num_hidden_layers 'eight' is not an integer"),
    (base_dict(num_key_value_heads=0), "config.json num_key_value_heads 0 must be at least 1"),
    (base_dict(full_attention_interval=0), "config.json full_attention_interval 0 must be at least 1"),
    (base_dict(eos_token_id=[2, None]), r"config.json eos_token_id \[2, None\] must be a token id"),
    (base_dict(layer_types=[{"a": 1}] * 8), "config.json layer_types .* must be a list of layer type names"),
    (base_dict(num_experts_per_tok=0), "config.json num_experts_per_tok 0 must be at least 1"),
    (base_dict(num_experts_per_tok=5), "config.json num_experts_per_tok 5 must be between 1 and num_experts 4"),
    (base_dict(rope_parameters=[1]), "config.json rope_parameters"),
    # a kernel of 1 keeps no conv state: transformers runs it, the engine crashed at start-up (a state of 0 bytes)
    (base_dict(linear_conv_kernel_dim=1), "config.json linear_conv_kernel_dim 1 must be at least 2"),
    ({"architectures": ["X"], "model_type": "qwen3_5", "text_config": [1]}, "config.json text_config"),
], ids=["invalid-json", "a-list", "no-num_hidden_layers", "no-num_attention_heads", "layers-a-string", "kv-heads-0",
        "interval-0", "eos-null", "layer_types-dicts", "top-k-0", "top-k-past-experts", "rope-a-list",
        "conv-kernel-1", "text_config-a-list"])
def test_a_malformed_config_json_is_a_value_error_naming_the_file_and_field(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_model_dir(_write_folder(tmp_path, config))


def test_a_string_quantization_config_is_a_value_error(tmp_path):
    from hybridcache.models.quant import read_quantization_config

    _write_folder(tmp_path, base_dict(quantization_config="fp8"))
    with pytest.raises(ValueError, match="config.json quantization_config 'fp8' must be an object"):
        read_quantization_config(tmp_path)


@pytest.mark.parametrize("generation,message", [
    ({"eos_token_id": "abc"}, "generation_config.json eos_token_id 'abc' must be a token id"),
    ({"eos_token_id": 2.7}, "generation_config.json eos_token_id 2.7 must be a token id"),
    ({"eos_token_id": [2, None]}, r"generation_config.json eos_token_id \[2, None\] must be a token id"),
    ("{oops", "generation_config.json is not valid JSON"),
    ("[1]", "generation_config.json must hold a JSON object"),
    ({"eos_token_id": "258"}, "generation_config.json eos_token_id '258' must be a token id"),
], ids=["a-string", "a-float", "a-null", "invalid-json", "a-list", "a-numeric-string"])
def test_a_malformed_generation_config_is_a_warning_naming_the_file(tmp_path, generation, message, caplog):
    """As vLLM's try_get_generation_config (which falls back to the model config): the folder loads, stopping on
    config.json's EOS ids, and a warning names the file and the problem."""
    with caplog.at_level("WARNING", logger="hybridcache.models.config.model"):
        config = ModelConfig.from_model_dir(_write_folder(tmp_path, base_dict(), generation))
    assert config.eos_token_ids == (5, 6)
    assert re.search(message, caplog.text) and "config.json's EOS ids [5, 6]" in caplog.text


@pytest.mark.parametrize("changes,message", [
    ({"rope_theta": 0}, "config.json rope_theta 0.0 must be > 0"),
    ({"rope_parameters": {"rope_theta": 0}}, "config.json rope_theta 0.0 must be > 0"),
    ({"partial_rotary_factor": 2.0}, "config.json partial_rotary_factor 2.0 must be between 0 and 1"),
    ({"rope_parameters": {"partial_rotary_factor": 1.5}}, "config.json partial_rotary_factor 1.5 must be between"),
    ({"partial_rotary_factor": -0.5}, "config.json partial_rotary_factor -0.5 is not a number >= 0"),
    ({"norm_topk_prob": "false"}, "config.json norm_topk_prob 'false' must be true or false"),
    ({"norm_topk_prob": 0}, "config.json norm_topk_prob 0 must be true or false"),
    ({"tie_word_embeddings": "true"}, "config.json tie_word_embeddings 'true' must be true or false"),
    ({"attention_bias": "no"}, "config.json attention_bias 'no' must be true or false"),
], ids=["theta-0", "theta-0-rope-parameters", "prf-2", "prf-1.5-rope-parameters", "prf-negative",
        "norm_topk_prob-string", "norm_topk_prob-0", "tie-string", "attention_bias-string"])
def test_rope_and_boolean_fields_out_of_range_are_value_errors_naming_the_field(changes, message):
    """rope_theta 0 gave NaN outputs, partial_rotary_factor > 1 killed the engine at the first request, and a
    boolean read with bool() took "false" as true (transformers' strict configuration refuses these)."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(base_dict(**changes))


def test_rope_scaling_beside_rope_parameters_is_refused_when_it_says_something_else():
    """transformers lets rope_scaling replace rope_parameters whole (rope_theta back to its default); this parser
    read rope_parameters alone, so a YaRN recipe added as rope_scaling to a Qwen3.5 config was silently dropped
    (logits 2-26% off transformers'). Both present and differing: refused, naming the keys."""
    parameters = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match=r"both rope_parameters and rope_scaling.*\['factor', "
                                         r"'original_max_position_embeddings', 'rope_type'\]"):
        ModelConfig.from_dict(base_dict(rope_parameters=parameters, rope_scaling=yarn))
    # the same settings in both (or an empty rope_scaling) are one layout
    agreeing = ModelConfig.from_dict(base_dict(rope_parameters={**parameters, **yarn}, rope_scaling={**yarn}))
    assert agreeing.attention.rope_scaling == ModelConfig.from_dict(
        base_dict(rope_parameters={**parameters, **yarn})).attention.rope_scaling
    ModelConfig.from_dict(base_dict(rope_parameters=parameters, rope_scaling={"type": "default"}))


def test_boolean_fields_take_true_false_and_null():
    assert not ModelConfig.from_dict(base_dict(norm_topk_prob=False)).mlp.norm_topk_prob
    assert ModelConfig.from_dict(base_dict(norm_topk_prob=None)).mlp.norm_topk_prob  # transformers' default
    config = ModelConfig.from_dict(base_dict(tie_word_embeddings=True, attention_bias=None, partial_rotary_factor=1))
    assert config.tie_word_embeddings and not config.attention.bias
    assert config.attention.rotary_dim == config.attention.head_dim


def test_an_unknown_text_config_model_type_is_named_as_such():
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": {**base_dict(), "model_type": "qwen3_next_text"}}
    with pytest.raises(ValueError, match="unsupported text_config.model_type 'qwen3_next_text' in config.json"):
        ModelConfig.from_dict(raw)


def test_generation_config_eos_ids_join_config_jsons(tmp_path):
    """The ids generation stops on are config.json's, then generation_config.json's (the engine adds the
    tokenizer's EOS token)."""
    _write_folder(tmp_path, base_dict(eos_token_id=3), {"eos_token_id": [7, 3]})
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (3, 7)


def test_a_vision_config_that_is_not_an_object_is_a_value_error():
    from hybridcache.models.vision_config import VisionConfig

    with pytest.raises(ValueError, match="config.json vision_config must be an object"):
        VisionConfig.from_dict({"vision_config": [1]})
