"""Tensor parallelism inside the layers: which part of each weight a rank holds, and the two collectives.

A model built with `TensorParallel(rank, size)` holds on each rank a `1/size` share of every head, channel and
intermediate dimension; a layer's output projection then gives a partial sum that `all_reduce` completes, and
the lm_head gives a vocabulary slice that `all_gather` completes. `TensorParallel()` (size 1) is the plain
model: no collective runs and every module is exactly the unsharded one.

Head split with groups (attention q heads reading kv heads, DeltaNet value heads reading key heads): rank r
holds heads [r*H/N, (r+1)*H/N) and the groups they read. With fewer groups than ranks, a group is held by
several ranks (replicated)::

    8 q heads, 4 kv heads, N = 2: rank 0 q heads 0-3, kv heads 0-1;  rank 1 q heads 4-7, kv heads 2-3
    8 q heads, 1 kv head,  N = 2: rank 0 q heads 0-3, kv head 0;     rank 1 q heads 4-7, kv head 0

A `Shard` names the rows (dim 0) or columns (dim 1) of a full weight that a rank holds, as ranges concatenated
in order; the loader reads exactly those from the checkpoint. A split that need not divide evenly (the
vocabulary of the lm_head: `split_padded`) gives every rank ceil(total / N) rows, the last ranks' final rows
zero padding, so the gathered logits have N x ceil(total / N) columns and the padding ones are cut off::

    vocabulary 321, N = 2: rank 0 rows [0, 161); rank 1 rows [161, 321) + 1 zero row
                           gathered logits [.., 322] -> [.., :321]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """The part of a full parameter one rank holds: along `dim`, the index ranges [start, stop) of `ranges`,
    concatenated in order, then `padding` zero rows (columns). Example: a Qwen3.5 `in_proj_qkv` [q | k | v] of
    rank 1 of 2 is dim 0 with three ranges, one inside each of q, k and v."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    padding: int = 0

    @property
    def length(self) -> int:
        """The parameter's size along `dim` (padding included)."""
        return self.data_length + self.padding

    @property
    def data_length(self) -> int:
        """How much of it comes from the checkpoint."""
        return sum(stop - start for start, stop in self.ranges)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard of the full `tensor` (its padding zeros included)."""
        parts = [tensor.narrow(self.dim, start, stop - start) for start, stop in self.ranges]
        if self.padding:
            shape = list(tensor.shape)
            shape[self.dim] = self.padding
            parts.append(tensor.new_zeros(shape))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def rows(*ranges: tuple[int, int]) -> Shard:
    return Shard(0, _merged(ranges))


def columns(*ranges: tuple[int, int]) -> Shard:
    return Shard(1, _merged(ranges))


def _merged(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Adjacent ranges joined: ((0, 4), (4, 8), (10, 12)) -> ((0, 8), (10, 12))."""
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


@dataclass(frozen=True)
class HeadSplit:
    """A rank's heads [start, stop) and the groups [group_start, group_stop) they read (see the module
    docstring); `heads_per_group` is the global ratio."""

    start: int
    stop: int
    group_start: int
    group_stop: int
    heads_per_group: int

    @property
    def num_heads(self) -> int:
        return self.stop - self.start

    @property
    def num_groups(self) -> int:
        return self.group_stop - self.group_start


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (the whole `torch.distributed` world)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"tensor parallel rank {self.rank} of size {self.size} is not valid")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's range of `total` items divided evenly; ValueError naming `what` when they do not divide."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide {what} ({total})")
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def split_padded(self, total: int) -> Shard:
        """This rank's rows of `total` split into ceil(total / size) per rank, the last ranks' final rows zero
        padding (see the module docstring); a rank past the end holds padding only."""
        share = -(-total // self.size)
        start, stop = min(self.rank * share, total), min((self.rank + 1) * share, total)
        return Shard(0, ((start, stop),), padding=share - (stop - start))

    def split_heads(self, num_heads: int, num_groups: int, heads: str, groups: str) -> HeadSplit:
        """This rank's heads and the groups they read; groups are replicated when there are fewer than ranks
        (the rank count must then be a multiple of the group count). `heads` and `groups` name the two counts
        in errors (e.g. "attention heads", "KV heads")."""
        start, stop = self.split(num_heads, heads)
        if num_groups % self.size and self.size % num_groups:
            raise ValueError(f"tensor_parallel_size {self.size} and {num_groups} {groups}: one must divide the other")
        ratio = num_heads // num_groups
        return HeadSplit(start, stop, start // ratio, (stop - 1) // ratio + 1, ratio)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place; `x` itself when size is 1)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` concatenated along the last dim, rank order (`x` itself when size is 1)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


UNSHARDED = TensorParallel()  # the default of every module: the whole model, no collective
