"""Tensor parallelism on a worker: the groups `piper.tensor_ops`' collectives run over, and the
collective groups of data parallelism split by tp index.

Under `shard columns/rows/vocab ... over tp`, the devices that differ only along tp form one
tensor-parallel group; the region graphs' TP ops (all-reduce, all-gather and reduce-scatter
along the sequence, the vocab loss's max) ask `piper.tensor_context.current()` for it. One
group per lane, as for the expert groups: the items of an overlapped slot run in two threads.

A unit is shared by the devices of one tp index (they hold the same shards): a plan's
collective over a region's devices runs over those of this device's tp index only
(`split_groups`), and the replicated parameters whose gradients are partial along tp
(`Bucket.tensor == "summed"`) are all-reduced over the tensor group first (`sum_gradients`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import tensor_context
from . import collectives


@dataclass(frozen=True)
class TensorSpec:
    """What a worker needs for tensor parallelism: every rank's tp index, every tensor group of
    the mesh (ranks in tp order; every rank creates all, in this order) and how many lanes."""

    index_of: dict                       # rank -> its index along tp
    groups: tuple[tuple[int, ...], ...]
    lanes: int = 1


class TensorGroup:
    """One lane's process group over the devices that hold one layer's shards."""

    def __init__(self, group, ranks: tuple[int, ...], rank: int):
        self.group = group
        self.ranks = ranks
        self.size = len(ranks)
        self.index = ranks.index(rank)
        self.gloo = dist.get_backend(group) == "gloo"

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        start = time.perf_counter()
        self.all_reduce_async(t, op).wait()
        tensor_context.add_seconds(time.perf_counter() - start)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        start = time.perf_counter()
        work, result = self.all_gather_async(x, dim)
        work.wait()
        tensor_context.add_seconds(time.perf_counter() - start)
        return result()

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum `x` over the group and keep this device's chunk along `dim`."""
        start = time.perf_counter()
        work, result = self.reduce_scatter_async(x, dim)
        work.wait()
        tensor_context.add_seconds(time.perf_counter() - start)
        return result()

    # Issued without waiting (the exchanges between a cut region's pieces): (work, the result once done).

    def all_reduce_async(self, t: torch.Tensor, op: str = "sum"):
        """Sum (or max) `t` over the group in place; the work handle."""
        reduce = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return dist.all_reduce(t, op=reduce, group=self.group, async_op=True)

    def all_gather_async(self, x: torch.Tensor, dim: int):
        x = x.contiguous()
        if self.gloo:
            parts = [x if i == self.index else torch.empty_like(x) for i in range(self.size)]
            work = collectives.broadcast_each(parts, self.group)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            work = dist.all_gather(parts, x, group=self.group, async_op=True)
        return work, lambda: torch.cat(parts, dim)

    def reduce_scatter_async(self, x: torch.Tensor, dim: int):
        total = x.contiguous().clone()
        # Gloo has no reduce-scatter of chunks along a dim: an all-reduce, keeping this device's chunk.
        work = dist.all_reduce(total, group=self.group, async_op=True)
        return work, lambda: total.chunk(self.size, dim)[self.index].contiguous()


def make_groups(spec: TensorSpec | None, rank: int) -> list[TensorGroup]:
    """Every tensor group on every rank, in order; this rank's, one per lane (installed as the default)."""
    if spec is None:
        tensor_context.set_default(None)
        return []
    mine: list[TensorGroup] = []
    for ranks in spec.groups:
        made = [dist.new_group(list(ranks)) for _ in range(spec.lanes)]
        if rank in ranks:
            mine = [TensorGroup(g, ranks, rank) for g in made]
    tensor_context.set_default(mine[0] if mine else None)
    return mine


def split_groups(groups: list[tuple[int, ...]], spec: TensorSpec | None) -> list[tuple[int, ...]]:
    """The plan's collective groups as they run: under tp, each split by tp index."""
    if spec is None:
        return list(groups)
    out = []
    for ranks in groups:
        indexes = sorted({spec.index_of[r] for r in ranks})
        out += [tuple(r for r in ranks if spec.index_of[r] == i) for i in indexes]
    return out


def mine(groups: list[tuple[int, ...]], spec: TensorSpec | None, rank: int, made: dict) -> dict:
    """Plan group -> the process group this rank's collectives over it use (its tp index's part)."""
    if spec is None:
        return made
    out = {}
    for ranks in groups:
        part = tuple(r for r in ranks if spec.index_of[r] == spec.index_of[rank])
        if part in made:
            out[ranks] = made[part]
    return out


def sum_gradients(unit, groups: list[TensorGroup]) -> None:
    """All-reduce over tp the flat gradients of the unit's "summed" buckets (partial along tp)."""
    if not groups:
        return
    for i, bucket in enumerate(unit.layout.buckets):
        grad = unit.flat_grad[i]
        if bucket.tensor == "summed" and grad is not None:
            groups[0].all_reduce(grad)
