"""What device state each layer needs (its spec), and the pools allocated from the specs.

Two kinds of state, vLLM-spec style:

- `AttentionSpec`: paged KV. Every attention layer owns, per kernel page, `kernel_block_size` tokens of
  keys and values; a scheduler block is `pages_per_block` pages. Block ids are shared by all attention layers.
- `RecurrentSpec`: a fixed-size state per sequence, made of named tensors (a conv-then-recurrence mixer, gated
  DeltaNet, KDA, Mamba1 or Mamba2: `conv` [C, K-1] + `ssm`, e.g. [Hv, Dk, Dv] for gated DeltaNet, `conv_ssm_spec`;
  LFM2's short convolution: `conv` alone). Slot ids are shared by all recurrent layers: one slot covers every
  recurrent layer's every state tensor.

Allocation groups layers with equal specs into one stacked tensor (one per `AttentionSpec`, one per
`StateTensorSpec`), so a copy op is one batched copy per group, whatever the number of layers::

    specs  [R, R, R, A, R]   R = RecurrentSpec(conv [96, 3] fp32, ssm [4, 16, 16] fp32), A = AttentionSpec
    kv_groups    [kv  [1 layer, 2, num_pages, kernel_block_size, Hkv, D]]
    state_groups [conv [4 layers, num_slots, 96, 3], ssm [4 layers, num_slots, 4, 16, 16]]
    layers       [{conv: conv[0], ssm: ssm[0]}, ..., kv[0], {conv: conv[3], ssm: ssm[3]}]   (views)

Per-slot tensors that belong to no layer (`slot_specs`, e.g. the model's `last_hidden` [hidden]: the final
hidden state of the last position a slot's sequence computed) are one more state group each, [1, num_slots,
*shape], so slot copies (checkpoint saves and restores) carry them like any layer's state; `slot_state`
names their [num_slots, *shape] views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Paged KV of one attention layer: per token, keys and values of `num_kv_heads` x `head_dim`."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class StateTensorSpec:
    """One named tensor of a recurrent layer's per-sequence state: `shape` per slot."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class RecurrentSpec:
    """The per-sequence state of one recurrent layer: its named tensors (names unique within the layer)."""

    tensors: tuple[StateTensorSpec, ...]


def conv_ssm_spec(conv1d: torch.nn.Conv1d, ssm_shape: tuple[int, ...], dtype: torch.dtype,
                  state_dtype: torch.dtype) -> RecurrentSpec:
    """The state of a mixer that runs a depthwise causal convolution, then a recurrence (Mamba1, Mamba2, gated
    DeltaNet, Kimi's KDA): "conv", the last K-1 pre-convolution inputs [C, K-1] of `conv1d` (C its channels, K its
    kernel size) in the model `dtype`; "ssm", the recurrent state `ssm_shape` in `state_dtype`."""
    return RecurrentSpec(tensors=(
        StateTensorSpec(name="conv", shape=(conv1d.out_channels, conv1d.kernel_size[0] - 1), dtype=dtype),
        StateTensorSpec(name="ssm", shape=ssm_shape, dtype=state_dtype),
    ))


LayerSpec = AttentionSpec | RecurrentSpec
# A layer's state as its mixer sees it: the KV pool [2, num_pages, kernel_block_size, Hkv, D] of an
# attention layer, or name -> [num_slots, *shape] for a recurrent layer. Views into the groups.
LayerState = torch.Tensor | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class DevicePools:
    """The device memory the cache manages, allocated once from the layers' specs; updated in place.

    kv_groups    : one tensor per distinct `AttentionSpec`, [layers, 2, num_pages, kernel_block_size, Hkv, D]
                   (index 0 of dim 1 = keys after q/k-norm and RoPE, 1 = values)
    state_groups : one tensor per distinct `StateTensorSpec`, [layers, num_slots, *shape]
    layers       : per state layer, its `LayerState` (views into the groups): one a decoder layer, or the model's
                   `states_per_layer` of each (Falcon-H1: its attention's KV, then its Mamba2 state)
    slot_state   : name -> [num_slots, *shape] of each per-slot tensor of no layer (`slot_specs`); its group
                   is in `state_groups` too
    """

    kv_groups: tuple[torch.Tensor, ...]
    state_groups: tuple[torch.Tensor, ...]
    layers: tuple[LayerState, ...]
    kernel_block_size: int
    slot_state: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def allocate(
        cls,
        specs: Sequence[LayerSpec],
        *,
        num_pages: int,
        kernel_block_size: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        slot_specs: Sequence[StateTensorSpec] = (),
    ) -> DevicePools:
        """Zeroed pools for `specs` (one per state layer, in layer order: `HybridCausalLM.state_specs`) and for
        `slot_specs` (per-slot tensors of no layer, see the module docstring)."""
        members: dict[AttentionSpec | StateTensorSpec, list[int]] = {}
        for layer_id, spec in enumerate(specs):
            keys = (spec,) if isinstance(spec, AttentionSpec) else spec.tensors
            for key in keys:
                members.setdefault(key, []).append(layer_id)
        groups: dict[AttentionSpec | StateTensorSpec, torch.Tensor] = {}
        for key, layer_ids in members.items():
            if isinstance(key, AttentionSpec):
                shape = (len(layer_ids), 2, num_pages, kernel_block_size, key.num_kv_heads, key.head_dim)
            else:
                shape = (len(layer_ids), num_slots, *key.shape)
            groups[key] = torch.zeros(shape, dtype=key.dtype, device=device)

        def view(key: AttentionSpec | StateTensorSpec, layer_id: int) -> torch.Tensor:
            return groups[key][members[key].index(layer_id)]

        layers: list[LayerState] = []
        for layer_id, spec in enumerate(specs):
            if isinstance(spec, AttentionSpec):
                layers.append(view(spec, layer_id))
            else:
                layers.append({t.name: view(t, layer_id) for t in spec.tensors})
        extra = {t.name: torch.zeros((1, num_slots, *t.shape), dtype=t.dtype, device=device) for t in slot_specs}
        if len(extra) != len(slot_specs):
            raise ValueError(f"slot spec names repeat: {[t.name for t in slot_specs]}")
        return cls(
            kv_groups=tuple(g for k, g in groups.items() if isinstance(k, AttentionSpec)),
            state_groups=tuple(g for k, g in groups.items() if isinstance(k, StateTensorSpec)) + tuple(extra.values()),
            layers=tuple(layers),
            kernel_block_size=kernel_block_size,
            slot_state=MappingProxyType({name: group[0] for name, group in extra.items()}),
        )
