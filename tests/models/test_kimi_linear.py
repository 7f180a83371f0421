"""Kimi Linear (`KimiLinearForCausalLM`) vs transformers on tiny random models (KDA layers with a per-channel
decay, MLA without rotary embedding, with and without q_lora, dense first layers then MoE blocks routed by groups with
a nonzero correction bias), fp32, loaded from the released checkpoints' tensor names; the per-channel gated delta
rule against transformers' KDA functions; config parsing and refusals.

Every model comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the
whole sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridcache.kernels.gated_delta import reference as delta_ref
from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.config import LayerKind

from .helpers import TOLERANCE, PagedRunner, make_pair, random_tokens, rel_err
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `pair`
    test_decode_after_prefill_matches_full_and_incremental_forward,
    test_mixed_batch_of_prefill_chunks_and_decodes,
    test_single_prefill_and_chunked_prefill,
    test_the_comparison_notices_a_lost_recurrent_state,
)
from .kimi_helpers import TINY_KIMI, VARIANTS, checkpoint_state_dict, make_kimi_pair, released_kimi_config


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_kimi_pair(request.param)


def _raw(variant: str = "moe-groups", **overrides) -> dict:
    return {**TINY_KIMI, **VARIANTS[variant], "model_type": "kimi_linear", **overrides}


def _kda_inputs(seed: int, length: int = 157, heads: int = 2, k_dim: int = 16, v_dim: int = 12):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, heads, k_dim, generator=g), torch.randn(length, heads, k_dim, generator=g)
    v = torch.randn(length, heads, v_dim, generator=g)
    decay = -torch.rand(length, heads, k_dim, generator=g) * 2  # per channel, some near 0 (slow), some fast
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, k_dim, v_dim, generator=g)
    return q, k, v, decay, beta, state


def test_per_channel_rule_matches_transformers_kda():
    """The reference's chunked and recurrent forms with g [T, H, K] equal transformers' chunk / recurrent KDA
    (from a nonzero state, 157 tokens), and its decode step their one-token form."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta, state = _kda_inputs(0)
    ref, ref_state = hf.chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                   initial_state=state[None], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    for rule in (delta_ref.chunk_gated_delta_rule, delta_ref.recurrent_gated_delta_rule):
        out, final = rule(q, k, v, g, beta, state)
        assert torch.allclose(out, ref[0], atol=2e-5, rtol=1e-4), rule.__name__
        assert torch.allclose(final, ref_state[0], atol=2e-5, rtol=1e-4), rule.__name__
    out, final = delta_ref.gated_delta_rule_step(q[:3], k[:3], v[:3], g[:3], beta[:3], state.expand(3, -1, -1, -1))
    one, one_state = hf.recurrent_kimi_delta_attention(q[None, :1], k[None, :1], v[None, :1], g[None, :1],
                                                       beta[None, :1], initial_state=state[None],
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.allclose(out[0], one[0, 0], atol=1e-5) and torch.allclose(final[0], one_state[0], atol=1e-5)


def test_per_channel_rule_continues_across_chunks_and_differs_from_per_head():
    """Split at uneven points, the chunked rule continues from its own final state to the whole run's output; a
    per-head g (the channel mean) gives another result (the per-channel path is taken)."""
    q, k, v, g, beta, state = _kda_inputs(1)
    whole, final = delta_ref.chunk_gated_delta_rule(q, k, v, g, beta, state)
    carried, pieces = state, []
    for rows in (slice(0, 37), slice(37, 101), slice(101, 157)):
        out, carried = delta_ref.chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], carried)
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces), whole, atol=2e-5) and torch.allclose(carried, final, atol=2e-5)
    per_head, _ = delta_ref.chunk_gated_delta_rule(q, k, v, g.mean(-1), beta, state)
    assert (per_head - whole).abs().max() > 1e-2


def test_layers_and_states(pair):
    """KDA layers hold conv [3 H K, W-1] and ssm [H, K, K]; MLA layers one kv head of ceil(E / 2) lanes, E the
    latent row's (kv_lora_rank + qk_rope_head_dim: 24 + 8, "qlora-dense2" 21 + 8, odd), no more; MoE blocks from
    first_k_dense_replace on."""
    config = pair.ours.config
    specs = pair.ours.state_specs(torch.float32, torch.float32)
    d, mla = config.gated_delta, config.mla
    for layer_id, kind in enumerate(config.layer_types):
        layer = pair.ours.model.layers[layer_id]
        if kind is LayerKind.LINEAR_ATTENTION:
            shapes = {t.name: t.shape for t in specs[layer_id].tensors}
            assert shapes == {"conv": (3 * d.num_v_heads * d.k_head_dim, d.conv_kernel_size - 1),
                              "ssm": (d.num_v_heads, d.k_head_dim, d.k_head_dim)}
        else:
            width = {24: 16, 21: 15}[mla.kv_lora_rank]  # (the two variants)
            assert (specs[layer_id].num_kv_heads, specs[layer_id].head_dim) == (1, width)
            assert mla.cache_head_dim == width == -(-(mla.kv_lora_rank + mla.qk_rope_head_dim) // 2)
        assert (layer.mlp_name == "block_sparse_moe") == config.is_moe_layer(layer_id)


@torch.no_grad()
def test_mla_latent_norms_use_transformers_epsilon():
    """MLA's q_a_layernorm / kv_a_layernorm run at eps 1e-6 (transformers' default), not rms_norm_eps (1e-5 here,
    as released): with the latent projections scaled by 0.01 (latent variance ~1e-4, where the eps matters: 1e-5
    moves the logits by ~3e-2) ours still matches transformers."""
    pair = make_kimi_pair("qlora-dense2")
    for model in (pair.hf, pair.ours):
        for name, param in model.named_parameters():
            if name.endswith(("kv_a_proj_with_mqa.weight", "q_a_proj.weight")):
                param.mul_(0.01)
    tokens = random_tokens(157, seed=5)
    (ours,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(ours, pair.hf_logits(tokens)) <= TOLERANCE


def test_mlp_layer_types_place_the_moe_blocks():
    """`mlp_layer_types` (what transformers' save_pretrained writes) wins over first_k_dense_replace, as in
    `KimiLinearConfig`: a layout that is not a dense prefix loads and matches transformers."""
    layout = ["sparse", "dense", "sparse", "dense"]
    pair = make_kimi_pair("qlora-dense2", mlp_layer_types=layout)
    assert pair.hf.config.mlp_layer_types == layout and pair.ours.config.mlp.moe_layer_ids == (0, 2)
    tokens = random_tokens(157, seed=6)
    (ours,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(ours, pair.hf_logits(tokens)) <= TOLERANCE
    dense = ModelConfig.from_dict(_raw(mlp_layer_types=["dense"] * 6, first_k_dense_replace=1))
    assert dense.mlp.moe_layer_ids == () and not any(dense.is_moe_layer(i) for i in range(6))


def test_no_shared_expert_loads_transformers_zero_width_one():
    """num_shared_experts 0: transformers holds (and save_pretrained writes) a shared expert of width 0, whose output
    is zeros; its empty tensors load (dropped) and the logits match. A shared-expert tensor that is not empty is
    still refused."""
    pair = make_kimi_pair("moe-groups", num_shared_experts=0)
    state = checkpoint_state_dict(pair.hf)
    empty = [name for name in state if ".shared_experts." in name]
    assert empty and all(state[name].numel() == 0 for name in empty)
    assert not any(".shared_experts." in name for name, _ in pair.ours.named_parameters())
    tokens = random_tokens(157, seed=7)
    (ours,) = PagedRunner(pair.ours, 16, 8).step([(0, tokens)])
    assert rel_err(ours, pair.hf_logits(tokens)) <= TOLERANCE
    state[empty[0]] = torch.zeros(32, 64) if state[empty[0]].shape[0] == 0 else torch.zeros(64, 32)
    with pytest.raises(ValueError, match="unexpected tensor .*shared_experts"):
        load_weights(pair.ours, state)


def test_config_reads_the_released_layout():
    """The released config.json's spellings: 1-based kda_layers / full_attn_layers, num_experts,
    num_experts_per_token, num_shared_experts, moe_renormalize, num_expert_group, model_max_length."""
    c = released_kimi_config()
    assert c.attention_layer_ids == (3, 7, 11, 15, 19, 23, 26) and c.num_linear_layers == 20
    # the paged KV: one kv head of (512 + 64) / 2 lanes, a latent row's halves; the scale of the 192-wide keys
    assert (c.attention.num_kv_heads, c.attention.head_dim, c.mla.latent_width) == (1, 288, 576)
    assert (c.attention.use_rope, c.attention.softmax_scale) == (False, 192**-0.5)
    assert c.mlp.moe_layer_ids == tuple(range(1, 27)) and c.mlp.num_experts == 256
    assert c.mlp.num_experts_per_tok == 8 and c.mlp.shared_expert_intermediate_size == 1024
    assert c.mlp.grouped_routing.scaling_factor == 2.446 and c.max_position_embeddings == 1048576
    assert (c.gated_delta.num_v_heads, c.gated_delta.k_head_dim, c.gated_delta.conv_kernel_size) == (32, 128, 4)


def test_the_released_models_kv_is_the_latent():
    """A token's KV over the 7 MLA layers of Kimi-Linear-48B in bf16: the latent row, 7 x 576 x 2 B = 7.9 KiB (the
    heads' expanded keys and values, padded to 192, were 7 x 2 x 32 x 192 x 2 B = 168 KiB); the attention's FLOPs
    per (query, key) pair at the expanded widths a recomputing prefill runs, 2 x 7 x 32 x (192 + 128)."""
    from hybridcache.engine.cost_model import ModelCost

    cost = ModelCost.from_config(released_kimi_config())
    assert cost.kv_bytes_per_token == 7 * 576 * 2
    assert cost.attn_flops_per_token_pair == 2 * 7 * 32 * (192 + 128)


def test_the_released_models_cuda_workspace_is_its_expanded_prefill_at_the_cap():
    """What the engine keeps out of the pools on CUDA for Kimi-Linear-48B in bf16 at 8,192 tokens a step: one MLA
    layer's expanded prefill at the cap (`mla_prefill.workspace_bytes`' worked example, 1.92 GB), growing with the
    step; none on the reference backend, nor for a model without MLA."""
    pytest.importorskip("triton")
    from hybridcache.engine.rank_runner import model_shapes
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend
    from hybridcache.kernels.shapes import MLAShapes

    shapes = model_shapes(released_kimi_config())
    assert shapes.mla == MLAShapes(num_heads=32, nope_head_dim=128, shared_head_dim=64, value_head_dim=128,
                                   latent_rank=512)
    cuda = CudaBackend(ReferenceAttention())
    assert cuda.workspace_bytes(shapes, 8192, torch.bfloat16) == 1_916_796_928
    assert cuda.workspace_bytes(shapes, 2048, torch.bfloat16) < 1_916_796_928
    assert ReferenceBackend().workspace_bytes(shapes, 8192, torch.bfloat16) == 0
    rank = model_shapes(released_kimi_config(), TensorParallel(1, 2))  # a rank of two: its 16 heads' workspace
    assert rank.mla == dataclasses.replace(shapes.mla, num_heads=16)
    assert cuda.workspace_bytes(rank, 8192, torch.bfloat16) < cuda.workspace_bytes(shapes, 8192, torch.bfloat16)
    qwen = model_shapes(ModelConfig.from_dict(make_pair("qwen3_next").hf_config.to_dict()))
    assert qwen.mla is None and cuda.workspace_bytes(qwen, 8192, torch.bfloat16) == 0


@pytest.mark.parametrize(("overrides", "message"), [
    ({"mla_use_nope": False}, "mla_use_nope false"),
    ({"num_nextn_predict_layers": 1}, "MTP"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"num_key_value_heads": 2}, "num_key_value_heads 2 must equal"),
    ({"num_expert_group": 3}, "num_expert_group 3 must divide"),
    ({"topk_group": 5, "num_expert_group": 4}, "topk_group 5"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3], "num_heads": 2, "head_dim": 16}},
     "must name each of the 6 layers"),
    ({"mlp_layer_types": ["dense"] * 5}, "mlp_layer_types .* for each of the 6 layers"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse", "sparse", "sparse"]}, "'dense' or 'sparse'"),
])
def test_config_refusals(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_raw(**overrides))


def test_a_tensor_parallel_size_that_does_not_split_a_width_names_its_field():
    """Kimi Linear runs under tensor parallelism (tests/distributed/test_kimi_tensor_parallel.py); a size that does
    not divide the KDA heads (2 here) or the experts' width (32; with 3 KDA heads) is refused naming the field."""
    config = ModelConfig.from_dict(_raw())
    model_cls = get_model_class("KimiLinearForCausalLM")
    with pytest.raises(ValueError, match=r"4 does not divide Kimi Delta Attention heads \(linear_attn_config's "
                                         r"num_heads\) \(2\)"):
        model_cls(config, TensorParallel(rank=0, size=4))
    three_heads = {**VARIANTS["moe-groups"]["linear_attn_config"], "num_heads": 3}
    config = ModelConfig.from_dict(_raw(linear_attn_config=three_heads))
    with pytest.raises(ValueError, match=r"3 does not divide the expert width \(config.json's moe_intermediate_size\)"):
        model_cls(config, TensorParallel(rank=0, size=3))
