"""The forward compute action (F): a region's graph on its inputs, keeping what backward needs.

Mixed into `Executor`. A `recompute` region keeps only its inputs and runs
its forward again in backward (`recompute.py`).
"""
from __future__ import annotations

import torch

from ..autograd import recompute
from ..launch.specs import BATCH, BUFFER, PARAM, RegionSpec


class ForwardActions:
    """`_f` and `_recomputed`; needs the units, experts, step state (`values`, `saved`) and `_release`."""

    def _args(self, region: RegionSpec, mb: int):
        views = {}
        for u in region.units:
            views.update(self.units[u].views())
            if self.experts is not None:
                views.update(self.experts.views(u))
        args, leaves = [], {}
        for inp in region.inputs:
            if inp.kind == PARAM:
                args.append(views[inp.ref])
            elif inp.kind == BUFFER:
                args.append(self.buffers[inp.ref])
            elif inp.kind == BATCH:
                args.append(self.batch[inp.ref][mb])
            else:
                src = self.values[(inp.ref, mb)]
                leaf = src.detach()
                if self.spec.values[inp.ref][4]:
                    leaf.requires_grad_()
                    leaves[inp.ref] = leaf
                args.append(leaf)
        return args, leaves

    def _f(self, action) -> None:
        node = action.node
        if node.region in self.pieces:    # a piece of a pass cut at its collectives
            return self.pieces.forward(self, action)
        region = self.spec.regions[node.region]
        args, leaves = self._args(region, node.mb)
        if region.recompute:
            outs, kept, size = recompute.forward(region.graph, args, self.device, self._param_storages)
        elif self._evaluating:            # nothing is saved without autograd
            with torch.no_grad():
                outs = region.graph(*args)
            size, kept = 0, outs
        else:
            outs, size = self._saved_sizes.run(region, args, self._param_storages)
            kept = outs
        self.saved_bytes[(node.region, node.mb)] = size
        with self._lock:
            self.activations += size
            self.activation_peak = max(self.activation_peak, self.activations)
        for v, out in zip(region.outputs, outs):
            self.values[(v, node.mb)] = out
        if region.loss:
            self.losses.append(outs[-1].detach())
        self.saved[(node.region, node.mb)] = (kept, leaves)
        self._release(action)

    def _recomputed(self, region: RegionSpec, node, outs):
        """A `recompute` region's outputs, with their graph: its forward again (else `outs`)."""
        if not isinstance(outs, recompute.Kept):
            return outs
        views = {}
        for u in region.units:             # the parameters as this backward sees them (gathered again)
            views.update(self.units[u].views())
            if self.experts is not None:   # and the expert rows this device holds
                views.update(self.experts.views(u))
        outs.args = [views[i.ref] if i.kind == PARAM else a for i, a in zip(region.inputs, outs.args)]
        outs, size = recompute.rerun(region.graph, outs, self.device, self._param_storages)
        with self._lock:
            self.saved_bytes[(node.region, node.mb)] = self.saved_bytes.get((node.region, node.mb), 0) + size
            self.activations += size
            self.activation_peak = max(self.activation_peak, self.activations)
        self._sample()                    # the rerun's activations are held now, until this backward ends
        return outs
