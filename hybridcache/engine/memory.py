"""How the device memory is split: runtime state slots + one pool of blocks that hold KV or checkpoint states.

Pure arithmetic (no torch): the engine measures the numbers on the device and calls `plan_memory`.

The budget (CUDA; `budget_bytes`):

    budget = gpu_memory_utilization * total device memory
             - what this engine took since it started (free memory at start - free memory after loading:
               weights, the vision tower, workspaces)
             - the activation peak of a profiling forward of max_num_batched_tokens tokens
             - the model's workspace beyond that forward (`KernelBackend.workspace_bytes`; Kimi's MLA)

`gpu_memory_utilization` is this engine's share of the device, as in vLLM: what other processes held when it
started is not counted against it, so two engines at 0.45 share one device. The share must fit in what was free
then (`engine_share`).

It buys, in this order:

0. with a vision tower, the encoder's reserve (`encoder_bytes`, measured by the engine before the pools are sized:
   the activation peak of the largest tower call the processor's largest image can make, plus the encoder cache
   at capacity; `hybridcache.engine.vision_encoder.VisionEncoder.reserve_bytes`): kept free, never pooled;
1. the runtime state slots: one per running sequence (`max_num_seqs`), S bytes each (every recurrent layer's
   state tensors and the per-slot `last_hidden`), and with speculative decoding k draft states of S bytes per
   slot beside it (the states a verify step keeps after each draft position, `cache/plan.py`);
2. one pool of blocks of P bytes (one scheduler block of every attention layer's KV). A block holds either KV
   or 1/k of a checkpoint's state (its pages, `hybridcache.engine.paged_state`), k = ceil(S / P): KV and
   checkpoints compete for the same bytes, and the prefix cache decides what they hold. The pool is
   `num_blocks` blocks when that is given, else the rest of the budget; it must hold one sequence of
   max_model_len.

A model without attention layers (P = 0) keeps its checkpoints in a page store of S-byte rows, k = 1: its
"blocks" then cost S bytes each.

Worked example (random Qwen3-Next 1.39B in bf16, block 64: a KV block is 4 attention layers x 2 x 64 tokens x
2 kv heads x 256 x 2 B = 512 KiB; a state slot is 12 DeltaNet layers x (an fp32 ssm 32 x 128 x 128 x 4 B + a
bf16 conv 8,192 x 3 x 2 B) + last_hidden 2,048 x 2 B = 24.57 MiB = 49.13 blocks, so k = 50)::

    budget 100 GiB, max_num_seqs 64            runtime slots: 64 x 24.57 MiB = 1.54 GiB
    the rest: 98.46 GiB // 512 KiB = 201,655 blocks: 12.9 M tokens of KV, or 4,033 checkpoint states, or any
    mix (a checkpoint costs 50 blocks = 3,200 tokens of KV)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

GIB = 1 << 30


def engine_share(utilization: float, total: int, free_at_start: int) -> int:
    """This engine's bytes of a CUDA device of `total` bytes: `utilization` x `total` (the module docstring). A
    ValueError when that is more than was free when the engine started (`free_at_start`: other processes hold the
    rest).

    Example: 100 GiB device, another process holds 40 GiB: utilization 0.5 gives 50 GiB (60 GiB were free); 0.7
    is refused (70 GiB asked, 60 GiB free). The pools then get the share less what the engine took since it
    started (free at start - free after loading) and its activation peak: with 8 GiB of weights and a 2 GiB peak,
    50 - 8 - 2 = 40 GiB."""
    share = int(utilization * total)
    if share > free_at_start:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for {share / GIB:.2f} GiB of the device's {total / GIB:.2f} "
            f"GiB, but only {free_at_start / GIB:.2f} GiB were free when the engine started (other processes hold "
            "the rest): lower gpu_memory_utilization or free the device"
        )
    return share


def state_pages(slot_bytes: int, page_bytes: int) -> int:
    """k: the blocks (pages) one checkpoint state takes, ceil(slot_bytes / page_bytes); 1 when page_bytes is 0
    (a model without attention layers keeps its checkpoints in a page store of slot_bytes rows).
    Example: a 24.57 MiB slot and 512 KiB blocks -> 50."""
    if slot_bytes <= 0 or page_bytes < 0:
        raise ValueError(f"a state slot of {slot_bytes} bytes and blocks of {page_bytes} bytes: a slot must hold "
                         "something (every model keeps last_hidden) and a block cannot be negative")
    return -(-slot_bytes // page_bytes) if page_bytes else 1


def _size(num_bytes: float) -> str:
    """'512 KiB', '25.1 MiB', '117.1 GiB'."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{num_bytes:.0f} B"


@dataclass(frozen=True)
class MemoryPlan:
    """What the budget buys (see the module docstring). `budget_bytes`: what was split; `num_blocks`: the shared
    pool of KV and checkpoint pages; `state_pages`: k, the blocks of one checkpoint state; `kv_bytes`: the pool's
    bytes (num_blocks x P, or x S for a page store); `state_bytes`: the runtime slots' bytes; `encoder_bytes`: the
    vision encoder's reserve, kept out of the pool (0 without a vision tower, and on the CPU)."""

    budget_bytes: int
    num_blocks: int
    num_runtime_slots: int
    state_pages: int
    kv_bytes: int
    state_bytes: int
    encoder_bytes: int = 0

    @classmethod
    def fixed(
        cls, *, num_blocks: int, num_runtime_slots: int, kv_bytes_per_block: int, state_bytes_per_slot: int,
        num_speculative_tokens: int = 0,
    ) -> MemoryPlan:
        """A plan of given counts (the CPU path): a pool of num_blocks blocks; the budget is exactly what it and
        the runtime slots (with their draft states) take."""
        k = state_pages(state_bytes_per_slot, kv_bytes_per_block)
        kv = num_blocks * (kv_bytes_per_block or state_bytes_per_slot)
        state = num_runtime_slots * (1 + num_speculative_tokens) * state_bytes_per_slot
        return cls(kv + state, num_blocks, num_runtime_slots, k, kv, state)

    @property
    def block_bytes(self) -> int:
        """P: one block's bytes over every attention layer (S for a page store, whose blocks hold states)."""
        return self.kv_bytes // self.num_blocks if self.num_blocks else 0

    @property
    def slot_bytes(self) -> int:
        """S: one runtime state slot's bytes."""
        return self.state_bytes // self.num_runtime_slots if self.num_runtime_slots else 0

    def describe(self) -> str:
        """One line, e.g. 'pool 98.5 GiB: 201,655 blocks of 512 KiB, KV and checkpoint states (a state = 50
        blocks) + 64 runtime state slots 1.5 GiB, of a 100 GiB budget'."""
        block = self.kv_bytes / self.num_blocks if self.num_blocks else 0
        encoder = f" + vision encoder {_size(self.encoder_bytes)} reserved" if self.encoder_bytes else ""
        return (
            f"pool {_size(self.kv_bytes)}: {self.num_blocks:,} blocks of {_size(block)}, KV and checkpoint states "
            f"(a state = {self.state_pages} blocks) + {self.num_runtime_slots} runtime state slots "
            f"{_size(self.state_bytes)}{encoder}, of a {_size(self.budget_bytes)} budget"
        )


def pool_bytes(specs: Sequence[Any], block_size: int, slot_specs: Sequence[Any] = ()) -> tuple[int, int]:
    """(P: bytes of one KV block over all attention layers, S: bytes of one state slot over all recurrent layers
    and the per-slot `slot_specs`) of the layers' `hybridcache.state_spec` specs (read by attribute: an
    `AttentionSpec` has `num_kv_heads`, a `RecurrentSpec` has `tensors`, a `StateTensorSpec` has `shape`; a
    dtype's `itemsize` is its bytes)."""
    kv = state = 0
    for spec in specs:
        if hasattr(spec, "num_kv_heads"):
            kv += 2 * block_size * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        else:
            state += sum(prod(t.shape) * t.dtype.itemsize for t in spec.tensors)
    state += sum(prod(t.shape) * t.dtype.itemsize for t in slot_specs)
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
    num_speculative_tokens: int = 0,
    encoder_bytes: int = 0,
) -> MemoryPlan:
    """Split `budget_bytes` (see the module docstring). `min_blocks`: the blocks one sequence of max_model_len
    needs. `num_blocks`: the pool's blocks (None: the budget's rest). A ValueError when the budget is empty,
    when the vision encoder's reserve takes all of it, when the pool cannot hold one sequence of max_model_len,
    or when what is asked for does not fit the budget. `num_speculative_tokens` k: each runtime slot also has k
    draft states. `encoder_bytes`: the vision encoder's reserve, taken first."""
    if budget_bytes <= 0:
        raise ValueError(
            f"no device memory is left for the cache ({budget_bytes / GIB:.2f} GiB): raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    if encoder_bytes >= budget_bytes:
        raise ValueError(
            f"the vision encoder's reserve ({encoder_bytes / GIB:.2f} GiB: its activations on the largest image "
            f"and its encoder cache) leaves nothing of the {budget_bytes / GIB:.2f} GiB budget for the cache: raise "
            "gpu_memory_utilization, or lower the image processor's max_pixels (preprocessor_config.json)"
        )
    k = state_pages(state_bytes_per_slot, kv_bytes_per_block)
    block = kv_bytes_per_block or state_bytes_per_slot
    runtime_bytes = max_num_seqs * (1 + num_speculative_tokens) * state_bytes_per_slot
    available = budget_bytes - encoder_bytes
    blocks = num_blocks if num_blocks is not None else max(available - runtime_bytes, 0) // block
    if blocks < min_blocks:
        lookahead = f" (with its {num_speculative_tokens} speculative tokens of lookahead)" \
            if num_speculative_tokens else ""
        raise ValueError(
            f"the pool holds {blocks:,} blocks of {block_size} tokens, but one sequence of max_model_len{lookahead} "
            f"needs {min_blocks:,}: lower max_model_len or max_num_seqs, or raise gpu_memory_utilization or num_blocks"
        )
    used = runtime_bytes + blocks * block
    if used > available:
        encoder = f" after the vision encoder's {encoder_bytes / GIB:.2f} GiB" if encoder_bytes else ""
        raise ValueError(
            f"{blocks:,} blocks of {_size(block)} and {max_num_seqs} runtime state slots need {used / GIB:.2f} GiB; "
            f"the budget is {available / GIB:.2f} GiB{encoder}: lower num_blocks or max_num_seqs"
        )
    return MemoryPlan(
        budget_bytes=budget_bytes,
        num_blocks=blocks,
        num_runtime_slots=max_num_seqs,
        state_pages=k,
        kv_bytes=blocks * block,
        state_bytes=runtime_bytes,
        encoder_bytes=encoder_bytes,
    )
