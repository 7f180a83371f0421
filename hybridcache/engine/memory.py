"""How the device memory is split between KV blocks, runtime state slots and checkpoint slots.

Pure arithmetic (no torch): the engine measures the numbers on the device and calls `plan_memory`.

The budget (CUDA; `budget_bytes`):

    budget = gpu_memory_utilization * total device memory
             - memory in use after loading (weights, CUDA context, other processes)
             - the activation peak of a profiling forward of max_num_batched_tokens tokens

It is shared, in this order, by:

1. the runtime state slots: one per running sequence (`max_num_seqs`), always;
2. KV blocks and checkpoint slots. Whatever is given explicitly (`num_blocks`, `num_checkpoint_slots`) is taken
   first and the rest of the budget goes to the other. When neither is given, the split rule is **one
   checkpoint slot per `tokens_per_checkpoint` tokens of KV** (2,048 by default, the simulator's
   `kv_tokens_per_slot`): a checkpoint is worth keeping only while the KV of the prefix it ends is cached too,
   so they are bought in pairs of (one slot, tokens_per_checkpoint / block_size blocks).

Worked example (random Qwen3-Next 1.39B in bf16, block 64: a KV block is 4 attention layers x 2 x 64 tokens x
2 kv heads x 256 x 2 B = 512 KiB; a state slot is 12 DeltaNet layers x (32 x 128 x 128 + 8,192 x 3) x 4 B
= 25.125 MiB, as much as 50 KV blocks)::

    budget 100 GiB, max_num_seqs 64            runtime slots: 64 x 25.125 MiB = 1.57 GiB
    the rest: 98.43 GiB; a pair = 25.125 MiB + 32 blocks x 0.5 MiB = 41.125 MiB -> 2,450 checkpoint slots
    blocks: (98.43 GiB - 2,450 x 25.125 MiB) // 0.5 MiB = 78,471 blocks (5.0 M tokens of KV)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

DEFAULT_TOKENS_PER_CHECKPOINT = 2048


@dataclass(frozen=True)
class MemoryPlan:
    """What the budget buys. `budget_bytes` is what was split; the rest fields are counts and their bytes."""

    budget_bytes: int
    num_blocks: int
    num_runtime_slots: int
    num_checkpoint_slots: int
    kv_bytes: int
    state_bytes: int

    @classmethod
    def fixed(
        cls, *, num_blocks: int, num_runtime_slots: int, num_checkpoint_slots: int, kv_bytes_per_block: int,
        state_bytes_per_slot: int,
    ) -> MemoryPlan:
        """A plan of given counts (the CPU path): the budget is exactly what they take."""
        kv = num_blocks * kv_bytes_per_block
        state = (num_runtime_slots + num_checkpoint_slots) * state_bytes_per_slot
        return cls(kv + state, num_blocks, num_runtime_slots, num_checkpoint_slots, kv, state)

    @property
    def num_slots(self) -> int:
        """All state slots: runtime + checkpoint."""
        return self.num_runtime_slots + self.num_checkpoint_slots

    def describe(self) -> str:
        """One line: 'KV 12.0 GiB (N blocks) + state 3.1 GiB (R runtime + C checkpoint slots) of 16.0 GiB'."""
        gib = 1 << 30
        return (
            f"KV {self.kv_bytes / gib:.2f} GiB ({self.num_blocks} blocks) + state {self.state_bytes / gib:.2f} GiB "
            f"({self.num_runtime_slots} runtime + {self.num_checkpoint_slots} checkpoint slots) "
            f"of a {self.budget_bytes / gib:.2f} GiB budget"
        )


def pool_bytes(specs: Sequence[Any], block_size: int) -> tuple[int, int]:
    """(bytes of one KV block over all attention layers, bytes of one state slot over all recurrent layers) of
    the layers' `hybridcache.state_spec` specs (read by attribute: an `AttentionSpec` has `num_kv_heads`, a
    `RecurrentSpec` has `tensors`; a dtype's `itemsize` is its bytes)."""
    kv = state = 0
    for spec in specs:
        if hasattr(spec, "num_kv_heads"):
            kv += 2 * block_size * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        else:
            state += sum(prod(t.shape) * t.dtype.itemsize for t in spec.tensors)
    return kv, state


def plan_memory(
    budget_bytes: int,
    *,
    kv_bytes_per_block: int,
    state_bytes_per_slot: int,
    max_num_seqs: int,
    block_size: int,
    min_blocks: int,
    num_blocks: int | None = None,
    num_checkpoint_slots: int | None = None,
    tokens_per_checkpoint: int = DEFAULT_TOKENS_PER_CHECKPOINT,
) -> MemoryPlan:
    """Split `budget_bytes` (see the module docstring). `min_blocks`: the blocks one sequence of max_model_len
    needs; a plan with fewer is a ValueError, as is one whose explicit counts do not fit the budget.

    A model without attention layers (kv_bytes_per_block 0) or without recurrent ones (state_bytes_per_slot 0)
    is fine: the free part then goes wholly to the other pool (0 bytes each buys nothing, so counts are capped
    by what the other needs)."""
    if budget_bytes <= 0:
        raise ValueError(
            f"no device memory is left for the cache ({budget_bytes / (1 << 30):.2f} GiB): raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    runtime_bytes = max_num_seqs * state_bytes_per_slot
    rest = budget_bytes - runtime_bytes
    kv, state = kv_bytes_per_block, state_bytes_per_slot
    if num_blocks is not None and num_checkpoint_slots is not None:
        blocks, slots = num_blocks, num_checkpoint_slots
    elif num_checkpoint_slots is not None:
        slots = num_checkpoint_slots
        blocks = (rest - slots * state) // kv if kv else min_blocks
    elif num_blocks is not None:
        blocks = num_blocks
        slots = (rest - blocks * kv) // state if state else 0
    else:
        pair = state + kv * tokens_per_checkpoint // block_size
        slots = rest // pair if state else 0
        blocks = (rest - slots * state) // kv if kv else min_blocks
    used = runtime_bytes + blocks * kv + slots * state
    if used > budget_bytes or slots < 0:
        raise ValueError(
            f"{blocks} KV blocks, {max_num_seqs} runtime and {max(slots, 0)} checkpoint slots need "
            f"{used / (1 << 30):.2f} GiB; the budget is {budget_bytes / (1 << 30):.2f} GiB"
        )
    if blocks < min_blocks:
        raise ValueError(
            f"the KV budget holds {blocks} blocks of {block_size} tokens but one sequence of max_model_len needs "
            f"{min_blocks}: lower max_model_len or raise gpu_memory_utilization"
        )
    return MemoryPlan(
        budget_bytes=budget_bytes,
        num_blocks=blocks,
        num_runtime_slots=max_num_seqs,
        num_checkpoint_slots=slots,
        kv_bytes=blocks * kv,
        state_bytes=(max_num_seqs + slots) * state,
    )
