"""What a model's tokens cost: bytes per KV token, bytes per state slot, prefill FLOPs (no torch).

Read from a model folder's config.json through `ModelConfig` (only that file is read):

    kv_bytes_per_token = attention layers * 2 (K, V) * kv_heads * head_dim * dtype bytes
    state_bytes        = DeltaNet layers * (conv_dim * (kernel - 1) * dtype bytes          (conv state)
                                            + v_heads * k_head_dim * v_head_dim * ssm bytes)  (recurrent state:
                                              4 for the default fp32, 2 with --mamba-ssm-cache-dtype bfloat16)
                         + Mamba2 layers * (conv_dim * (kernel - 1) * dtype bytes + heads * head_dim * state_size
                                            * ssm bytes)
                         + Mamba1 layers * (d_inner * (kernel - 1) * dtype bytes + d_inner * state_size * ssm bytes)
                         + short-conv layers * hidden_size * (kernel - 1) * dtype bytes   (LFM2: a conv state only)
                         + hidden_size * dtype bytes           (the last hidden state, for zero-prefill hits)
    (a Falcon-H1 layer, attention and Mamba2 side by side, counts as an attention layer and a Mamba2 layer)
    flops_per_token    = 2 * active parameters (embeddings excluded, lm_head included; a layer's feed-forward
                                                 block where it has one: every layer, or Nemotron-H's MLP and MoE
                                                 layers, which have no state and 2 matrices an MLP, relu^2, not 3;
                                                 an MoE block: its router, its top-k experts, its shared expert
                                                 (+ its gate: Qwen's only; LFM2-MoE has no shared expert),
                                                 Nemotron-H's latent projections; attention with an output gate for
                                                 the Qwen models alone; OLMo Hybrid's DeltaNet projections, q k v g
                                                 a b, are Qwen's q k v z a b; an LFM2 short conv: in_proj
                                                 (B | C | x), the conv's taps, out_proj; Kimi Linear's MLA: q_proj
                                                 (or q_a_proj, q_b_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj; its
                                                 KDA: q k v, the conv's taps, the low-rank f_a f_b and g_a g_b,
                                                 b_proj, o_proj)
                         + DeltaNet layers * 6 * v_heads * k_head_dim * v_head_dim        (state update, readout;
                                                                                           KDA's alike)
                         + Mamba2 layers * 6 * heads * head_dim * state_size
                         + Mamba1 layers * 6 * d_inner * state_size
    attention pairs    = 2 * attention layers * heads * (qk head dim + v head dim) FLOPs per (query, key) pair
                         (QK^T and PV; head_dim both, MLA's qk_head_dim and v_head_dim: a prefill that recomputes
                         a prefix expands the latent rows into its heads' keys and values, `mla_prefill.py`; the
                         expansion, kv_b_proj over a chunk's keys, is left out: at most ~20 % of the pair term
                         with 2,048-token chunks)
    prefill_flops(n)   = flops_per_token * n + pair FLOPs * n (n + 1) / 2

so computing tokens [s, n) costs prefill_flops(n) - prefill_flops(s), and a hit of s tokens saves
prefill_flops(s). Worked example (the built-in model, float32): 2 attention layers * 2 * 2 kv heads * 32
* 4 B = 1,024 B per KV token; 6 DeltaNet layers * (256 * 3 * 4 + 4 * 32 * 32 * 4) + 128 * 4 = 117,248 B per
slot (the engine's slot, `engine.memory.pool_bytes`; paged, two 64 KiB blocks at B = 64).

The engine's prefix cache uses `engine_cost_model`: these FLOPs, and the bytes the engine's memory plan measured
from the model's state specs (a KV block's bytes, and the k blocks a checkpoint's state occupies). The benchmarks
(`hybridcache.bench`) and the simulator use `ModelCost` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridcache.cache import CostModel
from hybridcache.engine.memory import MemoryPlan
from hybridcache.engine_args import AUTO, auto_ssm_dtype
from hybridcache.models.config import LayerKind, MLAConfig, ModelConfig
from hybridcache.models.config.kinds import RECURRENT_KINDS

# The model types whose attention has an output gate (q_proj twice as wide) and whose shared expert has a gate (the
# others: neither)
_QWEN_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# The model types whose "linear_attention" layers are Kimi Delta Attention (low-rank decay and output gates) rather
# than gated DeltaNet
_KDA_TYPES = ("kimi_linear",)
# The recurrent mixer of a layer kind whose layer holds one beside its attention (Falcon-H1's parallel layer)
_RECURRENT_MIXER = {LayerKind.HYBRID: LayerKind.MAMBA2}
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelCost:
    """Sizes and FLOPs of one model (see the module docstring); `name` is for reports."""

    name: str
    kv_bytes_per_token: int
    state_bytes: int
    flops_per_token: float
    attn_flops_per_token_pair: float
    ssm_dtype: str = "float32"  # the recurrent state's dtype `state_bytes` was sized with

    def prefill_flops(self, num_tokens: int) -> float:
        return self.flops_per_token * num_tokens + self.attn_flops_per_token_pair * num_tokens * (num_tokens + 1) / 2

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def cache_cost_model(self) -> CostModel:
        """The `hybridcache.cache.CostModel` the FLOP-aware eviction reads."""
        return CostModel(
            flops_per_token=self.flops_per_token,
            attn_flops_per_token_pair=self.attn_flops_per_token_pair,
            kv_bytes_per_token=float(self.kv_bytes_per_token),
            state_bytes=float(self.state_bytes),
        )

    @classmethod
    def from_config(cls, config: ModelConfig, name: str = "", ssm_dtype: str = "float32") -> ModelCost:
        """`ssm_dtype`: the recurrent state's dtype in the state slots (the engine's `mamba_ssm_cache_dtype`)."""
        c, attention, mlp = config, config.attention, config.mlp
        dtype_bytes = _DTYPE_BYTES.get(c.torch_dtype, 2)
        ssm_bytes = _DTYPE_BYTES[ssm_dtype]
        h = c.hidden_size
        q_dim = attention.num_heads * attention.head_dim
        kv_dim = attention.num_kv_heads * attention.head_dim
        qwen = c.model_type in _QWEN_TYPES  # gated attention, a gated shared expert (the others: neither)
        if c.mla is None:
            attn_params = h * (2 if qwen else 1) * q_dim + 2 * h * kv_dim + q_dim * h  # q (+ gate), k, v, o
            pair_dims = 2 * attention.num_heads * attention.head_dim  # a head's query-key and value widths
        else:
            attn_params = _mla_params(h, attention.num_heads, c.mla)
            pair_dims = attention.num_heads * (c.mla.qk_head_dim + c.mla.v_head_dim)  # expanded (mla_prefill.py)
        mlp_matrices = 2 if c.hidden_act == "relu2" else 3  # up, down (Nemotron-H's relu^2) or gate, up, down
        # per recurrent layer: (parameters, state update and readout FLOPs per token, state bytes)
        recurrent = {kind: _recurrent_cost(c, _RECURRENT_MIXER.get(kind, kind), dtype_bytes, ssm_bytes)
                     for kind in set(c.layer_types) & RECURRENT_KINDS}
        params = h * c.vocab_size  # lm_head
        flops = 0
        state_bytes = h * dtype_bytes  # the last hidden state
        for layer_id, kind in enumerate(c.layer_types):
            if kind in (LayerKind.FULL_ATTENTION, LayerKind.HYBRID):  # (Falcon-H1's: attention and Mamba2 both)
                params += attn_params
            if kind in recurrent:
                params += recurrent[kind][0]
                flops += recurrent[kind][1]
                state_bytes += recurrent[kind][2]
            if not c.has_feed_forward(layer_id):  # (Nemotron-H: only its MLP layers)
                continue
            if c.is_moe_layer(layer_id):
                width = mlp.moe_latent_size or h  # the experts' input and output (Nemotron-H's latent projections)
                expert = mlp_matrices * width * mlp.moe_intermediate_size
                params += h * mlp.num_experts + mlp.num_experts_per_tok * expert
                params += mlp_matrices * h * mlp.shared_expert_intermediate_size + (h if qwen else 0)
                params += 2 * h * width if mlp.moe_latent_size else 0
            else:
                params += mlp_matrices * h * (mlp.intermediate_size or 0)
        return cls(
            name=name or c.architecture,
            kv_bytes_per_token=c.num_attention_layers * 2 * kv_dim * dtype_bytes,
            state_bytes=state_bytes,
            flops_per_token=float(2 * params + flops),
            attn_flops_per_token_pair=float(2 * c.num_attention_layers * pair_dims),
            ssm_dtype=ssm_dtype,
        )


def _mla_params(h: int, heads: int, mla: MLAConfig) -> int:
    """One MLA layer's parameters (`models/kimi_linear.KimiMLA`): the query projection (full rank, or down to
    q_lora_rank and up), the latent | shared key projection, the latent's expansion into each head's key and value
    parts, the output projection."""
    q_out = heads * mla.qk_head_dim
    query = h * q_out if mla.q_lora_rank is None else mla.q_lora_rank * (h + q_out)
    return (query + h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
            + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim) + heads * mla.v_head_dim * h)


def _recurrent_cost(c: ModelConfig, kind: LayerKind, dtype_bytes: int, ssm_bytes: int) -> tuple[int, int, int]:
    """(parameters, state update + readout FLOPs per token, state bytes) of one recurrent layer of `kind`."""
    h = c.hidden_size
    if kind is LayerKind.SHORT_CONV:  # its state is the conv's inputs: the conv's taps are all it computes
        conv = c.short_conv
        assert conv is not None
        return 3 * h * h + h * conv.conv_kernel_size + h * h, 0, h * conv.conv_width * dtype_bytes
    if kind is LayerKind.MAMBA1:
        m1 = c.mamba1
        assert m1 is not None
        inner, rank = m1.intermediate_size, m1.dt_rank
        state = inner * m1.state_size
        params = (h * 2 * inner + inner * m1.conv_kernel_size  # in_proj: x, gate; conv
                  + inner * (rank + 2 * m1.state_size) + rank * inner + inner * h)  # x_proj, dt_proj, out_proj
        return params, 6 * state, inner * m1.conv_width * dtype_bytes + state * ssm_bytes
    if kind is LayerKind.MAMBA2:
        m = c.mamba2
        assert m is not None
        state = m.num_heads * m.head_dim * m.state_size
        params = (h * (m.intermediate_size + m.conv_dim + m.num_heads)  # in_proj: z, x | B | C, dt
                  + m.conv_dim * m.conv_kernel_size + m.intermediate_size * h)  # conv, out_proj
        return params, 6 * state, m.conv_dim * m.conv_width * dtype_bytes + state * ssm_bytes
    delta = c.gated_delta
    vh = delta.num_v_heads
    state = vh * delta.k_head_dim * delta.v_head_dim
    if c.model_type in _KDA_TYPES:  # Kimi Delta Attention (`models/kimi_linear.KimiDeltaAttention`)
        rank = delta.k_head_dim  # the decay's and the output gate's low rank
        params = (h * (2 * delta.key_dim + delta.value_dim)  # q, k, v
                  + rank * (h + delta.key_dim) + rank * (h + delta.value_dim)  # f_a, f_b; g_a, g_b
                  + h * vh  # b
                  + delta.conv_dim * delta.conv_kernel_size + delta.value_dim * h)  # conv, o
        return params, 6 * state, delta.conv_dim * delta.conv_width * dtype_bytes + state * ssm_bytes
    params = (h * (2 * delta.key_dim + 2 * delta.value_dim)  # q, k, v, z
              + h * 2 * vh  # b, a
              + delta.conv_dim * delta.conv_kernel_size + delta.value_dim * h)
    return params, 6 * state, delta.conv_dim * delta.conv_width * dtype_bytes + state * ssm_bytes


def builtin_model_config() -> ModelConfig:
    """The built-in model's config: its folder's config.json when written, else built from its constants
    (no torch: the simulator does not write the model folder)."""
    from hybridcache.models.builtin import BUILTIN_CONFIG, builtin_model_dir

    path = builtin_model_dir()
    if (path / "config.json").is_file():
        return ModelConfig.from_model_dir(path)
    raw = {**BUILTIN_CONFIG, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
           "dtype": "float32"}
    return ModelConfig.from_dict(raw)


def load_model_cost(model_dir: str | Path | None = None, ssm_dtype: str = "float32") -> ModelCost:
    """The cost model of a model folder (only config.json is read); None = the built-in model. `ssm_dtype`:
    "auto" (the config's `mamba_ssm_dtype`, else float32, as the engine resolves it), float32, bfloat16, float16."""
    config = builtin_model_config() if model_dir is None else ModelConfig.from_model_dir(model_dir)
    if ssm_dtype == AUTO:
        ssm_dtype = auto_ssm_dtype(config.mamba_ssm_dtype)
    return ModelCost.from_config(config, "builtin" if model_dir is None else Path(model_dir).name, ssm_dtype)


def engine_cost_model(config: ModelConfig, plan: MemoryPlan, *, block_size: int, ssm_dtype: str) -> CostModel:
    """The `CostModel` of an engine's prefix cache (what `--eviction flop-aware` ranks by): FLOPs per token and
    per attention pair from the model config (`ModelCost.from_config`), bytes from the memory plan, which sized
    them from the model's state specs: `kv_bytes_per_token` = a block's bytes / block_size, `state_bytes` = the
    bytes a checkpoint's state occupies (its k blocks of the pool, or one slot when the plan has no pages)."""
    cost = ModelCost.from_config(config, ssm_dtype=ssm_dtype)
    held = plan.state_pages * plan.block_bytes if plan.state_pages else plan.slot_bytes
    return CostModel(
        flops_per_token=cost.flops_per_token,
        attn_flops_per_token_pair=cost.attn_flops_per_token_pair,
        kv_bytes_per_token=plan.block_bytes / block_size,
        state_bytes=float(held),
    )
