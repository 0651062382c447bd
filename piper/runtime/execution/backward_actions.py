"""The backward and update compute actions: B (one autograd pass), BI and BW (input and weight
gradients apart, `split_backward.py`), and UPD (the optimizer step of a unit).

Mixed into `Executor`.
"""
from __future__ import annotations

import torch

from ..state.clip import drop_gradients, gradients_finite, scaled_gradients
from .gradient_routing import GradientRouting
from ...compiler.slots import whole_backwards
from ..launch.specs import RegionSpec
from ..autograd import seeded
from ..autograd.split_backward import backward_inputs, backward_weights, can_split


class BackwardActions(GradientRouting):
    """`_b`, `_bi`, `_bw`, `_upd`; needs the units, step state (`saved`, `grads`), `_recomputed`
    and `_release`."""

    def _init_backward(self, spec) -> None:
        self._can_split: dict[int, bool] = {}     # region -> BW resumes from BI (same graph every microbatch)
        self._whole, self._skip = whole_backwards(spec.plan, spec.slots)

    def _b(self, action) -> None:
        node = action.node
        if node.region in self.pieces:    # a piece of a pass cut at its collectives
            return self.pieces.backward(self, action)
        region = self.spec.regions[node.region]
        outs, leaves = self.saved.pop((node.region, node.mb))
        outs = self._recomputed(region, node, outs)
        tensors, grads = self._backward_targets(region, node.mb, outs)
        if tensors:
            seeded.backward(tensors, grads)
        with self._lock:
            self.activations -= self.saved_bytes.pop((node.region, node.mb), 0)
        self._deliver_input_grads(node, leaves, {v: leaf.grad for v, leaf in leaves.items()})
        self._release(action)

    def _bi(self, action) -> None:
        node = action.node
        if node.region in self.pieces:
            return self.pieces.backward(self, action, inputs_only=self.pieces.pass_key(node) not in self._whole)
        if action.key in self._whole:      # the item was a whole `B(...)`: one autograd pass
            return self._b(action)
        region = self.spec.regions[node.region]
        outs, leaves = self.saved[(node.region, node.mb)]
        outs = self._recomputed(region, node, outs)
        tensors, grads = self._backward_targets(region, node.mb, outs)
        keys = list(leaves)
        weights = self._weights(region)
        if tensors:
            inputs = [leaves[k] for k in keys]
            split = self._can_split.get(node.region)
            if split is None:
                split = self._can_split[node.region] = can_split(tensors, inputs, weights)
            result, state = backward_inputs(tensors, grads, inputs, weights, split=split)
        else:
            result, state = [], ("graph", ([], []))
        self.saved[(node.region, node.mb)] = state
        self._deliver_input_grads(node, leaves, dict(zip(keys, result)))
        self._release(action)

    def _bw(self, action) -> None:
        node = action.node
        if node.region in self.pieces:
            return self.pieces.backward_weights(self, action, skip=action.key in self._skip)
        if action.key not in self._skip:   # else its BI ran the whole backward
            region = self.spec.regions[node.region]
            state = self.saved.pop((node.region, node.mb))
            backward_weights(self._weights(region), state)
            with self._lock:
                self.activations -= self.saved_bytes.pop((node.region, node.mb), 0)
        self._release(action)

    def _weights(self, region: RegionSpec) -> list[torch.Tensor]:
        weights = [w for u in region.units for w in self.units[u].weights()]
        if self.experts is not None:
            weights += [w for u in region.units for w in self.experts.weights(u)]
        return weights

    def _upd(self, action) -> None:
        if self.clip is not None and self.clip.defer(action):
            return
        region = action.node.region
        unit = self.units[region]
        expert_grads = [w.grad for w in self.experts.weights(region)] if self.experts is not None else []
        # Nothing else looks at the gradients before this update (no clip, no loss scaler): an inf
        # or NaN would go into the weights, so the update is skipped and the step reported.
        if self.clip is None and not gradients_finite(list(scaled_gradients(unit)) + expert_grads):
            drop_gradients(unit)
            for w in self.experts.weights(region) if self.experts is not None else ():
                w.grad = None
            self.nonfinite.append(f"unit {region}")
        else:
            unit.step()
            if self.experts is not None:
                self.experts.step(region)
        self._sample()
