"""Backward split into BI (gradients for a region's inputs) and BW (for its
weights) without doing the backward twice.

BI runs autograd to the inputs only and keeps the gradients that reach the
nodes where weights join the input paths; BW starts from those. This is
torch.distributed.pipelining's own method (`stage_backward_input` /
`stage_backward_weight`), used here when torch has it and when every weight
joins an input path. Otherwise BI keeps the graph and BW runs autograd again
from the outputs to the weights: correct, but it repeats the activation
gradients.
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def _torch_backward():
    """torch's pipelining `_backward` module, or None where this torch lacks it.

    Imported on first use: torch.distributed.pipelining pulls in torch._dynamo (about a
    second of CPU), which a worker whose plan has no BI/BW should not pay at start-up.
    """
    try:  # a private module of torch's pipelining: guard every use
        from torch.distributed.pipelining import _backward
    except ImportError:  # pragma: no cover - older or newer torch
        return None
    return _backward if hasattr(_backward, "stage_backward_input") else None


def _covers_every_weight(tensors, inputs, weights) -> bool:
    tb = _torch_backward()
    _get_grad_fn_or_grad_acc, construct_reverse_graph = tb._get_grad_fn_or_grad_acc, tb.construct_reverse_graph
    get_param_groups = tb.get_param_groups
    outs = [f for f in map(_get_grad_fn_or_grad_acc, tensors) if f is not None]
    ins = [f for f in map(_get_grad_fn_or_grad_acc, inputs) if f is not None]
    ws = [f for f in map(_get_grad_fn_or_grad_acc, weights) if f is not None]
    groups = get_param_groups(ins, ws, construct_reverse_graph(outs))
    covered = set()
    for group in groups:
        covered |= group["params"]
    return covered == set(ws)


def can_split(tensors, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> bool:
    """Whether BW can resume from BI's intermediates: every weight joins an input path.

    It walks the autograd graph in Python, so callers ask once per region:
    every microbatch of a region has the same graph.
    """
    return bool(inputs and weights and _torch_backward() is not None
                and _covers_every_weight(tensors, inputs, weights))


def backward_inputs(tensors, grads, inputs: list[torch.Tensor], weights: list[torch.Tensor], *, split: bool):
    """Gradients of `inputs`; returns them and what `backward_weights` needs.

    `split` (from `can_split`) picks torch's resumable method or the fallback.
    """
    if split:
        for leaf in inputs:
            leaf.grad = None
        dinputs, groups = _torch_backward().stage_backward_input(list(tensors), list(grads), list(inputs), iter(weights))
        return list(dinputs), ("groups", groups)
    result = torch.autograd.grad(tensors, inputs, grads, retain_graph=True, allow_unused=True) if inputs else []
    return list(result), ("graph", (tensors, grads))


def backward_weights(weights: list[torch.Tensor], state) -> None:
    """Accumulate the weights' gradients into their `.grad`."""
    kind, data = state
    if kind == "groups":
        _torch_backward().stage_backward_weight(iter(weights), data)
    else:
        tensors, grads = data
        if tensors and weights:
            torch.autograd.backward(tensors, grads, inputs=weights)
