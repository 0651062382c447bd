"""The vocab-parallel loss: where an output layer divided by `shard vocab` feeds its logits
straight into `cross_entropy`, the loss is computed on each device's vocabulary columns.

Capture's meta copy runs such a layer as `tp_collect(linear(x, W_i), -1)`: its columns of the
logits, gathered, so the model's own code after it (a `view(-1, vocab_size)`, `.float()`, a
shift of the labels' positions) traces on the whole vocabulary. Here the exported graph is
rewritten where the gathered logits reach `aten.cross_entropy_loss` through nothing but
reshapes and flattens that keep the vocabulary last, casts and slices along other dimensions:

    before:  collect -> view(-1, V) -> to(float32) -> cross_entropy_loss(., target)
    after:   local   -> view(-1, V/tp) -> to(float32) -> tensor_ops.vocab_cross_entropy(., target)

so no device ever holds the full logits. Any other use keeps the gather (the logits whole on
every device, and the loss as the model computes it).
"""
from __future__ import annotations

import torch
from torch import fx

from .captured import op_schema

_aten = torch.ops.aten
_PASS_THROUGH = {_aten.to.dtype, _aten._to_copy.default, _aten.contiguous.default, _aten.clone.default,
                 _aten.to.dtype_layout}
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_FLATTEN = _aten.flatten.using_ints            # `logits.flatten(0, 1)`, as Hugging Face users write it
_CROSS_ENTROPY = _aten.cross_entropy_loss.default
_ASSERT = getattr(_aten, "_assert_tensor_metadata", None)


def _is_collect(node: fx.Node) -> bool:
    return op_schema(node) == "piper::tp_collect"


def _users(node: fx.Node) -> list[fx.Node]:
    """The users that compute with `node` (metadata asserts only read its dtype)."""
    return [u for u in node.users if not (_ASSERT is not None and u.target == _ASSERT.default)]


def _shape(node) -> tuple | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _chain(collect: fx.Node, vocab: int):
    """(the nodes from the gather to the loss, the loss node), or None where the logits go elsewhere."""
    chain, cur = [], collect
    while True:
        users = _users(cur)
        if len(users) != 1:
            return None
        (user,) = users
        shape = _shape(user)
        if user.target in _PASS_THROUGH:
            pass
        elif user.target in _RESHAPES:
            sizes = list(user.args[1])
            if not sizes or sizes[-1] not in (vocab, -1) or shape is None or shape[-1] != vocab:
                return None
        elif user.target == _FLATTEN:
            before = _shape(cur)
            end = user.args[2] if len(user.args) > 2 else -1
            if before is None or shape is None or end % len(before) == len(before) - 1 or shape[-1] != vocab:
                return None
        elif user.target == _aten.slice.Tensor:
            dim = user.args[1] if len(user.args) > 1 else 0
            if shape is None or dim in (-1, len(shape) - 1):
                return None
        elif user.target == _CROSS_ENTROPY and user.args[0] is cur:
            return chain, user
        else:
            return None
        if user.args[0] is not cur:
            return None
        chain.append(user)
        cur = user


def _loss_options(node: fx.Node) -> dict | None:
    """The cross_entropy_loss call's options, if the vocab-parallel loss computes the same."""
    names = [a.name for a in node.target._schema.arguments]
    given = dict(zip(names, node.args))
    given.update(node.kwargs)
    shape = _shape(node.args[0])
    if given.get("weight") is not None or given.get("label_smoothing", 0.0) != 0.0 or shape is None or len(shape) != 2:
        return None
    return {"ignore_index": given.get("ignore_index", -100), "reduction": given.get("reduction", 1)}


def _inline_loss(gm: fx.GraphModule, loss: fx.Node, options: dict) -> fx.Node:
    """`tensor_ops.vocab_cross_entropy` traced to ATen and TP ops and inlined where `loss` is, so the
    graph names each of its collectives (for the plans, the costs and the gradient walk)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from .. import tensor_ops

    logits, target = loss.args[0], loss.args[1]
    examples = [torch.empty(_shape(n), dtype=n.meta["val"].dtype, device="meta") for n in (logits, target)]

    def fn(x, t):
        return tensor_ops.vocab_cross_entropy(x, t, options["ignore_index"], options["reduction"], options["vocab"])
    traced = make_fx(fn)(*examples)
    env: dict = {}
    holders = iter((logits, target))
    out = None
    with gm.graph.inserting_before(loss):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(holders)
            elif node.op == "output":
                out = env[node.args[0][0] if isinstance(node.args[0], (tuple, list)) else node.args[0]]
            else:
                new = gm.graph.node_copy(node, lambda n: env[n])
                new.meta = {**dict(loss.meta), "val": node.meta.get("val")}   # the loss's region and stack
                env[node] = new
    return out


def rewrite(gm: fx.GraphModule) -> int:
    """Compute each gathered-logits cross entropy on the shards; returns how many were rewritten."""
    done = 0
    for collect in [n for n in gm.graph.nodes if _is_collect(n)]:
        local, dim, size = collect.args
        full = _shape(collect)
        if dim not in (-1, len(full) - 1 if full else -1) or full is None:
            continue
        found = _chain(collect, full[-1])
        if found is None:
            continue
        chain, loss = found
        options = _loss_options(loss)
        if options is None:
            continue
        per = full[-1] // size
        options["vocab"] = full[-1]           # targets outside it raise (`tensor_ops.vocab_check`)
        collect.replace_all_uses_with(local)
        for node in chain:
            if node.target in _RESHAPES:
                sizes = list(node.args[1])
                if sizes[-1] != -1:
                    sizes[-1] = per
                node.args = (node.args[0], sizes, *node.args[2:])
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                node.meta["val"] = torch.empty((*val.shape[:-1], per), dtype=val.dtype, device="meta")
        new = _inline_loss(gm, loss, options)
        loss.replace_all_uses_with(new)
        gm.graph.erase_node(loss)
        gm.graph.erase_node(collect)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
