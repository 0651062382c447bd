"""A region graph cut at the collectives it issues into pieces that a plan schedules one by
one, with the exchanges between them as actions of their own.

Two kinds of node are cut at. Under `shard experts`, a MoE layer's `piper::moe_dispatch`
and `piper::moe_combine` become local halves around an all-to-all (`piper.ir.moe_cut`).
Under tensor parallelism, every `piper::tp_*` op that communicates (`piper.tensor_ops`:
Megatron-LM's f and g, their sequence-parallel all-gather and reduce-scatter, the gathered
logits, the vocab loss's reductions) becomes one exchange: the op's input leaves the piece
before it, and its output enters the piece after it.

    x -> [piece 0: norm, q/k/v] -> TP tp_copy ... -> [piece 1: attention, o] -> TP tp_reduce -> [piece 2] ...

Pieces and exchanges alternate in graph order: an exchange is issued as an action of the
plan (asynchronously, on the calling lane's group) and only the piece that reads its result
waits for it, so a plan can put other compute under it (async TP, overlapped MoE lanes).
`tp_offset` (which device's vocabulary rows a shard holds) moves nothing and stays in its
piece.

Every value a piece reads from an earlier piece or exchange is one of its inputs (a
`Source`), so the runtime can run and differentiate each piece on its own
(`piper.runtime.moe.pieces`). An exchange's input is always an output of the piece before it
(a region input or an earlier exchange's result passes through that piece), so its
gradient goes back through that piece's backward.

Pure fx and torch, no process groups: the driver cuts too, to count the pieces the plan must
hold (`exchange_ops`).
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from .cut_parts import ALL_TO_ALL, TP, Builder, Cut, Exchange, Source, _Results, op_name  # noqa: F401 - the cut's parts

if TYPE_CHECKING:       # torch only where a graph is cut: `piper check --regions` plans without it
    import torch
    from torch import fx

# The TP ops cut at (`piper.tensor_ops`); `tp_offset` moves nothing and stays in its piece.
TP_KINDS = ("tp_copy", "tp_reduce", "tp_gather", "tp_reduce_scatter", "tp_collect", "tp_max", "tp_split")


def tp_kind(node: fx.Node) -> str | None:
    name = op_name(node)
    return name if name in TP_KINDS else None


def local_exchange(kind: str, x: torch.Tensor, args: tuple, size: int) -> torch.Tensor:
    """What TP exchange `kind` gives on a stand-in group of `size` members with no data of the
    others (`piper.tensor_context.Alone`): the shapes of the collective, this device's values."""
    import torch

    if kind in ("tp_gather", "tp_collect"):
        return torch.cat([x] * size, args[0])
    if kind in ("tp_reduce_scatter", "tp_split"):
        return x.chunk(size, args[0])[0].clone()
    return x.detach().clone()


def cuttable(gm: fx.GraphModule, *, experts: bool) -> bool:
    """Whether `gm` can be cut with its MoE layers (`experts`): they alternate dispatch and
    combine in graph order, their results read only through `getitem`. Without `experts`
    every graph can be (its MoE ops, if any, stay inside the pieces)."""
    if not experts:
        return True
    open_layer = False
    for node in gm.graph.nodes:
        name = op_name(node)
        if name in ("moe_dispatch", "moe_combine"):
            if (name == "moe_dispatch") == open_layer:
                return False
            open_layer = not open_layer
            if any(u.target is not operator.getitem for u in node.users):
                return False
    return not open_layer


def exchange_ops(gm: fx.GraphModule, *, experts: bool, tensor: bool) -> tuple[str, ...]:
    """The plan op of each exchange `cut` makes of `gm`, in order (() when nothing is cut)."""
    if not cuttable(gm, experts=experts):
        return ()
    out = []
    for node in gm.graph.nodes:
        name = op_name(node)
        if experts and name in ("moe_dispatch", "moe_combine"):
            out.append(ALL_TO_ALL)
        elif tensor and name in TP_KINDS:
            out.append(TP)
    return tuple(out)


def cut(gm: fx.GraphModule, size: int, *, experts: bool = True, tensor: bool = True) -> Cut:
    """Cut `gm` (a region graph, `cuttable`) at its MoE layers (`experts`, for an expert group of
    `size` members) and at its TP collectives (`tensor`)."""
    from . import moe_cut       # torch: only where a graph is cut

    assert cuttable(gm, experts=experts), "the compiler cuts only regions whose MoE layers alternate"
    b = Builder(gm)
    env: dict[fx.Node, object] = {}       # region node -> Source, (piece, node), or a tuple of those
    arg = 0
    outputs = []
    for node in gm.graph.nodes:
        name = op_name(node)
        if node.op == "placeholder":
            env[node] = Source("arg", arg)
            arg += 1
        elif node.op == "output":
            outs = node.args[0]
            outputs = [b.source(env[o]) for o in (outs if isinstance(outs, (tuple, list)) else (outs,))]
        elif experts and name == "moe_dispatch":
            env[node] = _Results(moe_cut.cut_dispatch(b, env, node, size))
        elif experts and name == "moe_combine":
            env[node] = _Results(moe_cut.cut_combine(b, env, node))
        elif tensor and name in TP_KINDS:
            x, *rest = node.args
            inp = b.use(env[x])       # through the piece before: its backward hands the gradient on
            env[node] = Source("exchange", b.exchange(name, [(b.piece, inp)], tuple(rest)), 0)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in env:
            value = env[node.args[0]]
            if isinstance(value, _Results):        # a result of a cut dispatch/combine
                env[node] = value[node.args[1]]
            else:                                  # stays with what it indexes (never a tuple between pieces)
                env[node] = b.item(value, node.args[1])
        else:
            new = b.graphs[b.piece].node_copy(node, lambda n: b.use(env[n]))
            env[node] = (b.piece, new)
    return b.finish(outputs, size)
