"""Checkpoint states in KV pages (`hybridcache.engine.paged_state`): save -> restore gives back the slot's bytes,
the pages hold the slot's stream as the module docstring lays it out (checked against a byte-by-byte reference
built here from the pools), and nothing but the destinations changes."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.memory import pool_bytes, state_pages
from hybridcache.engine.paged_state import PagedStates
from hybridcache.state_spec import AttentionSpec, DevicePools, RecurrentSpec, StateTensorSpec
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

KBS = 4  # tokens per kernel page
NUM_BLOCKS, NUM_SLOTS = 64, 6


def recurrent(conv_channels: int, ssm: tuple[int, ...], ssm_dtype: torch.dtype) -> RecurrentSpec:
    return RecurrentSpec((StateTensorSpec("conv", (conv_channels, 3), torch.bfloat16),
                          StateTensorSpec("ssm", ssm, ssm_dtype)))


def hidden(size: int, dtype: torch.dtype = torch.bfloat16) -> tuple[StateTensorSpec, ...]:
    return (StateTensorSpec("last_hidden", (size,), dtype),)


# (layer specs, slot specs, pages_per_block); every layout's slot is a few pages, not a multiple of one
LAYOUTS = {
    # fp32 KV, ppb 1, fp32 ssm + bf16 conv and last_hidden: S = 2 x (48 + 128) + 40 = 392, P = 2 x 64 = 128 -> k 4
    "fp32-ppb1": ([recurrent(8, (2, 4, 4), torch.float32), AttentionSpec(1, 4, torch.float32),
                   recurrent(8, (2, 4, 4), torch.float32)], hidden(20), 1),
    # bf16 KV in two groups (head dims 8 and 4), ppb 2; conv rows of 30 bytes (2-byte words): S = 2 x (30 + 512)
    # + 8 = 1,092, P = 2 x 2 x 4 x 2 x 8 x 2 + 2 x 2 x 4 x 4 x 2 = 640 -> k 2
    "bf16-ppb2-two-kv-groups": ([recurrent(5, (2, 8, 8), torch.float32), AttentionSpec(2, 8, torch.bfloat16),
                                 recurrent(5, (2, 8, 8), torch.float32), AttentionSpec(1, 4, torch.bfloat16)],
                                hidden(4), 2),
    # fp16 KV, ppb 2, bf16 ssm: S = 3 x (96 + 512) + 64 = 1,888, P = 2 x 2 x 4 x 2 x 2 x 2 = 128 -> k 15
    "fp16-ppb2-bf16-state": ([recurrent(16, (4, 8, 8), torch.bfloat16)] * 3 + [AttentionSpec(2, 2, torch.float16)],
                             hidden(32), 2),
    # no recurrent layer: the slot is last_hidden alone (S = 64 < P = 2 x 4 x 16 x 2 = 256, k 1)
    "no-recurrent-layer": ([AttentionSpec(1, 16, torch.bfloat16)] * 2, hidden(32), 1),
    # no attention layer: a page store of S-byte rows, k = 1
    "no-attention-layer": ([recurrent(8, (2, 4, 4), torch.float32)] * 2, hidden(16), 1),
}


def make_pools(name: str, device: torch.device, seed: int = 0) -> tuple[DevicePools, int, int]:
    """Random pools of a layout (every byte random, so any misplaced byte shows), its ppb and k."""
    specs, slot_specs, ppb = LAYOUTS[name]
    pools = DevicePools.allocate(specs, num_pages=NUM_BLOCKS * ppb, kernel_block_size=KBS, num_slots=NUM_SLOTS,
                                 device=device, slot_specs=slot_specs)
    gen = torch.Generator().manual_seed(seed)
    for group in (*pools.kv_groups, *pools.state_groups):
        raw = group.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    kv, state = pool_bytes(specs, KBS * ppb, slot_specs)
    return pools, ppb, state_pages(state, kv)


def stream(pools: DevicePools, slot: int) -> torch.Tensor:
    """The reference stream of a slot: each state group's [layers, *shape] bytes of the slot, in group order."""
    return torch.cat([g[:, slot].contiguous().view(-1).view(torch.uint8) for g in pools.state_groups])


def page(pools: DevicePools, block: int, ppb: int) -> torch.Tensor:
    """The reference bytes of a page: each KV group's [layers, 2, ppb pages] of the block, in group order."""
    return torch.cat([kv[:, :, block * ppb: (block + 1) * ppb].contiguous().view(-1).view(torch.uint8)
                      for kv in pools.kv_groups])


def snapshot(pools: DevicePools, paged: PagedStates, ppb: int) -> dict[str, list[torch.Tensor]]:
    """Byte copies of the page tensors as [num_blocks, ...] (KV groups or the page store) and of the state groups
    (compared as bytes: random bits make NaNs)."""
    pages = [kv.reshape(kv.shape[0] * 2, NUM_BLOCKS, -1).transpose(0, 1).contiguous().view(torch.uint8)
             for kv in pools.kv_groups]
    if paged.page_store is not None:
        pages.append(paged.page_store.clone().view(torch.uint8))
    return {"pages": pages, "states": [g.clone().view(-1).view(torch.uint8) for g in pools.state_groups]}


def chunks_of(slots: list[int], k: int) -> list[int]:
    return [slot * k + j for slot in slots for j in range(k)]


def ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def check_round_trip(name: str, device: torch.device, max_workspace_bytes: int | None = None,
                     impl: str = "auto") -> None:
    pools, ppb, k = make_pools(name, device)
    options = {"impl": impl} if max_workspace_bytes is None else {"max_workspace_bytes": max_workspace_bytes,
                                                                   "impl": impl}
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k, **options)
    specs, slot_specs, _ = LAYOUTS[name]
    kv, state = pool_bytes(specs, KBS * ppb, slot_specs)
    assert (paged.slot_bytes, paged.page_bytes) == (state, kv or state)
    assert paged.slot_bytes == stream(pools, 0).numel()
    originals = {slot: stream(pools, slot).cpu() for slot in range(NUM_SLOTS)}

    # one op saves three slots into pages spread over the pool (not in id order)
    saved = [4, 1, 2]
    gen = torch.Generator().manual_seed(1)
    pages = torch.randperm(NUM_BLOCKS, generator=gen)[: len(saved) * k].tolist()
    before = snapshot(pools, paged, ppb)
    paged.save(ids(chunks_of(saved, k), device), ids(pages, device))
    after = snapshot(pools, paged, ppb)
    padded = {slot: torch.cat([b, torch.zeros(k * paged.page_bytes - b.numel(), dtype=torch.uint8)])
              for slot, b in originals.items()}
    for i, block in enumerate(pages):
        slot, j = saved[i // k], i % k
        want = padded[slot][j * paged.page_bytes: (j + 1) * paged.page_bytes]
        got = page(pools, block, ppb) if paged.page_store is None else paged.page_store[block].view(torch.uint8)
        assert torch.equal(got.cpu(), want), (name, slot, j)
    kept = [block for block in range(NUM_BLOCKS) if block not in pages]
    assert len(kept) == NUM_BLOCKS - len(pages)
    for old, new in zip(before["pages"], after["pages"], strict=True):  # only the destination pages moved
        assert torch.equal(old[kept], new[kept]), name
    for old, new in zip(before["states"], after["states"], strict=True):  # a save reads the slots only
        assert torch.equal(old, new), name

    # restore: slot 4's checkpoint into slots 0 and 3 (a repeated source), slot 2's into slot 5, slot 1's into 2
    by_slot = {slot: pages[i * k: (i + 1) * k] for i, slot in enumerate(saved)}
    targets = [(4, 0), (2, 5), (4, 3), (1, 2)]
    src = [p for source, _ in targets for p in by_slot[source]]
    dst = chunks_of([target for _, target in targets], k)
    before = snapshot(pools, paged, ppb)
    paged.restore(ids(src, device), ids(dst, device))
    after = snapshot(pools, paged, ppb)
    for source, target in targets:
        assert torch.equal(stream(pools, target).cpu(), originals[source]), (name, source, target)
    for slot in (1, 4):
        assert torch.equal(stream(pools, slot).cpu(), originals[slot])
    for old, new in zip(before["pages"], after["pages"], strict=True):  # a restore writes no page
        assert torch.equal(old, new), name


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_on_cpu(name):
    check_round_trip(name, torch.device("cpu"))


@pytest.mark.parametrize("name", ["fp32-ppb1", "fp16-ppb2-bf16-state"])
def test_round_trip_in_tiles_of_one_slot(name):
    """A workspace smaller than one state: every slot is its own tile, same bytes."""
    check_round_trip(name, torch.device("cpu"), max_workspace_bytes=1)


@needs_interpreter
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_interpreted_triton_round_trip(name):
    """The one-launch Triton path (`kernels/copy/triton_state.py`) lays out and restores the same bytes."""
    check_round_trip(name, torch.device("cpu"), impl="triton")


@interpreted_in_child("interpreted_triton")
def test_triton_interpreter_in_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_cuda
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_on_cuda(name, impl):
    check_round_trip(name, torch.device("cuda"), impl=impl)


@needs_cuda
def test_compile_on_cuda_copies_nothing():
    """`PagedStates.compile` (the runner's start-up) compiles the Triton kernel without touching a pool."""
    pools, ppb, k = make_pools("fp16-ppb2-bf16-state", torch.device("cuda"))
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k, impl="triton")
    before = snapshot(pools, paged, ppb)
    paged.compile()
    after = snapshot(pools, paged, ppb)
    for name in before:
        assert all(torch.equal(old, new) for old, new in zip(before[name], after[name], strict=True)), name


def test_tile_table_of_the_worked_example():
    """`state_tiles`'s docstring example: 2 layers x 3 words of 4 slots against 2 rows x 2 words of 10 blocks."""
    from hybridcache.kernels.copy.state_tiles import Runs, state_tiles

    table = state_tiles([Runs(100, 2, 3, 12)], [Runs(500, 2, 2, 20)], k=2, block=8).tolist()
    assert table == [
        [100, 3, 500, 2, 0, 2, 0],  # positions [0, 2): layer 0 words 0-1 -> row 0
        [102, 3, 520, 2, 0, 1, 0],  # [2, 3): layer 0 word 2 -> row 1 word 0
        [112, 3, 521, 2, 0, 1, 0],  # [3, 4): layer 1 word 0 -> row 1 word 1
        [113, 3, 500, 2, 1, 2, 0],  # [4, 6): layer 1 words 1-2 -> chunk 1, row 0
        [0, 0, 520, 2, 1, 2, 1],  # [6, 8): padding -> chunk 1, row 1
    ]
    assert len(state_tiles([Runs(0, 1, 20, 20)], [Runs(0, 1, 20, 20)], k=1, block=8)) == 3  # 8 + 8 + 4 words
    with pytest.raises(ValueError, match="does not fit"):
        state_tiles([Runs(0, 1, 9, 9)], [Runs(0, 1, 4, 4)], k=2, block=8)


def test_layouts_cover_what_they_claim():
    ks = {name: make_pools(name, torch.device("cpu"))[2] for name in LAYOUTS}
    assert ks["fp32-ppb1"] == 4 and ks["fp16-ppb2-bf16-state"] == 15 and ks["bf16-ppb2-two-kv-groups"] == 2
    assert ks["no-recurrent-layer"] == 1 and ks["no-attention-layer"] == 1
    for name in ("fp32-ppb1", "fp16-ppb2-bf16-state", "bf16-ppb2-two-kv-groups"):
        pools, ppb, k = make_pools(name, torch.device("cpu"))
        paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
        assert paged.slot_bytes % paged.page_bytes, name  # the last chunk is zero-padded


def test_bad_arguments_are_named():
    pools, ppb, k = make_pools("fp32-ppb1", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs k = 4"):
        PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=3)
    with pytest.raises(ValueError, match="is not 12 blocks"):
        PagedStates(pools, pages_per_block=ppb, num_blocks=12, k=k)
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
    with pytest.raises(ValueError, match="multiple of k = 4"):
        paged.save(torch.arange(6), torch.arange(6))
    with pytest.raises(ValueError, match="8,.*4,"):
        paged.restore(torch.arange(8), torch.arange(4))
    assert PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k + 1).k == 5  # room to spare is fine
    store, ppb, _ = make_pools("no-attention-layer", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs k = 1"):
        PagedStates(store, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=2)
    assert PagedStates.state_pages(640, 128) == 5 and PagedStates.state_pages(641, 128) == 6
    assert PagedStates.state_pages(640, 0) == 1
    with pytest.raises(ValueError, match="last_hidden"):
        state_pages(0, 128)


def test_runner_runs_a_paged_plan_finish_first(tmp_path):
    """`ModelRunner` executes a paged copy plan: STATE_FINISH saves a finished sequence's runtime slot 1 into pages
    before STATE_RESTORE writes another checkpoint into that same slot (reused by the step); KV ops copy blocks."""
    from hybridcache.cache.plan import CopyKind, PlanBuilder
    from hybridcache.engine.input_builder import device_copies
    from hybridcache.engine.runner import ModelRunner
    from hybridcache.models import load_model

    from .model_folders import write_tiny_model

    model = load_model(write_tiny_model(tmp_path, "qwen3_next"))
    kv, state = pool_bytes(model.state_specs(torch.float32, torch.float32), 16, model.slot_specs(torch.float32))
    k = state_pages(state, kv)
    runner = ModelRunner(model, num_blocks=6 * k, block_size=16, kernel_block_size=8, num_slots=3, state_pages=k,
                         dtype=torch.float32, state_dtype=torch.float32, device=torch.device("cpu"))
    pools = runner.pools
    gen = torch.Generator().manual_seed(0)
    for group in (*pools.kv_groups, *pools.state_groups):
        group.copy_(torch.randn(group.shape, generator=gen))
    old_slot_1, slot_2 = stream(pools, 1), stream(pools, 2)
    save = PlanBuilder(paged_states=True)
    for j in range(k):  # slot 2's state -> pages 0 .. k-1
        save.add(CopyKind.STATE_SAVE, 2 * k + j, j)
    runner.execute_copies(device_copies(save.build(), "cpu"))

    step = PlanBuilder(paged_states=True)
    for j in range(k):
        step.add(CopyKind.STATE_RESTORE, j, 1 * k + j)  # added first: the plan still runs the finish first
        step.add(CopyKind.STATE_FINISH, 1 * k + j, 2 * k + j)  # slot 1 -> pages k .. 2k-1
    step.add(CopyKind.KV_RESTORE, 4 * k, 4 * k + 1)
    plan = step.build()
    assert [op.kind for op in plan.ops] == [CopyKind.STATE_FINISH, CopyKind.KV_RESTORE, CopyKind.STATE_RESTORE]
    kv_before = [g[:, :, 4 * k * 2: 4 * k * 2 + 2].clone() for g in pools.kv_groups]
    runner.execute_copies(device_copies(plan, "cpu"))
    assert torch.equal(stream(pools, 1), slot_2)
    restore = PlanBuilder(paged_states=True)
    for j in range(k):
        restore.add(CopyKind.STATE_RESTORE, 2 * k + j, 0 * k + j)
    runner.execute_copies(device_copies(restore.build(), "cpu"))
    assert torch.equal(stream(pools, 0), old_slot_1)
    for old, group in zip(kv_before, pools.kv_groups, strict=True):
        assert torch.equal(group[:, :, (4 * k + 1) * 2: (4 * k + 2) * 2], old)


def test_the_runner_has_a_copy_handler_for_every_kind_and_refuses_an_unknown_one(tmp_path):
    """`COPY_HANDLERS` covers every `CopyKind`; an op of a kind it does not know (here a host-tier kind that a
    new tier would add) raises naming it, and leaves the pools untouched (it is never routed to another kind's
    copy, as a paged save)."""
    import enum

    from hybridcache.copy_kinds import CopyKind, Phase, Pool
    from hybridcache.engine.runner import COPY_HANDLERS, ModelRunner
    from hybridcache.forward_batch import DeviceCopyOp
    from hybridcache.models import load_model

    from .model_folders import write_tiny_model

    assert set(COPY_HANDLERS) == set(CopyKind)

    class HostKind(enum.Enum):
        HOST_SAVE = (Pool.STATE, Phase.AFTER_FORWARD, "host_save")

        @property
        def pool(self) -> Pool:
            return self.value[0]

        @property
        def phase(self) -> Phase:
            return self.value[1]

    model = load_model(write_tiny_model(tmp_path, "qwen3_next"))
    kv, state = pool_bytes(model.state_specs(torch.float32, torch.float32), 16, model.slot_specs(torch.float32))
    k = state_pages(state, kv)
    runner = ModelRunner(model, num_blocks=4 * k, block_size=16, kernel_block_size=8, num_slots=2, state_pages=k,
                         dtype=torch.float32, state_dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    groups = (*runner.pools.kv_groups, *runner.pools.state_groups)
    for group in groups:
        group.copy_(torch.randn(group.shape, generator=gen))
    before = [group.clone() for group in groups]
    ids = torch.arange(k, dtype=torch.int64)
    op = DeviceCopyOp(HostKind.HOST_SAVE, ids, ids + k)
    with pytest.raises(ValueError, match="no copy handler for <HostKind.HOST_SAVE"):
        runner.execute_copies((op,))
    assert all(torch.equal(old, group) for old, group in zip(before, groups, strict=True))
