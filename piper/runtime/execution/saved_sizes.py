"""What a region's forward saves for backward, counted once per input signature.

`SavedBytes` counts through a `saved_tensors_hooks` pack hook: a Python call from the autograd
engine for every tensor saved, and an unpack call for each in backward. On a GPU, where the host
only queues kernels, those calls are host time the step waits on (measured on one H200, a 4-block
Llama of dim 256: 4.5 ms of a 23 ms step). A region graph whose every op has shapes fixed by its
inputs' shapes saves the same bytes each time it runs on inputs of the same shapes, dtypes and
`requires_grad`, so it is counted on the first such forward and then looked up. A graph with an
op whose output shape depends on data (`nonzero`, `.item()`, Piper's MoE dispatch) is counted
every time. Without a hook autograd keeps no reference cycle through saved outputs (it stores
them without their `grad_fn`), so the alias `SavedBytes` hands autograd is not needed then.
"""
from __future__ import annotations

import operator

import torch

from ...compiler.saved import SavedBytes

_DYNAMIC = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
# Piper's own ops whose output shapes follow from their inputs' (the TP collectives and the
# vocab-parallel loss's local half); the MoE ones route a data-dependent number of tokens.
_PIPER_STATIC = {"tp_collect", "tp_copy", "tp_gather", "tp_max", "tp_offset", "tp_reduce", "tp_reduce_scatter",
                 "tp_split", "vocab_terms", "vocab_check"}


def shapes_fixed(graph) -> bool:
    """Whether every call in `graph` (an fx.GraphModule) has output shapes fixed by its inputs'."""
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            continue
        if not isinstance(target, torch._ops.OpOverload):
            return False
        namespace, name = target.namespace, target._opname
        if namespace == "aten" and not _DYNAMIC & set(target.tags):
            continue
        if namespace == "piper" and name in _PIPER_STATIC:
            continue
        return False
    return True


class SavedSizes:
    """Per region, whether its graph's shapes are fixed, and the bytes saved per input signature."""

    def __init__(self):
        self._fixed: dict[int, bool] = {}
        self._sizes: dict[tuple, int] = {}

    def run(self, region, args, exclude) -> tuple[list, int]:
        """`region.graph(*args)` with autograd on: (its outputs, the bytes it saved for backward)."""
        fixed = self._fixed.get(region.index)
        if fixed is None:
            fixed = self._fixed[region.index] = shapes_fixed(region.graph)
        key = None
        if fixed:
            key = (region.index, *((a.shape, a.dtype, a.requires_grad) if torch.is_tensor(a) else None
                                   for a in args))
            size = self._sizes.get(key)
            if size is not None:
                with torch.enable_grad():
                    return region.graph(*args), size
        with torch.enable_grad(), SavedBytes(exclude) as saved:
            outs = region.graph(*args)
        if key is not None:
            self._sizes[key] = saved.size
        return outs, saved.size
