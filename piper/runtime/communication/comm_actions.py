"""The communication actions: point-to-point SEND/RECV and the collectives over a unit's group.

Mixed into `Executor`. Each is issued asynchronously: its work handles wait in
`pending` until an action that names it in its `waits` (or the step's end)
calls `_wait`.
"""
from __future__ import annotations

import time

import torch

from . import tied_weights


class CommActions:
    """`_send`, `_recv`, `_all_reduce`, `_reduce_scatter`, `_all_gather`, `_all_to_all`, and `_wait` for
    any of them; `_settle_reductions` keeps ZeRO-2/3's reduce-scatters in step (the units attach
    their gradient buffers as the gradients arrive: `Unit._arrival_hook`). Needs the units, groups
    and step state (`values`, `grad_out`, `_accumulate`)."""

    def _value_of(self, node) -> int:
        producer = node.region if (node.op == "SEND") == (node.phase == "F") else node.peer
        return self.by_value[(producer, node.value)]

    def _send(self, action) -> None:
        node = action.node
        if node.phase == "T":                  # a tied weight's gradient (runtime/communication/tied_weights.py)
            return tied_weights.send(self, action)
        v = self._value_of(node)
        if node.phase == "F":
            tensor = self.values[(v, node.mb)].detach()
        else:
            tensor = self.grad_out.pop((v, node.mb, node.region))
        self.sends[action.key] = torch.distributed.isend(tensor.contiguous(), action.peer, tag=action.tag)

    def _recv(self, action) -> None:
        node = action.node
        if node.phase == "T":
            return tied_weights.recv(self, action)
        v = self._value_of(node)
        _, _, shape, dtype, _ = self.spec.values[v]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = torch.distributed.irecv(buf, action.peer, tag=action.tag)
        key, delivered = (v, node.mb), self.spec.received.get(action.key, ())

        def then():
            if node.phase == "F":
                self.values[key] = buf
            else:
                self._accumulate(key, buf)
            self._let_go_sends(delivered)
        self.pending[action.key] = ([work], then)

    def _let_go_sends(self, keys) -> None:
        """Wait for the sends an arrival proves delivered (`compiler/received.py`): at once, as
        they are done, and their tensors go; else each would hold its tensor to the step's end."""
        for key in keys:
            work = self.sends.pop(key, None)
            if work is not None:
                work.wait()

    def _all_reduce(self, action) -> None:
        unit = self.units[action.node.region]
        self.pending[action.key] = unit.reduce(self.groups[action.group])

    def _reduce_scatter(self, action) -> None:
        self.pending[action.key] = self.units[action.node.region].reduce(self.groups[action.group])
        self._reducing[action.key] = (0, action.node.region)

    def _settle_reductions(self, reads: frozenset) -> None:
        """Before a compute that reads the units `reads`: finish the reduce-scatters issued
        before the previous compute, and those of the units it reads.

        Each overlaps at most one compute, and never one that uses its unit: with a region per
        block the next block's backward hides it; with a region per stage the stage's next
        forward would hold the gradients in flight next to its gathered parameters and new
        activations, so those are finished first. Finishing one frees its gradient buffer now,
        not at the update.
        """
        for key, (computes, unit) in list(self._reducing.items()):
            if computes >= 1 or unit in reads:
                del self._reducing[key]
                self._wait(key)
            else:
                self._reducing[key] = (computes + 1, unit)

    def _all_to_all(self, action) -> None:
        """An exchange between the pieces of a cut pass (`moe.pieces`); else a marker: the compute
        before it issued its all-to-alls from its graph (`piper.compiler.cut_passes.add_exchanges`)."""
        if action.node.value is not None:
            self.pieces.exchange(self, action)

    def _tp(self, action) -> None:
        """A TP collective between the pieces of a cut pass (`moe.tensor_exchanges`); else a marker:
        the compute before it issued its tensor-parallel collectives from its graph
        (`piper.compiler.tensor_exchanges`), whose seconds are its timing (`step_loop`)."""
        if action.node.value is not None:
            return self.pieces.exchange(self, action)
        self.timings[action.key] = self._tp_seconds.pop(action.key, 0.0)

    def _all_gather(self, action) -> None:
        if not action.node.phase and self.clip is not None and self.clip.defer(action):
            return                        # ZeRO-1/2's gather of updated shards follows its UPD
        unit = self.units[action.node.region]
        group = self.groups[action.group]
        works = unit.gather(group) if action.node.phase else unit.gather_updated(group)
        self.pending[action.key] = (works, None)

    def _wait(self, key: str) -> None:
        if key not in self.pending:       # a reduce-scatter `_settle_reductions` already finished
            return
        works, then = self.pending.pop(key)
        for w in works:
            w.wait()
        self._done_at[key] = time.perf_counter()
        if then is not None:
            then()
