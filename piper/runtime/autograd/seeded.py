"""A backward pass that does not hold its seed gradients to the end.

`torch.autograd.backward(tensors, grads)` keeps `grads` referenced by its caller
(and by its own frame) until the whole pass returns, so a stage's or a piece's
incoming output gradient stays alive through every node below it: the logits'
gradient through the final norm's backward, a received activation gradient
through a whole stage. One eager backward over one graph (what a single-device
model or torch's tensor parallelism runs) lets such a gradient go as soon as
the node that reads it has run.

`backward(tensors, grads)` roots the pass at one scalar whose backward hands the
gradients to the tensors' nodes and drops its own reference, so the engine's
input buffers hold the only ones. The caller gives up its references by passing
a list it does not keep (`backward` empties it).
"""
from __future__ import annotations

import torch


class _Seed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grads: list, *tensors):
        ctx.grads = grads
        return tensors[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)


def unread(tensor: torch.Tensor) -> bool:
    """Whether nothing but `tensor` itself holds its data: no other tensor shares its storage (a
    detached alias, an autograd graph's saved copy of an output) and nothing in C++ holds the
    tensor (a graph that saved it as an input, a collective in flight). A backward that starts from
    such a tensor needs only its node: its storage can be emptied first."""
    if tensor._is_view() or tensor._use_count() != 1:
        return False
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) == 2      # the tensor's and `storage`'s


def let_go_unread(tensors) -> None:
    """Empty the storage of each of `tensors` that `unread` finds held by nothing else. Only for
    tensors whose values nobody reads again from Python: the caller's promise."""
    for t in tensors:
        if torch.is_tensor(t) and unread(t):
            t.untyped_storage().resize_(0)


def backward(tensors: list, grads: list) -> None:
    """`torch.autograd.backward(tensors, grads)`, each gradient let go once its node has read it.
    Empties `grads`: what the caller still references elsewhere stays alive."""
    if len(tensors) == 1 and tensors[0].numel() == 1 and grads[0].numel() == 1:
        torch.autograd.backward(tensors, grads)    # a loss's scale: nothing worth freeing early
        grads.clear()
        return
    with torch.enable_grad():
        root = _Seed.apply(list(grads), *tensors)
    grads.clear()
    root.backward()
