"""Key/value heads repeated for grouped-query attention, handed back to attention as `enable_gqa=True`.

A model with fewer key/value heads than query heads (Llama's
`num_key_value_heads`) repeats each key/value head for its group of queries
before attention: `x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)`
(Hugging Face's `repeat_kv`). Run eagerly without a mask, Hugging Face skips
that and calls `scaled_dot_product_attention(..., enable_gqa=True)`; under
export the mask was there when it chose, so the captured graph keeps the
repeat: copies of keys and values in forward, and sums over each group in
backward. Where attention has no mask (after `causal_masks`) and both its keys
and values are repeats by the same factor, `repeated_heads` passes the
unrepeated ones with `enable_gqa=True`, which maps query head i to key/value
head i // n as the repeat does.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .causal_masks import drop_unused

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def repeated_heads(graph: fx.Graph) -> int:
    """Rewrite every unmasked attention call whose keys and values are repeated heads; how many were."""
    done = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA or len(node.args) > 3:
            continue
        if node.kwargs.get("attn_mask") is not None or node.kwargs.get("enable_gqa"):
            continue
        key, value = _unrepeated(node.args[1]), _unrepeated(node.args[2])
        if key is None or value is None or key[1] != value[1]:
            continue
        repeats = (node.args[1], node.args[2])
        node.args = (node.args[0], key[0], value[0])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for repeat in repeats:
            drop_unused(graph, repeat)
        done += 1
    return done


def _unrepeated(node) -> tuple[fx.Node, int] | None:
    """(x, n) where `node` is reshape(expand(unsqueeze(x, 2), [b, h, n, s, d]), [b, h * n, s, d])."""
    if not isinstance(node, fx.Node) or node.target not in _RESHAPES:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not aten.unsqueeze.default or \
            unsqueeze.args[1] not in (2, -3):
        return None
    x = unsqueeze.args[0]
    shapes = [getattr(n.meta.get("val"), "shape", None) if isinstance(n, fx.Node) else None
              for n in (x, expand, node)]
    if any(shape is None for shape in shapes) or len(shapes[0]) != 4 or len(shapes[1]) != 5:
        return None
    (b, h, s, d), (eb, eh, n, es, ed), out = shapes
    if (eb, eh, es, ed) != (b, h, s, d) or tuple(out) != (b, h * n, s, d):
        return None
    return x, n
