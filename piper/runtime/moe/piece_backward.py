"""Backward pieces of a cut region (B, and BI's input half): seeded with the
region's output gradients, run last piece first; piece 0 hands the region's input
gradients on.

Mixed into `Pieces` (`pieces`); BI's own parts are in `piece_split_backward`.
"""
from __future__ import annotations

import torch

from ...ir.cut_parts import Cut, Source
from ..autograd import recompute, seeded
from .cut_pass import PARAM, _add, _count, _no_views, _Pass


class PieceBackward:
    def _seed(self, ex, run: _Pass, node, region, cut: Cut) -> None:
        """The region's output gradients (and the loss's scale) onto the pieces that made them."""
        run.seeded = True
        outs = [None if s.kind == "arg" else run.values[s] for s in cut.outputs]
        for i, (v, out) in enumerate(zip(region.outputs, outs)):
            g = ex.grads.pop((v, node.mb), None)
            if g is not None and out is not None:
                _add(run.grads, cut.outputs[i], g)
        if region.loss:
            # as `BackwardActions._backward_targets` seeds it (fp16's loss scale included)
            scale = ex.spec.grad_scale * getattr(ex.clip, "loss_scale", 1.0)
            _add(run.grads, cut.outputs[-1], torch.full_like(outs[-1], scale))

    def _targets(self, run: _Pass, piece: int, cut: Cut):
        """The piece's outputs that get a gradient, and those gradients. Those the region does not
        output are read by later pieces alone, whose backwards have run and let go of them (the
        detached inputs they saved): what still holds their data holds it for nothing (torch's one
        eager graph frees such a tensor after its last reader's backward), so it is emptied."""
        tensors, grads = [], []
        for j, out in enumerate(run.outs.pop(piece)):
            source = Source("piece", piece, j)
            g = run.grads.pop(source, None)
            if g is not None and torch.is_tensor(out) and out.requires_grad:
                if source not in cut.outputs:
                    seeded.let_go_unread([out])
                tensors.append(out)
                grads.append(g)
        return tensors, grads

    def backward(self, ex, action, *, inputs_only: bool = False) -> None:
        """Backward piece `action.node.value` (B, or BI with `inputs_only`); piece 0 comes last and
        hands the region's input gradients on."""
        node = action.node
        piece, cut, region = node.value or 0, self.cuts[node.region], ex.spec.regions[node.region]
        key = (node.region, node.mb)
        run = self.passes[key]
        if not run.seeded:
            self._seed(ex, run, node, region, cut)
        if piece in run.kept:
            self._rerun(ex, run, node, region, cut, piece)
        tensors, grads = self._targets(run, piece, cut)
        boundary = run.boundary.pop(piece, [])
        if not inputs_only:
            if tensors:
                seeded.backward(tensors, grads)
            for source, leaf in boundary:
                if leaf.grad is not None:
                    _add(run.grads, source, leaf.grad)
        else:
            self._backward_inputs(ex, run, node, region, cut, piece, tensors, grads, boundary)
        if piece == 0:
            if inputs_only:
                ex._deliver_input_grads(node, run.leaves, run.input_grads)
            else:
                self._finish(ex, key)
                ex._deliver_input_grads(node, run.leaves, {v: leaf.grad for v, leaf in run.leaves.items()})
        ex._release(action)

    def _rerun(self, ex, run: _Pass, node, region, cut: Cut, piece: int) -> None:
        """A recomputed region's piece, forward again with autograd on the inputs it kept (the
        parameters as this backward sees them: a ZeRO-3 unit is gathered again)."""
        kept = run.kept.pop(piece)
        views = {}
        for u in region.units:
            views.update(ex.units[u].views())
            if ex.experts is not None:
                views.update(ex.experts.views(u))
        kept.args = [views[region.inputs[s.index].ref] if s.kind == "arg" and region.inputs[s.index].kind == PARAM
                     else a for s, a in zip(cut.inputs[piece], kept.args)]
        outs, size = recompute.rerun(cut.pieces[piece], kept, ex.device, ex._param_storages)
        run.outs[piece] = _no_views(outs)
        _count(ex, (node.region, node.mb), size)

    def _finish(self, ex, key) -> None:
        del self.passes[key]
        with ex._lock:
            ex.activations -= ex.saved_bytes.pop(key, 0)
