"""The gradient half of a `Unit`: flat gradient buffers, their reduction over the group, the update."""
from __future__ import annotations

import torch

from ..communication import collectives
from ..communication.tensor_groups import sum_gradients


class UnitGradients:
    """Mixed into `unit.Unit`; reads its layout, zero level, flat buffers and optimizer."""

    def attach_grads(self) -> None:
        """Point every parameter's `.grad` into a zeroed flat buffer, where its bucket has none:
        before a collective reads the buffers (every member issues it, even with nothing new)."""
        for i in range(len(self.flat_grad)):
            if self.flat_grad[i] is None:
                self._attach(i)

    def _arrival_hook(self, i: int):
        """A hook on each leaf of bucket `i`, run by autograd as a gradient for it arrives and
        before it is accumulated: the bucket's buffer is attached then, so it exists only from
        the first gradient written into it in a step, as torch allocates each `.grad` lazily,
        and the activations the backward has freed so far make room for it. ZeRO-0/1 let go
        of it at the update (`release_grads`); ZeRO-2/3 after each reduce-scatter."""
        def arrived(grad):
            if self.flat_grad[i] is None:
                self._attach(i)
        return arrived

    def _attach(self, i: int) -> None:
        bucket = self.layout.buckets[i]
        flat = self.flat_grad[i] = torch.zeros(bucket.padded, dtype=bucket.dtype, device=self.device)
        for leaf, e in self._by_bucket[i]:
            leaf.grad = flat[e.offset:e.offset + e.numel].view(e.shape)
        # a new storage: counted without a recount of every buffer (a unit may hold a bucket per
        # parameter, and each attaches on its own)
        self.held += flat.untyped_storage().nbytes()

    def reduce(self, group):
        """Reduce the gradients over the group: (works, what to run once they are done).

        ZeRO-2/3 reduce-scatter the current buffers and let go of them at once,
        so the next backward writes into a new buffer while this one is in
        flight (`in_flight` until done). The shard of the sum lands in
        `grad_shard` itself: this member first adds what earlier reduce-scatters
        gave it into its own slice of the buffer, which only it contributes to
        its shard, and so needs no shard-sized output beside `grad_shard`. With
        an earlier reduce-scatter of this unit still in flight (the runtime
        finishes one before the next backward into the unit, so only a plan
        that reduces twice in a row has that), the shard is not final yet: the
        result goes to a new tensor, added once both are done.
        """
        self.attach_grads()        # every member issues the collective, even with nothing new
        sum_gradients(self, getattr(self, "tensor_groups", ()))     # partial along tp: summed there first
        if self.zero <= 1:
            return [collectives.all_reduce(flat, group) for flat in self.flat_grad], None
        direct = not self.in_flight
        outs = []
        for i, (bucket, flat) in enumerate(zip(self.layout.buckets, self.flat_grad)):
            if direct and self.grad_shard[i] is not None:
                lo, hi = bucket.bounds(self.index)
                flat[lo:hi].add_(self.grad_shard[i])
                outs.append(self.grad_shard[i])
            else:
                outs.append(torch.empty(bucket.shard_size, dtype=bucket.dtype, device=self.device))
        works = [collectives.reduce_scatter_into(out, flat, group) for out, flat in zip(outs, self.flat_grad)]
        sent = [*self.flat_grad, *outs]     # in flight: the buffers read and the shards being filled
        self.in_flight.append(sent)
        self.flat_grad = [None] * len(self.flat_grad)
        for leaves in self._by_bucket:
            for leaf, _ in leaves:
                leaf.grad = None
        self.count()

        def done():
            self.in_flight = [x for x in self.in_flight if x is not sent]
            for i, out in enumerate(outs):
                if self.grad_shard[i] is None:
                    self.grad_shard[i] = out
                elif out is not self.grad_shard[i]:
                    self.grad_shard[i].add_(out)
            self.count()
        return works, done

    def step(self) -> None:
        for i, (bucket, shard) in enumerate(zip(self.layout.buckets, self.shard)):
            grad = self._shard_grad(i)
            if not bucket.whole:
                shard.grad = grad
                continue
            base = 0 if self.zero == 0 else bucket.bounds(self.index)[0]
            for k, (param, e) in enumerate(self.whole[i]):       # each parameter whole, in its own shape
                g = None if grad is None else grad[e.offset - base:e.offset - base + e.numel].view(e.shape)
                if self.pieces[i] is None:
                    param.grad = g
                else:
                    self._gather_divided(param, self.pieces[i][k], e, g)
        self.optimizer.step()
        for i, pieces in enumerate(self.pieces):
            for piece, (whole, e) in zip(pieces or (), self.whole[i]):      # divide the update again
                piece.detach().copy_(whole.detach().chunk(self.layout.tensor_size, e.tp_dim)[self.layout.tensor_index])
        for shard, whole in zip(self.shard, self.whole):
            shard.grad = None
            for param, _ in whole:
                param.grad = None
        self.release_grads()      # and counts: the optimizer's state appears at its first step

    def _gather_divided(self, whole: torch.Tensor, piece: torch.Tensor, e, grad) -> None:
        """Under tp, a divided parameter this member updates: its pieces and its gradient's
        gathered whole over the tp group into `whole` (the tp peers own the same parameters and
        take them in the same order), so the optimizer sees the matrix one device would; `step`
        keeps this device's piece of the result. The gathers run inside the update action."""
        group = self.tensor_groups[0]
        assert group.index == self.layout.tensor_index and group.size == self.layout.tensor_size
        whole.detach().copy_(group.all_gather(piece.detach(), e.tp_dim))
        whole.grad = None if grad is None else group.all_gather(grad.contiguous(), e.tp_dim)

    def _shard_grad(self, i: int):
        """The gradient of bucket `i`'s shard (the whole bucket under plain dp), None without one."""
        if self.zero >= 2:
            return self.grad_shard[i]
        if self.flat_grad[i] is None:     # no backward reached the unit: no update
            return None
        if self.zero == 0:
            return self.flat_grad[i]
        lo, hi = self.layout.buckets[i].bounds(self.index)
        return self.flat_grad[i][lo:hi]

    def release_grads(self) -> None:
        """After an update (or a skipped one): let go of the flat gradient buffers, which the next
        backward attaches anew (torch's `zero_grad(set_to_none=True)`), and of ZeRO-2/3's shards of
        the sums, which the next step's first reduce-scatter of each bucket makes anew (as FSDP2's
        sharded gradients are set to None): held between steps, they sat through the next step's
        forward and every backward before the unit's own."""
        self.flat_grad = [None] * len(self.flat_grad)
        self.grad_shard = [None] * len(self.grad_shard)
        for leaves in self._by_bucket:
            for leaf, _ in leaves:
                leaf.grad = None
        self.count()
