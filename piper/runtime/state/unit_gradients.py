"""The gradient half of a `Unit`: flat gradient buffers, their reduction over the group, the update."""
from __future__ import annotations

import torch

from ..communication import collectives
from ..communication.tensor_groups import sum_gradients


class UnitGradients:
    """Mixed into `unit.Unit`; reads its layout, zero level, flat buffers and optimizer."""

    def attach_grads(self) -> None:
        """Point every parameter's `.grad` into a zeroed flat buffer, if it has none.

        Replicated gradients keep theirs across steps (as DDP); ZeRO-2/3 get a
        new one before each backward that follows a reduce-scatter."""
        for i, (bucket, leaves) in enumerate(zip(self.layout.buckets, self._by_bucket)):
            if self.flat_grad[i] is None:
                self.flat_grad[i] = torch.zeros(bucket.padded, dtype=bucket.dtype, device=self.device)
                for leaf, e in leaves:
                    leaf.grad = self.flat_grad[i][e.offset:e.offset + e.numel].view(e.shape)
                self.count()

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
        sum_gradients(self, getattr(self, "tensor_groups", ()))     # partial along tp: summed there first
        if self.zero <= 1:
            return [collectives.all_reduce(flat, group) for flat in self.flat_grad], None
        self.attach_grads()        # every member issues the collective, even with nothing new
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
            if self.zero == 0:
                shard.grad = self.flat_grad[i]
            elif self.zero == 1:
                lo, hi = bucket.bounds(self.index)
                shard.grad = self.flat_grad[i][lo:hi]
            else:
                shard.grad = self.grad_shard[i]
        self.optimizer.step()
        for i, shard in enumerate(self.shard):
            shard.grad = None
            if self.flat_grad[i] is not None:
                self.flat_grad[i].zero_()       # replicated gradients stay allocated, as in DDP
            if self.grad_shard[i] is not None:
                self.grad_shard[i].zero_()
        self.count()              # the optimizer's state appears at its first step
