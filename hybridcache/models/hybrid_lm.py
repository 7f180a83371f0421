"""The decoder skeleton shared by Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Jamba, LFM2, LFM2-MoE, OLMo Hybrid and Kimi Linear
(their own norms, names and mixers: `models/jamba.py`, `models/lfm2.py`, `models/olmo_hybrid.py`,
`models/kimi_linear.py`) and (their layers their own: `models/granite.py`, `models/nemotron_h.py`, `models/bamba.py`,
`models/falcon_h1.py`) Granite-4.0-H, Nemotron-H, Bamba and Falcon-H1.

Module tree (names equal the checkpoint tensor names)::

    model.embed_tokens                      [vocab, hidden]
    model.layers.{i}.input_layernorm        zero-centred RMSNorm
    model.layers.{i}.linear_attn            gated DeltaNet       (layer_types[i] == "linear_attention")
    model.layers.{i}.self_attn              gated attention      (layer_types[i] == "full_attention")
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp                    MLP or SparseMoeBlock (config.is_moe_layer(i))
    model.norm
    lm_head                                 [vocab, hidden] (the embedding itself when tied)

A decoder layer is a token mixer plus an optional feed-forward block; the mixer is registered under its
checkpoint name. A model whose layers or norms differ (Granite, Nemotron-H, Bamba, Falcon-H1, OLMo Hybrid's post-norm
attention layers, Kimi Linear's KDA and MLA mixers) overrides `_layer` and `_norm`: the skeleton needs of a layer
only `mixer` (whose `state_spec` it reads) and `forward_split`, of a norm `forward(x, backend)` and
`add(x, residual, backend)`. A layer without state
(Nemotron-H's MLP layers) declares a `RecurrentSpec` of no tensors: the pools hold an empty mapping for it.
`config.multipliers` scales the embedding and the logits (1 but for Granite and Falcon-H1).
Device state: each layer's mixer declares a spec (`state_spec`); `state_specs()` lists
them in layer order, `DevicePools.allocate` makes the pools, and layer i reads `pools.layers[i]`. A model whose
every decoder layer holds several states (Falcon-H1: paged KV and a Mamba2 state, side by side) sets
`states_per_layer` k > 1: its layers list their k specs (`layer.state_specs(dtype, state_dtype)`), the pools hold k
state layers per decoder layer, in that order, and layer i's `forward_split` gets the tuple
`pools.layers[k i : k (i + 1)]`. The cache and the pools see only state layers (a spec each), never decoder layers.

Tensor parallel (`HybridCausalLM(config, tp)`, see `hybridcache.layers.parallel`): each mixer and feed-forward
block holds its rank's heads / intermediate channels and all-reduces its output, so the hidden state between
blocks is whole and equal on every rank; the embedding and the norms are replicated; `lm_head` holds the rank's
rows of the vocabulary (ceil(vocab / N), zero-padded when N does not divide it) and the logits are all-gathered
(every rank returns the full logits, the padding columns cut off). `shards()` says
which part of each checkpoint tensor a rank loads, in the order it keeps it (also unsharded, for the parameters a
layer keeps in another row order than the checkpoint's). The state specs are the rank's own (its heads only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.attention import GatedAttention
from hybridcache.layers.embedding import embedding
from hybridcache.layers.gated_deltanet import GatedDeltaNet
from hybridcache.layers.linear import module_linear, wants_fp8_rows
from hybridcache.layers.mlp import MLP, SparseMoeBlock
from hybridcache.layers.norm import ZeroCenteredRMSNorm
from hybridcache.layers.parallel import UNSHARDED, Shard, TensorParallel
from hybridcache.layers.rotary import batch_cos_sin
from hybridcache.layers.step import Splitter, StepContext
from hybridcache.models.config import LayerKind, ModelConfig
from hybridcache.state_spec import DevicePools, LayerSpec, LayerState, StateTensorSpec

LAST_HIDDEN = "last_hidden"


class DecoderLayer(nn.Module):
    """hidden + mixer(input_layernorm(hidden)); then, when the layer has a feed-forward block,
    hidden + mlp(post_attention_layernorm(hidden)). `mixer_name` is the mixer's checkpoint name. The model runs its
    layers through `forward_split`, so each residual add is fused with the norm that follows it.

    `norm` makes the two norms, `norm(hidden_size, eps)` (Qwen's zero-centred RMSNorm by default; Jamba's, LFM2's and
    OLMo Hybrid's are `layers.norm.RMSNorm`s); `mlp_name` and `post_norm_name` are the checkpoint names of the
    feed-forward block and the norm before it (Jamba: `feed_forward`, `pre_ff_layernorm`)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module | None, hidden_size: int, eps: float, *,
                 norm: Callable[[int, float], nn.Module] = ZeroCenteredRMSNorm, mlp_name: str = "mlp",
                 post_norm_name: str = "post_attention_layernorm") -> None:
        super().__init__()
        self.mixer_name, self.mlp_name, self.post_norm_name = mixer_name, mlp_name, post_norm_name
        # registered under their checkpoint names (directly: `add_module` refuses a name the properties below hold)
        self._modules[mixer_name] = mixer
        self._modules[mlp_name] = mlp
        self.input_layernorm = norm(hidden_size, eps)
        self._modules[post_norm_name] = norm(hidden_size, eps) if mlp is not None else None

    @property
    def mixer(self) -> nn.Module:
        return self._modules[self.mixer_name]

    @property
    def mlp(self) -> nn.Module | None:
        return self._modules[self.mlp_name]

    @property
    def post_attention_layernorm(self) -> nn.Module | None:
        return self._modules[self.post_norm_name]

    def forward(self, hidden: torch.Tensor, step: StepContext, state: LayerState) -> torch.Tensor:
        residual, out = self.forward_split(hidden, None, step, state)
        return residual + out

    def forward_split(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepContext,
                      state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the input hidden + pending (`pending` None: hidden alone), returned as (residual, out) whose
        sum is the layer's output. Each residual add is left to the norm after it, which adds and normalises in one
        op (`ZeroCenteredRMSNorm.add`): the sums are the ones `forward` makes, rounded where torch's add rounds."""
        backend = step.backend
        if pending is None:
            normed = self.input_layernorm(hidden, backend)
        else:
            fp8 = wants_fp8_rows(self.mixer.input_projection, hidden)  # the norm quantises for an FP8 projection
            hidden, normed = self.input_layernorm.add(hidden, pending, backend, fp8=fp8)
        out = self.mixer(normed, step, state)
        if self.mlp is not None:
            hidden, normed = self.post_attention_layernorm.add(hidden, out, backend)
            out = self.mlp(normed, step)
        return hidden, out


class _Backbone(nn.Module):
    """Holds `embed_tokens`, `layers`, `norm` so that their names start with `model.`."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class HybridCausalLM(nn.Module):
    """Base class of the supported models; subclasses set `deltanet_cls` and `supported_model_types`.

    `model(batch, pools, backend)` runs one forward over a `ForwardBatch` and returns fp32 logits
    [len(batch.logits_indices), vocab] (one row per sequence in engine batches), followed by the rows of
    `batch.prompt_logits_rows`, then those of `batch.draft_rows`, when there are any.
    """

    deltanet_cls: type[nn.Module] = GatedDeltaNet
    deltanet_norm_eps: float | None = None  # the DeltaNet's gated norm's eps where it is not rms_norm_eps
    supported_model_types: tuple[str, ...] = ()
    # State layers per decoder layer (module docstring): 1, the mixer's; k > 1, the layer's own `state_specs`
    states_per_layer: int = 1
    # What the model has besides text generation in the model dtype (a loader or engine option asking for one it
    # lacks is refused with a ValueError naming the architecture)
    supports_fp8: bool = True
    # Why the model runs on one rank only (None: it runs under tensor parallelism); a ValueError says it
    single_rank_reason: str | None = None

    def __init__(self, config: ModelConfig, tp: TensorParallel = UNSHARDED) -> None:
        super().__init__()
        if config.model_type not in self.supported_model_types:
            raise ValueError(
                f"{type(self).__name__} supports model_type {self.supported_model_types}, "
                f"not {config.model_type!r}"
            )
        if tp.size > 1 and self.single_rank_reason is not None:
            raise ValueError(f"{config.architecture} does not run under tensor parallelism yet (tensor_parallel_size "
                             f"{tp.size}): {self.single_rank_reason}")
        self.config = config
        self.tp = tp
        self.vocab_shard = tp.split_padded(config.vocab_size)
        layers = [self._layer(layer_id) for layer_id in range(config.num_hidden_layers)]
        self.model = _Backbone(config, layers, self._norm(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_shard.length, bias=False)
        self.tie_weights()
        self.eval()
        self.requires_grad_(False)

    def tie_weights(self) -> None:
        """Make `lm_head` share the embedding matrix when the config ties them (again after `to_empty`). Under
        tensor parallelism the lm_head is the rank's slice of the embedding, loaded as a copy (see `shards`)."""
        if self.config.tie_word_embeddings and self.tp.size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    def after_loading_(self) -> None:
        """Called by the loader once every weight is in (`load_model`, `load_weights`; not after a dummy draw, whose
        random weights stand for loaded ones): a family whose forward reads weights derived from the checkpoint's
        makes them here, in place. None here; Falcon-H1 folds its muP multipliers into its linears."""

    def drops_checkpoint_tensor(self, name: str, shape: tuple[int, ...]) -> bool:
        """True for a checkpoint tensor (its name as written, its shape) this model does without: the loader reads
        nothing from it and does not call it unexpected. None here; a family whose checkpoints hold tensors it
        has no parameter for overrides it (Kimi Linear: a zero-width shared expert)."""
        del name, shape
        return False

    def _layer(self, layer_id: int) -> nn.Module:
        """Decoder layer `layer_id`: a `DecoderLayer` of `_mixer` and `_mlp`."""
        c = self.config
        return DecoderLayer(*self._mixer(layer_id), self._mlp(layer_id), c.hidden_size, c.rms_norm_eps)

    def _norm(self, dim: int) -> nn.Module:
        """The final norm: zero-centred RMSNorm."""
        return ZeroCenteredRMSNorm(dim, eps=self.config.rms_norm_eps)

    def _mixer(self, layer_id: int) -> tuple[str, nn.Module]:
        """(checkpoint name, module) of layer `layer_id`'s token mixer."""
        if self.config.layer_types[layer_id] is LayerKind.LINEAR_ATTENTION:
            return "linear_attn", self._deltanet()
        return "self_attn", self._attention()

    def _deltanet(self) -> nn.Module:
        """A gated DeltaNet mixer of `deltanet_cls` (its gated norm's eps: `deltanet_norm_eps`, else the model's)."""
        c, delta = self.config, self.config.gated_delta
        return self.deltanet_cls(
            c.hidden_size,
            num_k_heads=delta.num_k_heads,
            num_v_heads=delta.num_v_heads,
            k_head_dim=delta.k_head_dim,
            v_head_dim=delta.v_head_dim,
            conv_kernel_size=delta.conv_kernel_size,
            eps=c.rms_norm_eps if self.deltanet_norm_eps is None else self.deltanet_norm_eps,
            tp=self.tp,
            beta_scale=delta.beta_scale,
        )

    def _attention(self) -> nn.Module:
        """An attention mixer: Qwen's gated attention."""
        c = self.config
        attention = c.attention
        return GatedAttention(
            c.hidden_size,
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            bias=attention.bias,
            eps=c.rms_norm_eps,
            tp=self.tp,
        )

    def _mlp(self, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s feed-forward block (every layer of the supported models has one)."""
        c, mlp = self.config, self.config.mlp
        if c.is_moe_layer(layer_id):
            return SparseMoeBlock(
                c.hidden_size,
                num_experts=mlp.num_experts,
                top_k=mlp.num_experts_per_tok,
                moe_intermediate_size=mlp.moe_intermediate_size,
                shared_expert_intermediate_size=mlp.shared_expert_intermediate_size,
                norm_topk_prob=mlp.norm_topk_prob,
                tp=self.tp,
            )
        return MLP(c.hidden_size, mlp.intermediate_size, self.tp)

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> the part of the full checkpoint tensor this rank holds, in the order held;
        parameters not named are read whole, as the checkpoint holds them. Unsharded, only the parameters a
        layer keeps in another row order than the checkpoint's (Qwen3-Next's packed DeltaNet projections)."""
        out = {} if self.tp.size == 1 else {"lm_head.weight": self.vocab_shard}
        for prefix, module in self.named_modules():
            if module is not self and hasattr(module, "shards"):
                out.update({f"{prefix}.{name}": shard for name, shard in module.shards().items()})
        return out

    def _logits(self, hidden: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """Logits over the whole vocabulary (the ranks' slices gathered, padding columns cut off): fp32, or with
        `raw` in the lm_head's dtype (the same values before their exact widening: what an argmax or a caller
        that widens them itself needs)."""
        logits = self.tp.all_gather_last(module_linear(self.lm_head, hidden))  # [.., size x ceil(vocab / size)]
        vocab = self.config.vocab_size
        logits = logits if logits.shape[-1] == vocab else logits[..., :vocab]
        multipliers = self.config.multipliers
        # (Granite divides, Falcon-H1 multiplies; in the lm_head's dtype, as transformers)
        logits = logits if multipliers.logits_scaling == 1.0 else logits / multipliers.logits_scaling
        logits = logits if multipliers.logits == 1.0 else logits * multipliers.logits
        return logits if raw else logits.float()

    @property
    def num_state_layers(self) -> int:
        """The state layers of the decoder layers (`states_per_layer` each): `pools.layers` holds them first."""
        return len(self.model.layers) * self.states_per_layer

    def state_specs(self, dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[LayerSpec, ...]:
        """Each state layer's device state spec, in layer order (pools: `DevicePools.allocate`): a decoder layer's
        mixer's, or its `states_per_layer` own (`layer.state_specs`)."""
        if self.states_per_layer == 1:
            return tuple(layer.mixer.state_spec(dtype, state_dtype) for layer in self.model.layers)
        specs = tuple(spec for layer in self.model.layers for spec in layer.state_specs(dtype, state_dtype))
        assert len(specs) == self.num_state_layers, "each decoder layer lists states_per_layer specs"
        return specs

    def slot_specs(self, dtype: torch.dtype) -> tuple[StateTensorSpec, ...]:
        """Per-slot tensors of no layer: `last_hidden` [hidden], the final-norm hidden state of the last
        position the slot's sequence computed. A checkpoint at step s therefore holds what the logits of
        token s are computed from, so a prompt cached up to its end needs only `logits_from_slots`."""
        return (StateTensorSpec(LAST_HIDDEN, (self.config.hidden_size,), dtype),)

    def logits_from_slots(self, pools: DevicePools, slots: torch.Tensor) -> torch.Tensor:
        """fp32 logits [len(slots), vocab] from the `last_hidden` of each slot (no layer runs)."""
        with torch.inference_mode():
            logits = self._logits(pools.slot_state[LAST_HIDDEN][slots])
        return logits.clone()

    def forward(self, batch: ForwardBatch, pools: DevicePools, backend: KernelBackend, *,
                raw: bool = False) -> torch.Tensor:
        """Run the step (`batch` prepared by `backend.prepare`) under `torch.inference_mode`; the pools are
        updated in place. The fp32 logits are returned as an ordinary tensor (cloned out of inference mode) so
        callers may modify them in place. `raw`: instead the lm_head's output as it is (the model's dtype, an
        inference tensor): a captured CUDA graph's output, which the runner widens into a new fp32 tensor after
        each replay (one pass over the logits instead of a widening, a clone in the graph and one after it)."""
        with torch.inference_mode():
            logits, _ = self._forward(batch, pools, backend, raw=raw)
        return logits if raw else logits.clone()

    def forward_with_hidden(self, batch: ForwardBatch, pools: DevicePools, backend: KernelBackend, *,
                            raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning the final-norm hidden state of every row [T, hidden] (what an MTP head
        reads)."""
        with torch.inference_mode():
            logits, hidden = self._forward(batch, pools, backend, keep_hidden=True, raw=raw)
        return (logits if raw else logits.clone()), hidden

    def _forward(self, batch: ForwardBatch, pools: DevicePools, backend: KernelBackend,
                 keep_hidden: bool = False, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, pending = self.forward_layers(batch, pools, backend)
        return self.forward_tail(hidden, pending, batch, pools, backend, keep_hidden, raw)

    def forward_layers(self, batch: ForwardBatch, pools: DevicePools, backend: KernelBackend,
                       splitter: Splitter | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The embedding and every decoder layer: (hidden, pending) [T, hidden], whose sum is the last layer's
        output (`DecoderLayer.forward_split`; pending None when the last layer left nothing to add). Row t
        depends on the sequences only through the layers' cores (`StepContext.core`), which `splitter`, when
        given, runs (piecewise CUDA graphs, `engine/prefill_graphs.py`); the rest reads only
        batch.input_ids, batch.positions (or rope_positions) and the embedded rows."""
        hidden = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        if batch.embeds is not None:
            hidden[batch.embed_rows] = batch.embeds.to(hidden.dtype)
        if self.config.multipliers.embedding != 1.0:  # (Granite)
            hidden = hidden * self.config.multipliers.embedding
        rope = batch_cos_sin(batch, self.config.attention, hidden.dtype)  # image tokens: 3-D positions
        step = StepContext(batch=batch, backend=backend, rope=rope, splitter=splitter)
        pending = None  # the last layer's output not yet added to hidden (`DecoderLayer.forward_split`)
        states = pools.layers[: self.num_state_layers]  # (pools.layers may go on with an MTP head's KV)
        k = self.states_per_layer
        for layer_id, layer in enumerate(self.model.layers):
            state = states[layer_id] if k == 1 else states[k * layer_id : k * (layer_id + 1)]
            hidden, pending = layer.forward_split(hidden, pending, step, state)
        return hidden, pending

    def forward_tail(self, hidden: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch,
                     pools: DevicePools, backend: KernelBackend, keep_hidden: bool = False,
                     raw: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After `forward_layers`: the final norm of the rows that give logits (and every row's when
        `keep_hidden`), each sequence's `last_hidden` slot state, and the logits (see `forward`; fp32, or the
        lm_head's output when `raw`); returns (logits, the final-norm hidden rows or None)."""
        normed = None
        if pending is not None and keep_hidden:
            hidden, normed = self.model.norm.add(hidden, pending, backend)
        elif pending is not None:
            hidden = hidden + pending
        elif keep_hidden:
            normed = self.model.norm(hidden, backend)

        def norm_rows(rows: torch.Tensor) -> torch.Tensor:
            return normed[rows] if normed is not None else self.model.norm(hidden[rows], backend)

        last = norm_rows(batch.logits_indices)
        if LAST_HIDDEN in pools.slot_state:  # one row per sequence: its slot's hidden state at its last token
            pools.slot_state[LAST_HIDDEN].index_copy_(0, batch.state_slots, last)
        if batch.prompt_logits_rows is not None:  # prompt logprobs: more rows, after the last ones
            last = torch.cat([last, norm_rows(batch.prompt_logits_rows)])
        if batch.draft_rows is not None:  # verify rows: every position but the last, kept with its draft state
            drafted = norm_rows(batch.draft_rows)
            if LAST_HIDDEN in pools.slot_state:
                pools.slot_state[LAST_HIDDEN].index_copy_(0, batch.draft_slots, drafted)
            last = torch.cat([last, drafted])
        return self._logits(last, raw), normed
