"""Attention masks that are the causal mask, handed back to attention as `is_causal=True`.

A Hugging Face model builds its attention mask in forward. Run eagerly on a
batch without padding it skips the mask and calls
`scaled_dot_product_attention(q, k, v, is_causal=True)`; under export it
cannot tell, so the captured graph builds the mask from positions (aranges,
comparisons, a packed-sequence check) and passes it to attention, which then
computes the masked half too. On the tiny Llama of `benchmarks/harness/families_more.py`
that cost the captured region 2-5% of its forward and backward against eager.

A mask computed from no input's values (positions and shapes only) is a
constant. `causal_attention` evaluates it once, at capture, on the CPU; where it
is exactly the causal mask (`True`, or 0 / -inf, on and below the diagonal),
the call becomes `scaled_dot_product_attention(q, k, v, is_causal=True)` (the
computation eager runs) and the mask's ops go. A mask fed by an input's values
(a padding mask from `attention_mask`) is left as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
# Ops that read only their input's shape, dtype and device: an input feeding the mask only through
# these leaves its values out of it.
_SHAPE_ONLY = frozenset((aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default,
                         aten.new_full.default, aten.ones_like.default, aten.zeros_like.default,
                         aten.empty_like.default, aten.full_like.default))


def causal_attention(graph: fx.Graph) -> int:
    """Rewrite every attention call whose mask is the constant causal mask; how many were."""
    found: dict[fx.Node, bool] = {}
    rewritten = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask = _arg(node, 3, "attn_mask")
        if not isinstance(mask, fx.Node) or _arg(node, 4, "dropout_p", 0.0) or _arg(node, 5, "is_causal"):
            continue
        if mask not in found:
            value = _constant(mask)
            found[mask] = value is not None and _is_causal(value, node)
        if found[mask]:
            rest = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
            node.args, node.kwargs = node.args[:3], {**rest, "is_causal": True}
            rewritten.append(mask)
    for mask in dict.fromkeys(rewritten):
        drop_unused(graph, mask)
    return len(rewritten)


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


# The largest mask evaluated at capture (elements of any tensor on the way): a [8, 1, 8192, 8192]
# boolean mask is 512 MiB of the driver's memory, so longer contexts keep their mask as it is.
MAX_ELEMENTS = 1 << 26


def _constant(mask: fx.Node) -> torch.Tensor | None:
    """The mask's value, computed on the CPU, when no input's values reach it; else None."""
    ancestors = _ancestors(mask)
    if any(getattr(n.meta.get("val"), "numel", lambda: 0)() > MAX_ELEMENTS for n in ancestors):
        return None
    env: dict[fx.Node, object] = {}
    for n in mask.graph.nodes:          # graph order is a topological order
        if n not in ancestors:
            continue
        if n.op != "call_function":
            # An input (or a lifted constant): allowed only where it is read for its shape.
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor) or any(u.target not in _SHAPE_ONLY for u in n.users
                                                         if u in ancestors):
                return None
            env[n] = torch.zeros(val.shape, dtype=val.dtype)
            continue
        if not isinstance(n.target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in n.target.tags:
            return None
        args, kwargs = pytree.tree_map(_on_cpu, fx.node.map_arg((n.args, n.kwargs), env.__getitem__))
        try:
            env[n] = n.target(*args, **kwargs)
        except Exception:       # an op that will not run on the CPU: leave the mask as it is
            return None
    value = env[mask]
    return value if isinstance(value, torch.Tensor) else None


def _on_cpu(x):
    """The meta device (capture exports there) read as the CPU."""
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def _is_causal(mask: torch.Tensor, sdpa: fx.Node) -> bool:
    """Whether `mask` allows exactly key j <= query i, for every batch and head."""
    q, k = (sdpa.args[i].meta.get("val") for i in (0, 1))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or mask.dim() < 2:
        return False
    length, keys = q.shape[-2], k.shape[-2]
    if tuple(mask.shape[-2:]) != (length, keys):
        return False
    allowed = torch.ones(length, keys, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if not mask.is_floating_point():
        return False
    return bool(((mask == 0) == allowed).all()) and bool((mask[..., ~allowed] == float("-inf")).all())


def drop_unused(graph: fx.Graph, node: fx.Node) -> None:
    """`node` and the ops it was computed from that nothing reads any more, last first (inputs stay)."""
    ancestors = _ancestors(node)
    for n in reversed(list(graph.nodes)):
        if n in ancestors and n.op == "call_function" and not n.users:
            graph.erase_node(n)
