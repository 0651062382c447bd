"""The collectives of tensor parallelism as exchanges between the pieces of a cut region
(`piper.ir.region_cut`), forward and backward; each issued asynchronously on the calling
lane's tensor group (`piper.tensor_context`), the piece after it waiting for it.

    kind               forward                       backward
    tp_copy            identity                      all-reduce            (Megatron-LM's f)
    tp_reduce          all-reduce                    identity              (g)
    tp_gather          all-gather along dim          reduce-scatter        (SP: a columns module's input)
    tp_reduce_scatter  reduce-scatter along dim      all-gather            (SP: a rows module's output)
    tp_collect         all-gather along dim          this device's slice   (logits used whole)
    tp_max             all-reduce max                none (no gradient)    (the vocab loss's shift)
    tp_split           this device's slice           all-gather            (SP beginning at a block)

The same as `piper.tensor_ops`' autograd, issued by the plan instead of from inside a graph.
Every member of a group runs the same pieces of the same graph, so which exchanges carry a
gradient is the same on all of them: one whose result carries none issues nothing backward.
"""
from __future__ import annotations

import torch

from ... import tensor_context
from ...ir.region_cut import Exchange, Source, local_exchange
from .cut_pass import _add, _Pass


def tensor_exchange(ex, run: _Pass, k: int, exchange: Exchange, *, forward: bool, recomputed: bool,
                    freeable: bool = False):
    """Issue TP exchange `k` of pass `run`: (work handles, what to do once they are done).
    `recomputed`: the region's forward pieces ran without autograd, so any floating value may
    carry a gradient (as `PieceForward._input` takes them). `freeable`: nothing but this exchange
    reads its input (`Cut.freeable`)."""
    group = tensor_context.current()
    if forward:
        works, then = _forward(run, k, exchange, group, recomputed)
        release = _releaser(run, exchange.sources[0]) if freeable else None
        if release is None:
            return works, then
        if not works:
            release()
            return works, then
        return works, (lambda: (then(), release()))
    return _backward(ex, run, k, exchange, group)


def _releaser(run: _Pass, source: Source):
    """What lets go of an exchange's input once the collective has read it: the piece's output
    stays (its backward starts from it) but not its data. None where its data may be needed: a
    view, a tensor without autograd history (an evaluation, a recomputed piece), one whose
    storage the piece's autograd graph saved (an op that saves its own result)."""
    x = run.values[source]
    saved = run.saved.get(source.index)
    if saved is None or x.grad_fn is None or x._is_view() or x.untyped_storage()._cdata in saved:
        return None
    storage = x.untyped_storage()

    def release():
        run.values.pop(source, None)
        storage.resize_(0)
    return release


def _forward(run: _Pass, k: int, exchange: Exchange, group, recomputed: bool):
    out = Source("exchange", k, 0)
    x = run.values[exchange.sources[0]]
    if exchange.kind != "tp_max" and (x.requires_grad or recomputed and x.is_floating_point()):
        run.differentiable.add(out)
    x = x.detach()
    kind, args = exchange.kind, exchange.args
    if kind == "tp_copy" or group is None or group.size == 1:
        run.values[out] = x if kind == "tp_copy" else local_exchange(kind, x, args, 1)
        return [], None
    if kind == "tp_split":
        run.values[out] = x.chunk(group.size, args[0])[group.index].clone()      # its own storage
        return [], None
    if kind in ("tp_reduce", "tp_max"):
        total = x.contiguous().clone()
        work, result = group.all_reduce_async(total, "max" if kind == "tp_max" else "sum"), (lambda: total)
    elif kind in ("tp_gather", "tp_collect"):
        work, result = group.all_gather_async(x, args[0])
    else:                                            # tp_reduce_scatter
        work, result = group.reduce_scatter_async(x, args[0])
    return [work], lambda: run.values.__setitem__(out, result())


def _backward(ex, run: _Pass, k: int, exchange: Exchange, group):
    out = Source("exchange", k, 0)
    arrived = run.values.pop(out, None)
    if out not in run.differentiable:
        return [], None
    grad = run.grads.pop(out, None)
    if grad is None:                    # no gradient reached it here: the others may need the collective
        shape, dtype, device = (arrived.shape, arrived.dtype, arrived.device) if arrived is not None \
            else run.shapes.pop(out)
        grad = torch.zeros(shape, dtype=dtype, device=device)
    kind, args, target = exchange.kind, exchange.args, exchange.sources[0]

    def deliver(g):
        with ex._lock:
            _add(run.grads, target, g)

    alone = group is None or group.size == 1
    if kind == "tp_reduce" or (alone and kind in ("tp_copy", "tp_collect")):
        deliver(grad)
        return [], None
    if kind == "tp_collect":
        deliver(grad.chunk(group.size, args[0])[group.index].contiguous())
        return [], None
    if alone:
        deliver(grad.clone())
        return [], None
    if kind == "tp_copy":
        total = grad.contiguous().clone()
        work, result = group.all_reduce_async(total), (lambda: total)
    elif kind == "tp_gather":
        work, result = group.reduce_scatter_async(grad, args[0])
    else:                                            # tp_reduce_scatter, tp_split
        work, result = group.all_gather_async(grad, args[0])
    return [work], lambda: deliver(result())
