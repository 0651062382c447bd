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
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; older GPU machines have only the first.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, shard, group=group, async_op=True)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group):
    """This member's chunk of the sum of `full` over `group` into `out` (async). On Gloo `full`
    is summed in place and then holds the whole sum: Gloo's reduce-scatter first clones its
    input (a transient the size of a unit's gradient buffer, in flight beside the next block's
    backward) and costs 1.1-1.5x an all-reduce of the same buffer on our machines (benchmarks,
    suite 16 (b)); the caller lets go of `full` once it is done."""
    if dist.get_backend(group) == "gloo":
        index = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
        chunk = full.narrow(0, index * out.numel(), out.numel())
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
