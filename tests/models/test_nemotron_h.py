"""Nemotron-H (`NemotronHForCausalLM`) vs transformers on tiny random models (Mamba2, attention without RoPE and
relu^2 MLP layers; one or two Mamba2 groups, with and without projection biases; MoE layers of ungated relu^2
experts with a shared expert, group-limited routing with a nonzero correction bias, or one group inside latent
projections), fp32, and its config parsing and refusals.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the whole
sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import json

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
from .nemotron_helpers import VARIANTS, make_nemotron_pair, nemotron_config, nemotron_model


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_nemotron_pair(request.param)


def test_mlp_layers_hold_no_state(pair):
    """An MLP layer's spec has no tensors: its pool entry is empty, and a slot holds the Mamba2 layers' state alone
    (the runner's pools have no per-slot last_hidden)."""
    config = pair.ours.config
    specs = pair.ours.state_specs(torch.float32, torch.float32)
    runner = PagedRunner(pair.ours, 16, 8)
    for layer_id, kind in enumerate(config.layer_types):
        if kind is LayerKind.MLP:
            assert specs[layer_id].tensors == () and dict(runner.pools.layers[layer_id]) == {}
    m = config.mamba2
    slot_floats = sum(t.numel() // t.shape[1] for t in runner.pools.state_groups)  # per slot, every group
    assert slot_floats == len(config.mamba2_layer_ids) * (m.conv_dim * m.conv_width + m.num_heads * m.head_dim
                                                          * m.state_size)


def test_config_reads_the_nemotron_fields():
    config = ModelConfig.from_dict(nemotron_config("groups2").to_dict())
    mamba, attention, mlp = LayerKind.MAMBA2, LayerKind.FULL_ATTENTION, LayerKind.MLP
    assert config.layer_types == (mamba, mlp, attention, mamba, mlp, attention)
    assert config.mamba2_layer_ids == (0, 3) and config.recurrent_layer_ids == (0, 3)
    assert config.attention_layer_ids == (2, 5) and config.linear_layer_ids == ()
    assert [config.has_feed_forward(i) for i in range(6)] == [False, True, False, False, True, False]
    assert not any(config.is_moe_layer(i) for i in range(6))
    m = config.mamba2
    assert (m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_dim) == (8, 12, 2, 16, 96 + 2 * 2 * 16)
    assert m.conv_bias and not m.proj_bias and m.time_step_limit == (0.0, float("inf"))
    a = config.attention
    assert not a.use_rope and a.head_dim == 24 and a.num_kv_heads == 2 and a.softmax_scale == 24**-0.5
    assert config.hidden_act == "relu2" and config.mlp.intermediate_size == 96 and config.mlp.in_own_layers
    assert config.rms_norm_eps == 1e-5 and config.mamba_ssm_dtype == "float32"


def test_config_reads_hub_spellings():
    """As the published config.json files write them: hybrid_override_pattern (no layers_block_type), older layer
    names, the mamba_* aliases transformers remaps (they win, as there), time_step_limit with JSON's Infinity."""
    raw = nemotron_config("groups2").to_dict()
    del raw["layers_block_type"]
    raw.update(hybrid_override_pattern="M-*M-*", num_hidden_layers=6, mamba_n_groups=4, n_groups=2,
               mamba_d_conv=3, time_step_limit=json.loads("[0.0, Infinity]"), rms_norm_eps=0.5)
    config = ModelConfig.from_dict(raw)
    assert config.layer_types == ModelConfig.from_dict(nemotron_config("groups2").to_dict()).layer_types
    assert config.mamba2.num_groups == 4 and config.mamba2.conv_kernel_size == 3
    assert config.mamba2.time_step_limit == (0.0, float("inf")) and config.rms_norm_eps == 1e-5  # layer_norm_eps
    raw.update(layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp", "attention"])
    assert ModelConfig.from_dict(raw).layer_types == config.layer_types
    raw.pop("mamba_ssm_cache_dtype")  # transformers' default then: float32
    assert ModelConfig.from_dict(raw).mamba_ssm_dtype == "float32"


@pytest.mark.parametrize("field, value, message", [
    ("layers_block_type", ["mamba", "gated_deltanet", "attention", "mamba", "mlp", "attention"], "layer_types"),
    ("num_hidden_layers", 5, "layer_types"),
    ("mlp_hidden_act", "silu", "mlp_hidden_act"),
    ("mamba_hidden_act", "gelu", "mamba_hidden_act"),
    ("n_groups", 3, "n_groups"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("time_step_limit", [1.0, 0.5], "time_step_limit"),
])
def test_config_refuses_what_it_cannot_run(field, value, message):
    raw = {**nemotron_config("groups2").to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_config_needs_a_layer_layout():
    raw = nemotron_config("groups2").to_dict()
    del raw["layers_block_type"]
    for pattern in (None, "M-X*"):
        with pytest.raises(ValueError, match="hybrid_override_pattern"):
            ModelConfig.from_dict({**raw, "hybrid_override_pattern": pattern})
    config = ModelConfig.from_dict({**raw, "hybrid_override_pattern": "ME*M-*"})
    assert config.layer_types[1] is LayerKind.MLP and config.is_moe_layer(1) and not config.is_moe_layer(4)


def test_tensor_parallelism_is_refused_with_a_clear_error():
    """(FP8 weights and KV are served: tests/models/test_fp8_mamba2_hybrids.py.)"""
    config = ModelConfig.from_dict(nemotron_config("groups2").to_dict())
    with pytest.raises(ValueError, match="tensor parallelism"):
        get_model_class(config.architecture)(config, TensorParallel(rank=0, size=2))


def test_folder_loads_from_the_checkpoint_tensor_names(tmp_path):
    """save_pretrained writes the hub checkpoints' names (backbone.embeddings, backbone.layers.N.mixer,
    backbone.norm_f); an `mtp.` tensor beside them (Nemotron 3's MTP head) is not loaded."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = nemotron_model("pattern-bias")
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.2.mixer.up_proj.weight",
            "backbone.layers.0.mixer.in_proj.bias"} <= set(tensors)
    save_file({**tensors, "mtp.layers.0.norm.weight": torch.ones(64)}, str(path), metadata={"format": "pt"})
    ours = load_model(tmp_path)
    assert type(ours).__name__ == "NemotronHForCausalLM"
    tokens = random_tokens(40, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(40)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE


def test_defaults_are_transformers_defaults():
    """The fields config.json may leave out take `NemotronHConfig`'s defaults."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.NemotronHConfig()
    for key, value in DEFAULTS["nemotron_h"].items():
        if key not in ("rope_theta", "partial_rotary_factor"):  # (no rotary embedding: unused)
            assert value == getattr(hf, key), key
    minimal = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256,
               "hidden_size": 64, "num_attention_heads": 16, "hybrid_override_pattern": "M-*"}
    config = ModelConfig.from_dict(minimal)
    assert config.num_hidden_layers == 3 and config.attention.head_dim == hf.head_dim
    assert config.mamba2.num_groups == hf.n_groups and config.mamba2.head_dim == hf.mamba_head_dim


def test_config_reads_the_moe_fields():
    config = ModelConfig.from_dict(nemotron_config("moe-groups").to_dict())
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert [config.has_feed_forward(i) for i in range(6)] == [False, True, False, True, False, True]
    mlp = config.mlp
    assert (mlp.num_experts, mlp.num_experts_per_tok, mlp.moe_intermediate_size) == (8, 3, 32)
    assert mlp.shared_expert_intermediate_size == 48 and mlp.norm_topk_prob and mlp.intermediate_size == 96
    routing = mlp.grouped_routing
    assert (routing.num_groups, routing.topk_groups, routing.scaling_factor) == (4, 2, 2.5)
    assert mlp.moe_latent_size is None
    latent = ModelConfig.from_dict(nemotron_config("moe-latent").to_dict())
    assert latent.mlp.moe_latent_size == 40 and not latent.mlp.norm_topk_prob
    assert latent.mlp.moe_layer_ids == (1, 4) and latent.mlp.grouped_routing.num_groups == 1
    dense = ModelConfig.from_dict(nemotron_config("groups2").to_dict())
    assert dense.mlp.grouped_routing is None and dense.mlp.num_experts == 0


@pytest.mark.parametrize("overrides, message", [
    ({"n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
    ({"n_group": 8, "topk_group": 1}, "groups of at least 2"),
    ({"topk_group": 5}, "topk_group 5 must be at most n_group 4"),
    ({"topk_group": 1}, "num_experts_per_tok 3"),  # one kept group of 2 experts cannot give 3 picks
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
])
def test_config_refuses_a_routing_it_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**nemotron_config("moe-groups").to_dict(), **overrides})


def test_router_equals_transformers_and_its_bias_and_groups_change_the_picks():
    """Our router against transformers' NemotronHTopkRouter on 300 tokens (same picks, same weights); the correction
    bias and the group limit each change some tokens' picks (so the model comparisons above exercise them)."""
    pair = make_nemotron_pair("moe-groups")
    theirs, ours = pair.hf.model.layers[1].mixer.gate, pair.ours.model.layers[1].mixer.gate
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(5))
    backend = ReferenceBackend()
    with torch.no_grad():
        _, want_weights, want_ids = theirs(x)
        weights, ids = ours(x, backend)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(ids.sort(-1)[0], want_ids.sort(-1)[0])
        torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), want_weights.gather(1, want_ids.argsort(-1)),
                                   rtol=1e-6, atol=1e-7)

        def picks(router) -> set:
            return {(t, e) for t, row in enumerate(router(x, backend)[1].tolist()) for e in row}

        bias = ours.e_score_correction_bias.detach().clone()
        assert bias.abs().min() > 0
        ours.e_score_correction_bias.zero_()
        unbiased = picks(ours)
        ours.e_score_correction_bias.copy_(bias)
        routing = ours.routing
        ours.routing = type(routing)(num_groups=1, topk_groups=1, scaling_factor=routing.scaling_factor)
        ungrouped = picks(ours)
        ours.routing = routing
        chosen = picks(ours)
    assert len(chosen - unbiased) >= 10 and len(chosen - ungrouped) >= 10


def test_router_stays_float32_in_a_bf16_model():
    """The router's weight and correction bias stay float32 when the model is cast to bf16 (as transformers keeps
    them: `_keep_in_fp32_modules_strict`); the bias keeps its fp32 value (not rounded through bf16)."""
    pair = make_nemotron_pair("moe-groups")
    gate = pair.ours.model.layers[1].mixer.gate
    bias = gate.e_score_correction_bias.detach().clone()
    bf16 = pair.ours.to(torch.bfloat16)
    gate = bf16.model.layers[1].mixer.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, bias)
    assert bf16.model.layers[1].mixer.experts[0].up_proj.weight.dtype == torch.bfloat16


def test_moe_folder_loads_from_the_per_expert_checkpoint_names(tmp_path):
    """save_pretrained writes the experts one by one (backbone.layers.N.mixer.experts.{e}.up_proj.weight), the router
    as mixer.gate.weight and mixer.gate.e_score_correction_bias, and the latent projections; load_model reads them
    (the in-memory stacked form is what the other tests load)."""
    from safetensors import safe_open

    hf = nemotron_model("moe-latent")
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"backbone.layers.1.mixer.experts.5.up_proj.weight", "backbone.layers.4.mixer.experts.0.down_proj.weight",
            "backbone.layers.1.mixer.gate.e_score_correction_bias", "backbone.layers.1.mixer.gate.weight",
            "backbone.layers.1.mixer.fc1_latent_proj.weight", "backbone.layers.4.mixer.shared_experts.up_proj.weight",
            } <= names
    assert not any(name.endswith("experts.up_proj") for name in names)
    ours = load_model(tmp_path)
    tokens = random_tokens(40, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(40)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE


def test_the_comparison_notices_a_lost_correction_bias():
    """Loading the MoE model with its routers' correction bias left at zero moves the logits well past the
    tolerance: the model tests above do check the bias."""
    pair = make_nemotron_pair("moe-groups")
    tokens = random_tokens(157, seed=8)
    ref = pair.hf_logits(tokens)
    with torch.no_grad():
        for layer_id in pair.ours.config.mlp.moe_layer_ids:
            pair.ours.model.layers[layer_id].mixer.gate.e_score_correction_bias.zero_()
    (ours,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(ours, ref) > 100 * TOLERANCE
