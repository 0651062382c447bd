"""Forward pieces of a cut region: each run on its own, reading earlier pieces' and
exchanges' values as leaves so its backward can hand their gradients back.

Mixed into `Pieces` (`pieces`).
"""
from __future__ import annotations

import torch

from ...ir.cut_parts import Source
from ..autograd import recompute
from .cut_pass import _count, _no_views, _Pass, let_go
from ...compiler.saved import SavedBytes


class PieceForward:
    def _input(self, run: _Pass, source: Source, piece: int, recomputed: bool):
        if source.kind == "arg":
            return run.args[source.index]
        value = run.values[source]
        # A recomputed region's forward runs without autograd: any floating value may carry a gradient.
        if torch.is_tensor(value) and (value.requires_grad or source in run.differentiable
                                       or recomputed and value.is_floating_point()):
            leaf = value.detach().requires_grad_()
            run.boundary.setdefault(piece, []).append((source, leaf))
            return leaf
        return value

    def forward(self, ex, action) -> None:
        """Run forward piece `action.node.value` (None: piece 0) of its region for its microbatch."""
        node = action.node
        piece, cut, region = node.value or 0, self.cuts[node.region], ex.spec.regions[node.region]
        key = (node.region, node.mb)
        if piece == 0:
            self.passes[key] = _Pass(*ex._args(region, node.mb))
            ex.saved_bytes[key] = 0
        run = self.passes[key]
        inputs = [self._input(run, s, piece, region.recompute) for s in cut.inputs[piece]]
        if region.recompute:     # keep only the piece's inputs; its backward runs it again (`recompute`)
            outs, run.kept[piece], size = recompute.forward(cut.pieces[piece], inputs, ex.device,
                                                            ex._param_storages)
        else:
            with torch.set_grad_enabled(not ex._evaluating), SavedBytes(ex._param_storages) as saved:
                outs = _no_views(cut.pieces[piece](*inputs))
            size = saved.size
            run.saved[piece] = saved._seen
        run.outs[piece] = outs
        for j, out in enumerate(outs):
            run.values[Source("piece", piece, j)] = out
        if not region.recompute and not ex._evaluating:      # what no later piece reads
            for source in cut.after_piece.get(piece, ()):
                let_go(run, source, cut.readers[source], exchange=source.kind == "exchange")
        _count(ex, key, size)
        if piece == len(cut.pieces) - 1:
            outs = [run.args[s.index] if s.kind == "arg" else run.values[s] for s in cut.outputs]
            for v, out in zip(region.outputs, outs):
                ex.values[(v, node.mb)] = out
            if region.loss:
                ex.losses.append(outs[-1].detach())
        ex._release(action)
