"""The runtime half of tied weights (see `piper.ir.tied`): a SEND_T sends this
copy's reduced gradient of a tied parameter to the other copy's device, a
RECV_T adds the other copy's into this one, before either steps."""
from __future__ import annotations

import torch


def _grad(unit, tie: int) -> torch.Tensor:
    """The reduced gradient of the tie's bucket: whole (dp, ZeRO-1) or this member's shard (ZeRO-2/3)."""
    i = next(i for i, b in enumerate(unit.layout.buckets) if b.tied == tie)
    if unit.zero <= 1:
        unit.attach_grads()
        return unit.flat_grad[i]
    if unit.grad_shard[i] is None:          # nothing reached this copy (no microbatch used it)
        unit.grad_shard[i] = torch.zeros(unit.layout.buckets[i].shard_size, dtype=unit.layout.buckets[i].dtype,
                                         device=unit.device)
    return unit.grad_shard[i]


def _finish_reductions(executor, unit_id: int) -> None:
    """The unit's all-reduce, or every reduce-scatter of it, done: its gradient is final only then.
    (A plan's sends and receives carry no waits of their own.)"""
    executor._wait(f"{unit_id}ALL_REDUCE")       # issued earlier in the plan; nothing if none
    for key, (_, unit) in list(executor._reducing.items()):
        if unit == unit_id:
            del executor._reducing[key]
            executor._wait(key)


def send(executor, action) -> None:
    node = action.node
    _finish_reductions(executor, node.region)
    grad = _grad(executor.units[node.region], node.value)
    # A copy: this side adds the other's gradient into `grad` while the send may still read it.
    executor.sends[action.key] = torch.distributed.isend(grad.detach().clone(), action.peer, tag=action.tag)


def recv(executor, action) -> None:
    node = action.node
    _finish_reductions(executor, node.region)
    unit = executor.units[node.region]
    grad = _grad(unit, node.value)
    buf = torch.empty_like(grad)
    work = torch.distributed.irecv(buf, action.peer, tag=action.tag)
    executor.pending[action.key] = ([work], lambda: _grad(unit, node.value).add_(buf))
