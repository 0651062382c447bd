"""Where a backward pass's gradients come from and go: the seeds of its autograd pass (the
gradients received for its outputs, the loss's scale) and its inputs' gradients, summed locally
or handed to a SEND_B.

Mixed into `Executor` (through `BackwardActions`); MoE pieces (`piece_backward.py`) and receives
(`comm_actions.py`) use it too.
"""
from __future__ import annotations

import torch

from ..launch.specs import RegionSpec


class GradientRouting:
    """Needs `spec`, `clip`, the step state (`grads`, `grad_out`) and `_lock`."""

    def _backward_targets(self, region: RegionSpec, mb: int, outs):
        tensors, grads = [], []
        for v, out in zip(region.outputs, outs):
            g = self.grads.pop((v, mb), None)
            if g is not None and out.requires_grad:
                tensors.append(out)
                grads.append(g)
        if region.loss:
            loss = outs[-1]
            tensors.append(loss)
            grads.append(torch.full_like(loss, self.spec.grad_scale * getattr(self.clip, "loss_scale", 1.0)))
        return tensors, grads

    def _deliver_input_grads(self, node, leaves: dict, grads: dict) -> None:
        """Route each input value's gradient to its producer: locally or via SEND_B."""
        for v, leaf in leaves.items():
            g = grads.get(v)
            if g is None:
                g = torch.zeros_like(leaf)
            producer = self.spec.values[v][0]
            if producer in self.spec.regions:
                self._accumulate((v, node.mb), g)
            else:
                self.grad_out[(v, node.mb, node.region)] = g

    def _accumulate(self, key, g) -> None:
        with self._lock:
            if key in self.grads:
                self.grads[key] = self.grads[key] + g
            else:
                self.grads[key] = g
