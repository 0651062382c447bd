"""A cut region's backward split in two: BI (gradients of each piece's inputs,
keeping what its weights need) and BW (every piece's weight gradients after).

Mixed into `Pieces` (`pieces`); `PieceBackward.backward` calls
`_backward_inputs` for BI.
"""
from __future__ import annotations

import torch

from ...ir.cut_parts import Cut
from .cut_pass import PARAM, VALUE, _add, _Pass
from ..autograd.split_backward import backward_inputs, backward_weights, can_split


class PieceSplitBackward:
    def _backward_inputs(self, ex, run: _Pass, node, region, cut: Cut, piece: int, tensors, grads,
                         boundary) -> None:
        """BI of one piece: gradients of the leaves it read and of the region's value inputs it
        uses; what its weights' gradients need is kept for BW."""
        values = {i: inp.ref for i, inp in enumerate(region.inputs) if inp.kind == VALUE}
        args = [i for i in cut.args_used(piece) if i in values and values[i] in run.leaves]
        leaves = [leaf for _, leaf in boundary] + [run.args[i] for i in args]
        weights = self._weights(ex, region, run, cut, piece)
        if tensors:
            split = self._split.get((node.region, piece))
            if split is None:
                split = self._split[(node.region, piece)] = can_split(tensors, leaves, weights)
            result, state = backward_inputs(tensors, grads, leaves, weights, split=split)
            run.weight_states[piece] = (weights, state)
            for (source, _), g in zip(boundary, result):
                if g is not None:
                    _add(run.grads, source, g)
            for i, g in zip(args, result[len(boundary):]):
                if g is not None:
                    _add(run.input_grads, values[i], g)

    def _weights(self, ex, region, run: _Pass, cut: Cut, piece: int) -> list[torch.Tensor]:
        """The weights piece `piece` reads (all the region's where they are not its own inputs)."""
        mine = {id(run.args[i]) for i in cut.args_used(piece) if region.inputs[i].kind == PARAM}
        every = ex._weights(region)
        found = [w for w in every if id(w) in mine]
        return found if found or not mine else every

    def backward_weights(self, ex, action, *, skip: bool = False) -> None:
        """BW: every piece's weight gradients, from what its BI kept (`skip`: its BI ran a whole B)."""
        node = action.node
        key = (node.region, node.mb)
        if skip:
            ex._release(action)
            return
        run = self.passes[key]
        for weights, state in run.weight_states.values():
            backward_weights(weights, state)
        self._finish(ex, key)
        ex._release(action)
