"""Mixed precision on a worker (`piper.compile(..., precision="bf16")`).

A unit keeps its float32 parameters (the master weights, which the optimizer
steps), its float32 gradient buffers and its optimizer state exactly as in
full precision, and adds a 16-bit copy of its flat parameters that the
regions compute with. Each parameter reaches a region as `_Cast(master,
low)`: the 16-bit view in forward, whose gradient autograd hands back to the
float32 master leaf in float32. So gradients accumulate over microbatches and
are reduced (all-reduce, reduce-scatter) in float32, FSDP2's
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`.

Under ZeRO-3 the float32 full buffer is never allocated: each gather casts
the member's float32 shard to 16 bits and all-gathers that, so a gathered unit
costs half the bytes and half the traffic. Replicated and ZeRO-1/2 units
refresh their 16-bit copy from the float32 parameters at the start of each
step (they hold both between steps, as autocast's weight cache does).
"""
from __future__ import annotations

import torch

from . import comm
from .executor import Unit


class _Cast(torch.autograd.Function):
    """Forward: the 16-bit parameter. Backward: its gradient, in the master's dtype, to the master."""

    @staticmethod
    def forward(ctx, master, low):
        ctx.dtype = master.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class LowPrecisionUnit(Unit):
    """A `Unit` whose regions compute with a `dtype` copy of its parameters."""

    def __init__(self, layout, rank, zero, init, optimizer, device, *, dtype: torch.dtype):
        self.dtype = dtype
        self.low: list[torch.Tensor] = []
        self.low_views: dict[str, torch.Tensor] = {}
        super().__init__(layout, rank, zero, init, optimizer, device)
        for bucket in layout.buckets:
            low = torch.zeros(bucket.padded, dtype=dtype, device=device)
            self.low.append(low)
            for e in bucket.entries:
                self.low_views[e.name] = low[e.offset:e.offset + e.numel].view(e.shape)
        if zero == 3:
            for low in self.low:
                low.untyped_storage().resize_(0)
        else:
            self.refresh()
        self.count()

    def _tensors(self) -> dict[str, list]:
        found = super()._tensors()
        found["params"] = found["params"] + list(self.low)
        return found

    def storages(self) -> list[int]:
        """The `_cdata` of the 16-bit buffers (parameters, not activations, when autograd saves them)."""
        return [low.untyped_storage()._cdata for low in self.low]

    def refresh(self) -> None:
        """Replicated and ZeRO-1/2 units: the 16-bit copy of the current float32 parameters."""
        if self.zero < 3:
            for low, full in zip(self.low, self.full):
                low.data.copy_(full)

    def views(self) -> dict[str, torch.Tensor]:
        if torch.is_grad_enabled():
            return {name: _Cast.apply(leaf, self.low_views[name]) for name, leaf in self.leaves.items()}
        return self.low_views

    def gather(self, group):
        """ZeRO-3: all-gather the 16-bit cast of every member's float32 shard."""
        works = []
        for bucket, low, shard in zip(self.layout.buckets, self.low, self.shard):
            storage = low.untyped_storage()
            if storage.size() == 0:
                storage.resize_(bucket.padded * low.element_size())
            works.append(comm.all_gather_into(low.data, shard.detach().to(self.dtype), group))
        self.count()
        return works

    def release(self) -> None:
        for low in getattr(self, "low", ()):       # Unit.__init__ releases before `low` exists
            low.untyped_storage().resize_(0)
        if self.zero == 3 and self.full and self.full[0].untyped_storage().size():
            super().release()                     # the float32 buffer Unit.__init__ made, once
        self.count()


def make_unit(dtype: torch.dtype | None):
    """The unit class for a worker: plain `Unit` in full precision."""
    if dtype is None:
        return Unit
    return lambda *args: LowPrecisionUnit(*args, dtype=dtype)
