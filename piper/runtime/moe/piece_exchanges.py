"""The exchanges between the pieces of a cut region, forward and backward: a MoE layer's
all-to-alls, and the collectives of tensor parallelism (`tensor_exchanges`).

Mixed into `Pieces` (`pieces`). An exchange is issued asynchronously on the
expert or tensor group of the calling lane; the plan's next piece waits for it.
"""
from __future__ import annotations

import time

import torch

from ...ir.cut_parts import Source
from ...ir.moe_cut import DISPATCH
from ... import expert_context as expert_groups
from ...ir.region_cut import TP
from .cut_pass import _add, _Pass
from .tensor_exchanges import tensor_exchange


class PieceExchanges:
    def exchange(self, ex, action) -> None:
        """Issue exchange `action.node.value` of its pass (forward or backward); the plan's next
        piece waits for it."""
        node = action.node
        k, run = node.value, self.passes[(node.region, node.mb)]
        exchange = self.cuts[node.region].exchanges[k]
        kind, sources = exchange.kind, exchange.sources
        start = time.perf_counter()
        if exchange.op == TP:
            works, then = tensor_exchange(ex, run, k, exchange, forward=node.phase == "F",
                                          recomputed=ex.spec.regions[node.region].recompute,
                                          freeable=exchange.sources[0] in self.cuts[node.region].freeable)
        elif node.phase == "F":
            works, then = [_send_rows(run, k, kind, sources, expert_groups.current())], None
        else:
            work, then = _send_gradients(ex, run, k, kind, sources, expert_groups.current())
            works = [work]
        key = action.key

        def done():
            ex.timings[key] = time.perf_counter() - start        # issue to arrival (`comm_cost`)
            if then is not None:
                then()
        ex.pending[key] = (works, done)


def _send_rows(run: _Pass, k: int, kind, sources, group):
    """Forward: a dispatch sends the rows to their experts, a combine sends them home."""
    out = Source("exchange", k, 0)
    rows = run.values[sources[0]]
    if kind == DISPATCH:
        counts = run.values[sources[1]]
        recv_counts = group.exchange_counts(counts)        # blocking: the row splits need them
        size = group.size
        send = counts.view(size, -1).sum(1)
        recv = recv_counts.view(size, -1).sum(1)
        run.values.update({Source("exchange", k, 1): recv_counts, Source("exchange", k, 2): send,
                           Source("exchange", k, 3): recv})
        received, work = group.all_to_all_async(rows.detach(), recv, send)
    else:
        send, recv = run.values[sources[1]], run.values[sources[2]]
        received, work = group.all_to_all_async(rows.detach(), send, recv)
    run.values[out] = received
    if rows.requires_grad:
        run.differentiable.add(out)
    return work


def _send_gradients(ex, run: _Pass, k: int, kind, sources, group):
    """Backward: the rows' gradients the other way; returns the work and what to do once they arrive."""
    out = Source("exchange", k, 0)
    arrived = run.values.pop(out)
    grad = run.grads.pop(out, None)
    if grad is None:          # no gradient reached these rows: still issue, with zeros
        grad = torch.zeros_like(arrived)
    if kind == DISPATCH:      # gradients of the rows this device received go back to their senders
        send, recv = run.values[Source("exchange", k, 2)], run.values[Source("exchange", k, 3)]
        back, work = group.all_to_all_async(grad, send, recv)
    else:                     # gradients of the rows that came home go out to the experts again
        send, recv = run.values[sources[1]], run.values[sources[2]]
        back, work = group.all_to_all_async(grad, recv, send)
    target = sources[0]

    def then():
        with ex._lock:
            _add(run.grads, target, back)
    return work, then
