"""Model folders: save_pretrained round trips (single file, sharded, tied, multimodal layout) and every
loader error (unknown architecture, missing / unexpected tensor, shape mismatch)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridcache.models import SUPPORTED_ARCHITECTURES, load_model, load_weights

from .helpers import MODEL_TYPES, TOLERANCE, PagedRunner, make_pair, random_tokens, rel_err


def save_pair(pair, path: Path, **kwargs) -> Path:
    pair.hf.save_pretrained(path, **kwargs)
    return path


def prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    (logits,) = PagedRunner(model, 16, 8).step([(0, tokens)])
    return logits


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_round_trip_through_save_pretrained(tmp_path, model_type):
    pair = make_pair(model_type, seed=3)
    model = load_model(save_pair(pair, tmp_path))
    tokens = random_tokens(150, seed=50)
    assert type(model) is type(pair.ours)
    assert rel_err(prefill_logits(model, tokens), pair.hf_logits(tokens)) <= TOLERANCE
    assert model.config.eos_token_ids == (2,)


def test_per_expert_and_stacked_experts_load_the_same_weights(tmp_path):
    """save_pretrained writes `experts.{e}.gate_proj.weight`; transformers holds `experts.gate_up_proj`."""
    pair = make_pair("qwen3_next", seed=4)
    saved = load_file(str(save_pair(pair, tmp_path) / "model.safetensors"))
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in saved)
    assert any(name.endswith(".mlp.experts.gate_up_proj") for name in pair.hf.state_dict())
    from_folder = load_model(tmp_path)
    for name, param in pair.ours.named_parameters():  # `pair.ours` was loaded from the stacked form
        assert torch.equal(param, from_folder.get_parameter(name)), name


def test_sharded_folder_loads(tmp_path):
    pair = make_pair("qwen3_5_text", seed=5)
    save_pair(pair, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    tokens = random_tokens(150, seed=51)
    assert rel_err(prefill_logits(load_model(tmp_path), tokens), pair.hf_logits(tokens)) <= TOLERANCE


def test_tied_embeddings(tmp_path):
    pair = make_pair("qwen3_5_text", seed=6, tie_word_embeddings=True)
    save_pair(pair, tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = random_tokens(150, seed=52)
    assert rel_err(prefill_logits(model, tokens), pair.hf_logits(tokens)) <= TOLERANCE


def test_multimodal_layout_loads_the_language_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration-style folder: text_config nesting, `model.language_model.` names,
    vision tower (`model.visual.*`) and MTP (`mtp.*`) tensors ignored."""
    pair = make_pair("qwen3_5_text", seed=7)
    save_pair(pair, tmp_path)
    text_config = json.loads((tmp_path / "config.json").read_text())
    wrapper = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text_config, "architectures": None},
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert model.config.architecture == "Qwen3_5ForConditionalGeneration"
    tokens = random_tokens(150, seed=53)
    assert rel_err(prefill_logits(model, tokens), pair.hf_logits(tokens)) <= TOLERANCE


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    pair = make_pair("qwen3_next", seed=8)
    return pair, save_pair(pair, tmp_path_factory.mktemp("qwen3_next"))


def edited_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_unknown_architecture_lists_supported_ones(saved_pair, tmp_path):
    _, src = saved_pair
    dst = edited_copy(src, tmp_path, lambda tensors: None)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MambaForCausalLM") as error:
        load_model(dst)
    assert all(arch in str(error.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    "name, shape",
    [("model.layers.3.self_attn.k_norm.weight", "[32]"), ("model.layers.0.mlp.experts.5.up_proj.weight", "[32, 64]")],
    ids=["norm", "expert"],
)
def test_missing_tensor(saved_pair, tmp_path, name, shape):
    _, src = saved_pair
    dst = edited_copy(src, tmp_path, lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=re.escape(f"missing tensor '{name}' (model shape {shape})")):
        load_model(dst)


def test_unexpected_tensor(saved_pair, tmp_path):
    _, src = saved_pair

    def add(tensors):
        tensors["model.layers.0.linear_attn.extra_bias"] = torch.zeros(7)

    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model.layers.0.linear_attn.extra_bias' .*\[7\]"
    ):
        load_model(edited_copy(src, tmp_path, add))


def test_shape_mismatch_names_tensor_and_both_shapes(saved_pair, tmp_path):
    _, src = saved_pair
    name = "model.layers.1.linear_attn.in_proj_ba.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:6]

    with pytest.raises(ValueError, match=rf"'{name}': checkpoint \[6, 64\], model \[8, 64\]"):
        load_model(edited_copy(src, tmp_path, shrink))


def test_stacked_expert_shape_mismatch(saved_pair):
    pair, _ = saved_pair
    state = dict(pair.hf.state_dict())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    state[name] = state[name][:, :10]
    with pytest.raises(ValueError, match=rf"'{name}': checkpoint \[8, 10, 64\], model \[8, 64, 64\]"):
        load_weights(make_pair("qwen3_next").ours, state)


def test_errors_come_before_any_weight_memory(saved_pair, tmp_path):
    """A config whose embedding alone would need 256 GB fails on the shape check at once."""
    _, src = saved_pair
    dst = edited_copy(src, tmp_path, lambda tensors: None)
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] = 1_000_000_000
    (dst / "config.json").write_text(json.dumps(config))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight': checkpoint \[256, 64\]"):
        load_model(dst)
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_real_multimodal_folder_loads_its_language_model(tmp_path, model_type):
    """transformers' own Qwen3_5(Moe)ForConditionalGeneration save: the text-only forward matches."""
    import transformers

    from hybridcache.models.random_weights import randomize_, tiny_hf_config

    text = tiny_hf_config(model_type).to_dict()
    text.pop("architectures")
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 4,
        "temporal_patch_size": 1,
        "num_position_embeddings": 16,
    }
    if model_type == "qwen3_5_text":
        config_cls, model_cls = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
    else:
        config_cls, model_cls = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
    torch.manual_seed(0)
    hf = model_cls(config_cls(text_config=text, vision_config=vision)).eval()
    randomize_(hf, 9)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    tokens = random_tokens(150, seed=54)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens])).logits[0]
    assert rel_err(prefill_logits(model, tokens), ref) <= TOLERANCE
