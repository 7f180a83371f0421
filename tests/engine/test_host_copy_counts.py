"""What a host-tier copy costs in operations (issue 30: where a host hit's time goes). `HostPool.save` and `load`
issue a fixed number of device operations per page group and one copy across PCIe per run of consecutive host
ids, whatever the number of blocks (no loop over blocks or layers), and never read a tensor on the host (no
synchronisation); in the engine, the cache hands each HOST_SAVE and HOST_LOAD its host ids in ascending order,
so a promoted chain whose nodes and checkpoint were demoted at different times is as few copies as its host ids
allow."""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hybridcache.copy_kinds import Pool
from hybridcache.engine.host_pool import HostPool, _runs
from hybridcache.engine.paged_state import PagedStates

from .test_cache_equivalence import run_workload
from .test_host_tier_engine import host_engine, model_dir  # noqa: F401 (the module's model fixture)
from .test_paged_state import NUM_BLOCKS, make_pools

CPU = torch.device("cpu")
# what reads a tensor's values on the host: on CUDA each waits for the device (a synchronisation)
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class AtenCount(TorchDispatchMode):
    """Counts the aten operations run inside it that are not views, by name (`copy_`, `index_select`, ...): on CUDA
    each is a kernel launch, an allocation or a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class HostReadLog(TorchFunctionMode):
    """Records every call inside it that reads a tensor's values on the host (`HOST_READS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def counted(call) -> tuple[Counter, list[str]]:
    with HostReadLog() as reads, AtenCount() as count:
        call()
    return count.ops, reads.reads


def pool(layout: str = "bf16-ppb2-two-kv-groups", num_host_blocks: int = 64) -> tuple[PagedStates, HostPool]:
    pools, ppb, k = make_pools(layout, CPU)
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
    return paged, HostPool(paged, num_host_blocks, pin=False)


def test_a_copy_costs_the_same_operations_for_2_or_24_blocks_and_one_copy_per_run():
    _paged, host = pool()
    device = torch.arange(NUM_BLOCKS, dtype=torch.int64)

    def save(host_ids):
        return counted(lambda: host.save(device[: len(host_ids)], host_ids))

    def load(host_ids):
        return counted(lambda: host.load(host_ids, device[: len(host_ids)]))

    for copy in (save, load):
        few, reads_few = copy([0, 1])
        many, reads_many = copy(list(range(10, 34)))
        assert few == many, copy  # one run: the operations do not grow with the blocks
        assert not reads_few and not reads_many
        scattered, _ = copy(list(range(40, 64, 2)))  # 12 blocks, 12 runs
        extra = scattered - many
        assert extra == Counter({"copy_": 11}) and not many - scattered, (copy, extra)


def test_host_copies_in_the_engine_read_nothing_on_the_host_and_come_in_host_id_order(model_dir):  # noqa: F811
    engine = host_engine(model_dir)
    runner = engine.runner
    paged = runner.paged_states
    groups = len(paged._pages) + len(paged._slots)  # page groups, and the state groups a HOST_FINISH reads
    seen: list[tuple] = []
    inner = runner._copy

    def spied(op):
        if op.kind.pool is not Pool.HOST:
            return inner(op)
        ops, reads = counted(lambda: inner(op))
        seen.append((op.kind, op.host_ids, ops, reads))

    runner._copy = spied
    run_workload(engine, seed=1, reply_lens=(20, 40))
    kinds = Counter(kind.name for kind, *_ in seen)
    assert kinds["HOST_SAVE"] > 0 and kinds["HOST_LOAD"] > 0, kinds
    blocks = 0
    for kind, host_ids, ops, reads in seen:
        assert not reads, (kind, reads)
        assert list(host_ids) == sorted(host_ids), (kind, host_ids)
        runs = len(list(_runs(host_ids)))
        # the gather or scatter: a few operations per group (index_select and a copy, or index_copy_), an
        # allocation or two, then one copy across per run; nothing per block
        assert sum(ops.values()) <= 2 * groups + 4 + runs, (kind, len(host_ids), runs, ops)
        blocks += len(host_ids)
    assert blocks > len(seen)  # ops of several blocks were counted, not only single-block ones
