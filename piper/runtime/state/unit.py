"""One owner region's parameters on a worker: flat buffers, ZeRO shards, optimizer (`Unit`).

The gradient half (attach, reduce, step) is `unit_gradients.UnitGradients`.
"""
from __future__ import annotations

import torch

from ..communication import collectives
from . import optimizers
from ...compiler.flat_layout import UnitLayout
from .unit_gradients import UnitGradients


class Unit(UnitGradients):
    """One owner region's parameters on this rank: flat buffers, shards, optimizer.

    Each parameter is a leaf tensor viewing the flat buffer `full`, and its
    `.grad` views the flat gradient buffer, so autograd accumulates straight
    into the buffer the collectives reduce (DDP's gradient-as-bucket-view).
    A view of one flat leaf would instead make every parameter's backward
    write a full-size gradient.
    """

    def __init__(self, layout: UnitLayout, rank: int, zero: int, init: list[torch.Tensor], optimizer, device):
        self.layout = layout
        self.zero = zero
        self.index = layout.group.index(rank)
        self.device = device
        self.full: list[torch.Tensor] = []        # flat parameters (storage freed between uses in ZeRO-3)
        self.shard: list[torch.Tensor] = []       # what the optimizer updates
        self.flat_grad: list[torch.Tensor | None] = []
        self.grad_shard: list[torch.Tensor | None] = []
        self.in_flight: list[list[torch.Tensor]] = []   # ZeRO-2/3 gradient buffers being reduce-scattered
        self.leaves: dict[str, torch.Tensor] = {}
        self._by_bucket: list[list[tuple[torch.Tensor, object]]] = []
        for i, (bucket, data) in enumerate(zip(layout.buckets, init)):
            full, shard, leaves = _buffers(bucket, data.to(device), self.index, zero, device)
            for leaf, _ in leaves:
                leaf.register_hook(self._arrival_hook(i))
            self.full.append(full)
            self.shard.append(shard)
            self.flat_grad.append(None)
            self.grad_shard.append(None)
            self.leaves.update((e.name, leaf) for leaf, e in leaves)
            self._by_bucket.append(leaves)
        # per bucket, the parameters this member updates whole (`Bucket.whole`): views of its shard,
        # or under tp, for a divided parameter, a whole copy the update gathers its pieces into
        # (`pieces`: the views of this device's pieces, None where nothing is divided)
        self.whole: list[list[tuple[torch.Tensor, object]]] = []
        self.pieces: list[list[torch.Tensor] | None] = []
        for b, shard in zip(layout.buckets, self.shard):
            views = _whole_views(b, shard, self.index, zero) if b.whole else []
            divided = b.whole and b.tensor == "divided" and layout.tensor_size > 1
            self.pieces.append([view for view, _ in views] if divided else None)
            self.whole.append([(torch.zeros(layout.global_shape(e), dtype=b.dtype, device=device).requires_grad_(), e)
                               for _, e in views] if divided else views)
        stepped, groups = [], []
        for bucket, shard, whole in zip(layout.buckets, self.shard, self.whole):
            tensors = [view for view, _ in whole] if bucket.whole else [shard]
            stepped += tensors
            groups += [bucket.param_group] * len(tensors)
        self.optimizer = optimizers.build(optimizer, stepped, groups)
        if zero == 3:
            self.release()          # views made; the parameters come back on each gather
        self.count()

    def _tensors(self) -> dict[str, list]:
        """What the unit holds, by kind (None where a buffer is not allocated)."""
        return {"params": [*self.full, *self.shard],
                "grads": [*self.flat_grad, *self.grad_shard, *(g for sent in self.in_flight for g in sent)],
                "optimizer": [v for state in self.optimizer.state.values() for v in state.values()
                              if torch.is_tensor(v) and v.dim() > 0]     # not Adam's step counts
                + [whole for ws, ps in zip(self.whole, self.pieces) if ps is not None for whole, _ in ws]}

    def count(self) -> None:
        """Recount `held`, the bytes of everything in `_tensors` alive now. Called where buffers
        are allocated or freed, not per action."""
        seen: set[int] = set()
        self.held = sum(_storage_bytes(ts, seen) for ts in self._tensors().values())

    # -- parameters ---------------------------------------------------------------------
    def views(self) -> dict[str, torch.Tensor]:
        return self.leaves

    def weights(self) -> list[torch.Tensor]:
        return list(self.leaves.values())

    def refresh(self) -> None:
        """Before a step: bring any compute copy of the parameters up to date (`precision.py`)."""

    def gather(self, group):
        """ZeRO-3: refill the full buffers from every member's shard (async)."""
        return self._gather_into(self.full, (shard.detach() for shard in self.shard), group)

    def _gather_into(self, buffers, shards, group):
        """All-gather each bucket's `shards` into `buffers`, their storage brought back first."""
        works = []
        for bucket, full, shard in zip(self.layout.buckets, buffers, shards):
            storage = full.untyped_storage()
            if storage.size() == 0:
                storage.resize_(bucket.padded * full.element_size())
            # `.data` has its own version counter: refilling the storage must not look like
            # an in-place change to the parameters autograd saved in forward.
            works.append(collectives.all_gather_into(full.data, shard, group))
        self.count()
        return works

    def release(self) -> None:
        """ZeRO-3: free the gathered parameters (saved activations keep the storage object)."""
        for full in self.full:
            full.untyped_storage().resize_(0)
        self.count()

    def gather_updated(self, group):
        """ZeRO-1/2: share every member's updated slice."""
        works = []
        for full, shard in zip(self.full, self.shard):
            works.append(collectives.all_gather_into(full.data, shard.detach(), group))
        return works

    # -- inspection -----------------------------------------------------------------------
    def shards(self) -> list[torch.Tensor]:
        """This member's slice of each bucket, on CPU."""
        out = []
        for bucket, full, shard in zip(self.layout.buckets, self.full, self.shard):
            lo, hi = bucket.bounds(self.index)
            out.append((shard.detach() if self.zero == 3 else full[lo:hi]).cpu().clone())
        return out

    def memory(self) -> dict[str, int]:
        """Bytes held between steps: parameters, gradients, optimizer state."""
        seen: set[int] = set()
        return {kind: _storage_bytes(ts, seen) for kind, ts in self._tensors().items()}


def _buffers(bucket, data: torch.Tensor, index: int, zero: int, device):
    """One bucket's flat parameters, the shard the optimizer updates, and a leaf per parameter
    viewing the flat buffer. Below ZeRO-3 the shard shares the flat buffer's storage."""
    if zero == 3:
        shard = torch.nn.Parameter(data.clone())
        full = torch.zeros(bucket.padded, dtype=bucket.dtype, device=device)
    else:
        lo, hi = bucket.bounds(index)
        full = data.clone()
        shard = torch.nn.Parameter(full if zero == 0 else full[lo:hi])
    leaves = [(full[e.offset:e.offset + e.numel].view(e.shape).requires_grad_(), e) for e in bucket.entries]
    return full, shard, leaves


def _whole_views(bucket, shard: torch.Tensor, index: int, zero: int) -> list[tuple[torch.Tensor, object]]:
    """(a leaf viewing the parameter in `shard`, in its own shape; its entry) for each parameter of
    a `whole` bucket this member updates: the optimizer steps these, so it sees every parameter
    whole, and its in-place update lands in the shard the all-gather shares."""
    base = 0 if zero == 0 else bucket.bounds(index)[0]
    flat = shard.detach()
    return [(flat[e.offset - base:e.offset - base + e.numel].view(e.shape).requires_grad_(), e)
            for e in bucket.owned(index, zero)]


def _storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the allocated storages behind `tensors` (None skipped) not already in `seen`."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.size() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
