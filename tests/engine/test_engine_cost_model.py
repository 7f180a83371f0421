"""The engine's prefix cache ranks by the model's real cost model (`engine_cost_model`): FLOPs from the model
config, bytes from the state specs as the memory plan sized them, not `CostModel()`'s placeholders."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hybridcache.cache import CostModel
from hybridcache.cache.policy import FlopAwarePolicy
from hybridcache.config import EngineConfig
from hybridcache.engine.cost_model import ModelCost
from hybridcache.engine.engine import LLMEngine
from hybridcache.engine.memory import pool_bytes, state_pages
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.config import LayerKind
from hybridcache.state_spec import AttentionSpec, RecurrentSpec
from tests.models.bamba_helpers import bamba_model
from tests.models.falcon_h1_helpers import falcon_model
from tests.models.granite_helpers import granite_model
from tests.models.jamba_helpers import jamba_model
from tests.models.kimi_helpers import kimi_model
from tests.models.lfm2_helpers import lfm2_model
from tests.models.nemotron_helpers import nemotron_model
from tests.models.olmo_hybrid_helpers import olmo_model

from .model_folders import write_tiny_model

BLOCK = 16


def checkpoint(ckpt_id: int, step: int, last_access: int, frozen: bool) -> SimpleNamespace:
    return SimpleNamespace(ckpt_id=ckpt_id, step=step, last_access=last_access, frozen_block=7 if frozen else None)


def test_flop_aware_eviction_ranks_with_the_models_real_state_bytes(tmp_path):
    engine = LLMEngine(write_tiny_model(tmp_path, "qwen3_next"),
                       EngineConfig(block_size=BLOCK, eviction="flop-aware"))
    cache = engine.scheduler.cache
    model = engine.runner.model
    kv_block, slot = pool_bytes(model.state_specs(torch.float32, torch.float32), BLOCK,
                                model.slot_specs(torch.float32))
    k = state_pages(slot, kv_block)
    cost = cache.cost_model
    assert cost.state_bytes == k * kv_block  # a checkpoint's state holds k blocks of the pool
    assert cost.kv_bytes_per_token == kv_block / BLOCK
    real = ModelCost.from_config(engine.model_config)
    assert (cost.flops_per_token, cost.attn_flops_per_token_pair) == (real.flops_per_token,
                                                                      real.attn_flops_per_token_pair)
    assert cost != CostModel()

    # Three unpinned checkpoints, oldest first: score = recency (0, 0.5, 1) + alpha * efficiency / the best.
    # `deep` (2,000 tokens) saves the most per byte (score 0 + 1); `middle` (1,100 tokens) scores 0.5 + its
    # efficiency over deep's, so it goes first exactly when that ratio is under 0.5. With the real cost (the
    # attention term grows with n^2) it is 0.47: middle goes; with the placeholders (one FLOP per token) it is
    # 0.55 and deep goes.
    deep, middle, newest = checkpoint(0, 2000, 0, False), checkpoint(1, 1100, 5, False), checkpoint(2, 16, 10, True)
    policy = cache._life.evictor.policy
    assert isinstance(policy, FlopAwarePolicy) and policy.cost is cost
    ratio = policy.efficiency(middle) / policy.efficiency(deep)
    assert ratio == cost.prefill_flops(1100) / cost.prefill_flops(2000) < 0.5
    assert policy.pick_checkpoint([deep, middle, newest]) is middle
    placeholder = FlopAwarePolicy(policy.alpha, CostModel(), BLOCK)
    assert placeholder.pick_checkpoint([deep, middle, newest]) is deep

    # Bytes: a checkpoint holding a frozen block holds one block more than its state; per byte it is worth
    # k / (k + 1) of one at the same step that holds none (real bytes), not 64 / (64 + 16) (placeholders).
    tail = checkpoint(3, 2000, 0, True)
    assert policy.efficiency(tail) / policy.efficiency(deep) == k * kv_block / ((k + 1) * kv_block)
    assert placeholder.efficiency(tail) / placeholder.efficiency(deep) == 64 / 80


def spec_bytes(tensors) -> int:
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors)


HYBRID_FAMILIES = {"granite": granite_model, "nemotron": nemotron_model, "bamba": bamba_model,
                   "falcon": falcon_model, "jamba": jamba_model, "olmo": olmo_model, "lfm2": lfm2_model,
                   "kimi": kimi_model}
# (family, variant) -> its recurrent layers (Mamba2; Jamba's: Mamba1; OLMo Hybrid's: gated DeltaNet; LFM2's: short
# convolutions; Kimi Linear's: KDA)
HYBRID_VARIANTS = {("granite", "dense-rope"): 3, ("granite", "moe-nope"): 3, ("nemotron", "groups2"): 2,
                   ("nemotron", "pattern-bias"): 3, ("nemotron", "moe-groups"): 2, ("nemotron", "moe-latent"): 2,
                   ("bamba", "groups2"): 3, ("bamba", "bias-rope"): 4, ("falcon", "norm-first"): 3,
                   ("falcon", "gate-first"): 3, ("falcon", "no-norm"): 3, ("jamba", "dense"): 4, ("jamba", "moe"): 4,
                   ("olmo", "nope-gva"): 3, ("olmo", "rope-bias"): 3, ("lfm2", "bias-k3"): 3, ("lfm2", "idxs-k4"): 3,
                   ("lfm2", "moe-norm"): 3, ("lfm2", "moe-raw"): 3, ("kimi", "moe-groups"): 4,
                   ("kimi", "qlora-dense2"): 2}


def _family_recurrent_ids(config: ModelConfig, family: str) -> tuple[int, ...]:
    """The layers of the family's own recurrent kind."""
    if family == "jamba":
        return config.mamba1_layer_ids
    if family in ("olmo", "kimi"):
        return config.linear_layer_ids
    if family == "lfm2":
        return tuple(i for i, kind in enumerate(config.layer_types) if kind is LayerKind.SHORT_CONV)
    return config.mamba2_layer_ids


@pytest.mark.parametrize("family, variant", list(HYBRID_VARIANTS))
def test_hybrid_costs_count_their_recurrent_layers(family, variant):
    """A Granite-4.0-H, Nemotron-H, Bamba, Falcon-H1, Jamba, OLMo Hybrid, LFM2 or Kimi Linear model's cost: its
    state bytes are its recurrent layers' state specs (Mamba layers were counted as DeltaNet layers with Qwen's
    default sizes; Nemotron-H's stateless MLP layers as DeltaNet layers too), its KV bytes its attention layers' (a
    Falcon-H1 layer has both, and an MLP), its FLOPs per token twice its active matmul parameters (ungated
    attention; Nemotron-H: relu^2 MLP layers of two matrices, no feed-forward block after its mixers; its MoE
    layers: the router, top-k ungated experts of two matrices, the ungated shared expert, the latent projections;
    Jamba: MoE blocks without a shared expert, Mamba1's x_proj and dt_proj; OLMo Hybrid: DeltaNet layers of six
    projections; LFM2: short convs of in_proj, taps and out_proj, a tied lm_head; Kimi Linear: MLA's latent
    projections, not dense attention at its padded KV head dim, KDA's q k v, low-rank decay and output gates, b and
    o; its routers) plus the recurrent updates' (Mamba2 and Mamba1 scans, the delta rule; none for a short conv;
    Mamba1's A_log [I, N] is no matmul)."""
    hf = HYBRID_FAMILIES[family](variant)
    config = ModelConfig.from_dict(hf.config.to_dict())
    model = get_model_class(config.architecture)(config)
    cost = ModelCost.from_config(config, ssm_dtype="bfloat16")

    specs = model.state_specs(torch.float32, torch.bfloat16)
    recurrent = [spec for spec in specs if isinstance(spec, RecurrentSpec) and spec.tensors]
    family_ids = _family_recurrent_ids(config, family)
    assert len(recurrent) == len(config.recurrent_layer_ids) == len(family_ids) == HYBRID_VARIANTS[family, variant]
    assert all(len(spec.tensors) == (1 if family == "lfm2" else 2) for spec in recurrent)
    hidden = spec_bytes(model.slot_specs(torch.float32))
    assert cost.state_bytes == sum(spec_bytes(s.tensors) for s in recurrent) + hidden
    kv = [spec for spec in specs if isinstance(spec, AttentionSpec)]
    assert cost.kv_bytes_per_token == sum(2 * s.num_kv_heads * s.head_dim * 4 for s in kv)

    mlp, delta = config.mlp, config.gated_delta
    matmuls = sum(p.numel() for name, p in model.named_parameters(remove_duplicate=False)  # (a tied lm_head too)
                  if p.ndim >= 2 and "embed_tokens" not in name and ".experts." not in name  # (routed experts)
                  and not name.endswith("A_log"))
    # only the top-k experts' weights are read per token: each MoE layer's expert 0 counted top-k times
    matmuls += mlp.num_experts_per_tok * sum(p.numel() for name, p in model.named_parameters() if ".experts.0." in name)
    if family == "jamba":
        assert config.mamba2 is None and config.mamba1_layer_ids
        scans = len(config.mamba1_layer_ids) * 6 * config.mamba1.intermediate_size * config.mamba1.state_size
    else:
        m = config.mamba2
        scans = len(config.mamba2_layer_ids) * 6 * m.num_heads * m.head_dim * m.state_size if m else 0
    scans += len(config.linear_layer_ids) * 6 * delta.num_v_heads * delta.k_head_dim * delta.v_head_dim
    assert cost.flops_per_token == 2 * matmuls + scans


@pytest.mark.parametrize("variant", ["moe-groups", "qlora-dense2"])
def test_kimi_attention_pairs_use_the_expanded_widths(variant):
    """Kimi Linear's attention FLOPs per (query, key) pair: a prefill that recomputes a prefix expands MLA's latent
    rows into each head's key and value (kernels/attention/mla_prefill.py), so each head scores a query's full key
    width (q_proj's per head) and sums a value's (kv_b_proj's per head, less the key part), 2 FLOPs a
    multiply-add; neither the latent row's width (the absorbed path of short chunks) nor the paged KV's head dim."""
    config = ModelConfig.from_dict(kimi_model(variant).config.to_dict())
    model = get_model_class(config.architecture)(config)
    widths = 0
    for layer_id in config.attention_layer_ids:
        attn = model.model.layers[layer_id].self_attn
        query = attn.q_proj if config.mla.q_lora_rank is None else attn.q_b_proj
        key_width = query.out_features // attn.num_heads
        expanded = attn.kv_b_proj.out_features // attn.num_heads  # a head's key part (no rope) and value
        value_width = expanded - (key_width - config.mla.qk_rope_head_dim)
        widths += attn.num_heads * (key_width + value_width)
    assert config.mla.latent_width + config.mla.kv_lora_rank > config.mla.qk_head_dim + config.mla.v_head_dim
    assert ModelCost.from_config(config).attn_flops_per_token_pair == 2 * widths
