"""Tensor parallelism over an axis of size 1: its collectives are identities, so they leave the graph.

Each TP collective is a `torch.library` custom op (`piper.tensor_ops`) that copies its input at
tp=1 (a custom op may not return its input), and dispatching one costs host time on every call:
2.4 ms a step on a small Llama on one H200, about 5% of its step. With one device along the axis
nothing is exchanged, so the ops are dropped at capture and the graph is the plain model's:

    x1 = tp_copy(x); y = mm(x1, w)      ->      y = mm(x, w)

`tp_offset` (where this device's vocabulary rows start) becomes a zero of its dtype. The
vocab-parallel loss's local terms stay: they compute the loss, and `vocab_check` stays, as it
checks the token ids.
"""
from __future__ import annotations

import torch
import torch.fx as fx

IDENTITIES = ("tp_copy", "tp_reduce", "tp_gather", "tp_reduce_scatter", "tp_collect", "tp_split", "tp_max")


def drop_unit_collectives(gm: fx.GraphModule) -> int:
    """Remove every TP collective of `gm` (captured with the TP axis of size 1), in place; returns
    how many nodes went."""
    ops = {getattr(torch.ops.piper, name).default for name in IDENTITIES}
    offset = torch.ops.piper.tp_offset.default
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ops:
            node.replace_all_uses_with(node.args[0])
        elif node.target is offset:
            with gm.graph.inserting_before(node):
                zero = gm.graph.call_function(torch.ops.aten.new_zeros.default, (node.args[0], []),
                                              {"dtype": torch.int64})
            zero.meta.update(node.meta)
            node.replace_all_uses_with(zero)
        else:
            continue
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped
