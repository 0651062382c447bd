"""torch.distributed set-up and the few collectives the runtime issues,
with fallbacks for the names older torch releases use."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def init(rank: int, world_size: int, store, backend: str, timeout_s: float) -> None:
    # Gloo's default timeout is 30 minutes: a lone rank would hang that long.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def new_groups(groups: list[tuple[int, ...]]) -> dict[tuple[int, ...], object]:
    """Create every group on every rank in the same order (torch requires it)."""
    out = {}
    for ranks in groups:
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            out[ranks] = group
    return out


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group):
    """Every member's `shard` into its chunk of `out`, in member order (async). `shard` may be this
    member's own chunk of `out` (ZeRO-1/2's updated slice)."""
    if dist.get_backend(group) == "gloo":
        chunks = list(out.chunk(dist.get_world_size(group)))
        mine = chunks[_member(group)]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        return broadcast_each(chunks, group)
    if shard.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        shard = shard.clone()
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; older GPU machines have only the first.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, shard, group=group, async_op=True)


def broadcast_each(parts: list[torch.Tensor], group):
    """Gloo's all-gather, in place: `parts[i]` holds member i's tensor on member i and receives it
    on the others, one broadcast per member (async; one work for all). Gloo's own all-gather
    receives into a temporary of the whole output's size and copies out of it (at ZeRO-3 a
    gathered unit beside the backward's activations), and took 1.2-1.9x as long as the
    broadcasts for 2-8 members and 1.5-6 MiB gathered on our machines, and for 4 and 8 members
    at 16 KiB (0.9x for two at 16 KiB, where a call's latency is all); each part must be
    contiguous."""
    world = group if group is not None else dist.group.WORLD
    return _Works([dist.broadcast(part, src=dist.get_global_rank(world, i), group=group, async_op=True)
                   for i, part in enumerate(parts)])


def _member(group) -> int:
    return dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group):
    """This member's chunk of the sum of `full` over `group` into `out` (async). On Gloo `full`
    is summed in place and then holds the whole sum: Gloo's reduce-scatter first clones its
    input (a transient the size of a unit's gradient buffer, in flight beside the next block's
    backward) and costs 1.1-1.5x an all-reduce of the same buffer on our machines (benchmarks,
    suite 16 (b)); the caller lets go of `full` once it is done."""
    if dist.get_backend(group) == "gloo":
        chunk = full.narrow(0, _member(group) * out.numel(), out.numel())
        return _Then(all_reduce(full, group), lambda: out.copy_(chunk))
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)


class _Then:
    """A collective's work and what to run once, when it is first waited on."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return done


def all_reduce(t: torch.Tensor, group):
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def backend_for(device: str) -> str:
    """NCCL when every device is a CUDA GPU and NCCL exists, Gloo otherwise."""
    if device == "cuda" and torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


class _Works:
    """Several collectives' works waited on as one."""

    def __init__(self, works):
        self.works = works

    def wait(self, *args, **kwargs):
        return all([w.wait(*args, **kwargs) for w in self.works])
