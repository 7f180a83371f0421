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
from hybridcache.models.loader import safetensors_files
from hybridcache.models.random_weights import tiny_hf_config

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

    with pytest.raises(ValueError, match=rf"'{name}': checkpoint \[6, 64\], model \[8, 64\]") as error:
        load_model(edited_copy(src, tmp_path, shrink))
    assert "missing" not in str(error.value)  # (it was also listed as a missing tensor)


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


def _two_shards(src: Path, dst: Path, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """`src`'s single-file checkpoint split into two indexed shards: model.norm.weight (and `extra`) in the second,
    the rest in the first (the index maps each name to one shard: `extra`'s to the first)."""
    tensors = load_file(str(src / "model.safetensors"))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file({n: t for n, t in tensors.items() if n != "model.norm.weight"}, str(dst / names[0]))
    save_file({"model.norm.weight": tensors["model.norm.weight"], **(extra or {})}, str(dst / names[1]))
    weight_map = {**dict.fromkeys(tensors, names[0]), "model.norm.weight": names[1]}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_a_tensor_two_shards_hold_is_given_twice(saved_pair, tmp_path):
    _, src = saved_pair
    dst = _two_shards(src, tmp_path, {"model.embed_tokens.weight": torch.zeros(256, 64)})
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' given twice: in \S+model-00001-of-"
                                         r"00002.safetensors and \S+model-00002-of-00002.safetensors"):
        load_model(dst)


def test_a_shard_the_index_spells_two_ways_is_read_once(saved_pair, tmp_path):
    """"./model-00001-..." beside "model-00001-...": one file (was read twice, "given twice: in X and X")."""
    pair, src = saved_pair
    dst = _two_shards(src, tmp_path)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for name in list(index["weight_map"])[:3]:
        index["weight_map"][name] = "./" + index["weight_map"][name]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [f.name for f in safetensors_files(dst)] == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    tokens = random_tokens(40, seed=7)
    assert rel_err(prefill_logits(load_model(dst), tokens), prefill_logits(load_model(src), tokens)) == 0


def test_a_parameter_given_under_both_names_is_refused(saved_pair, tmp_path):
    """`model.X` beside `model.language_model.X` (the multimodal name of the same parameter)."""
    _, src = saved_pair

    def add(tensors):
        tensors["model.language_model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])

    with pytest.raises(ValueError, match="tensor 'model.norm.weight' given twice: as '") as error:
        load_model(edited_copy(src, tmp_path, add))
    assert "'model.language_model.norm.weight' and 'model.norm.weight'" in str(error.value)


def test_per_expert_and_stacked_experts_side_by_side_are_refused(saved_pair, tmp_path):
    pair, src = saved_pair
    prefix = "model.layers.0.mlp.experts"

    def add(tensors):
        tensors[f"{prefix}.gate_up_proj"] = torch.zeros_like(pair.hf.state_dict()[f"{prefix}.gate_up_proj"])

    with pytest.raises(ValueError, match=rf"tensor {prefix}.\*.gate_proj/up_proj.weight given twice: as "
                                         rf"'{prefix}.0.gate_proj.weight' \(and 15 more\) and '{prefix}.gate_up_proj'"):
        load_model(edited_copy(src, tmp_path, add))


def _tied_config(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))


def test_a_tied_config_with_a_distinct_lm_head_uses_it_as_transformers_does(tmp_path, caplog):
    """transformers (PreTrainedModel.tie_weights) warns and does not tie when the checkpoint holds both tensors
    with different values; an equal lm_head.weight is tied."""
    import transformers

    pair = make_pair("qwen3_5_text", seed=9)
    path = save_pair(pair, tmp_path / "distinct")
    _tied_config(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    with caplog.at_level("WARNING", logger="hybridcache.models.loader"):
        model = load_model(path)
    assert "differs from model.embed_tokens.weight" in caplog.text
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, pair.hf.lm_head.weight)
    tokens = random_tokens(100, seed=54)
    assert rel_err(prefill_logits(model, tokens), pair.hf_logits(tokens)) <= TOLERANCE

    same = edited_copy(path, tmp_path / "same",
                       lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = load_model(same)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_tied_config_with_only_lm_head_ties_the_embedding_to_it(tmp_path):
    """transformers swaps a tie whose source is missing: the checkpoint's lm_head.weight is the embedding too."""
    import transformers

    pair = make_pair("qwen3_5_text", seed=10)
    path = edited_copy(save_pair(pair, tmp_path / "src"), tmp_path / "head_only",
                       lambda t: t.pop("model.embed_tokens.weight"))
    _tied_config(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(model.model.embed_tokens.weight, pair.hf.lm_head.weight)


@pytest.mark.parametrize("name,dtype", [
    ("model.embed_tokens.weight", torch.int32), ("model.norm.weight", torch.bool),
    ("model.layers.0.linear_attn.A_log", torch.int64),
], ids=["embedding-int32", "norm-bool", "A_log-int64"])
def test_an_integer_tensor_for_a_float_weight_is_refused(saved_pair, tmp_path, name, dtype):
    _, src = saved_pair
    dst = edited_copy(src, tmp_path, lambda tensors: tensors.update({name: tensors[name].to(dtype)}))
    dtype_name = {torch.int32: "I32", torch.bool: "BOOL", torch.int64: "I64"}[dtype]
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' in \S+model.safetensors has dtype "
                                         rf"{dtype_name}; a weight must be a float tensor"):
        load_model(dst)


def test_an_integer_tensor_in_memory_is_refused(saved_pair):
    pair, _ = saved_pair
    tensors = {**pair.hf.state_dict()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' has dtype torch.int32"):
        load_weights(pair.ours, tensors)


@pytest.mark.parametrize("damage,message", [
    ("index-invalid-json", r"model.safetensors.index.json is not valid JSON"),
    ("index-without-weight_map", r"model.safetensors.index.json has no 'weight_map'"),
    ("garbage-shard", r"model-00002-of-00002.safetensors is not a readable safetensors file"),
    ("truncated-shard", r"model-00002-of-00002.safetensors is not a readable safetensors file"),
    ("shard-a-directory", r"model-00002-of-00002.safetensors is not a file"),
    ("shard-missing", r"model-00002-of-00002.safetensors does not exist"),
])
def test_an_unreadable_index_or_shard_is_a_value_error_naming_the_file(saved_pair, tmp_path, damage, message):
    _, src = saved_pair
    dst = _two_shards(src, tmp_path)
    index, shard = dst / "model.safetensors.index.json", dst / "model-00002-of-00002.safetensors"
    if damage == "index-invalid-json":
        index.write_text("{")
    elif damage == "index-without-weight_map":
        index.write_text(json.dumps({"metadata": {}}))
    elif damage == "garbage-shard":
        shard.write_bytes(b"hello world, no safetensors")
    elif damage == "truncated-shard":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "shard-a-directory":
        shard.unlink()
        shard.mkdir()
    else:
        shard.unlink()
    with pytest.raises(ValueError, match=message):
        load_model(dst)


def test_an_integer_vision_tensor_is_refused(tmp_path):
    from hybridcache.models.vision_loader import load_vision_tower
    from hybridcache.models.vl_folders import write_tiny_vl_model

    path = write_tiny_vl_model(tmp_path)
    (shard,) = path.glob("*.safetensors")
    tensors = load_file(str(shard))
    name = next(name for name in sorted(tensors) if name.startswith("model.visual."))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' in \S+ has dtype I32"):
        load_vision_tower(path)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_dummy_weights_for_a_moe_without_a_shared_expert(tmp_path, model_type):
    """shared_expert_intermediate_size 0 is a valid config (the model runs it), but drawing its dummy weights
    divided by the zero fan-in of the empty shared expert (ZeroDivisionError)."""
    tiny_hf_config(model_type, shared_expert_intermediate_size=0).save_pretrained(tmp_path)
    model = load_model(tmp_path, load_format="dummy")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_dummy_granite_weights_draw_its_norms_around_one(tmp_path):
    """Granite's RMSNorms and Mamba2's gated norm scale by their weight, not by 1 + it: dummy weights drew them
    around 0 as for Qwen's zero-centred norms, so a `--load-format dummy` Granite scaled every block to ~0.1."""
    from .granite_helpers import granite_config

    granite_config("moe-nope").save_pretrained(tmp_path)
    model = load_model(tmp_path, load_format="dummy")
    norms = {name: p for name, p in model.named_parameters() if name.endswith("norm.weight")}
    assert any(".mamba.norm." in name for name in norms) and "model.norm.weight" in norms
    for name, weight in norms.items():
        assert 0.5 < weight.float().mean() < 1.5, name
