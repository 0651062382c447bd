"""The MoE cut: a region graph with MoE layers, cut at its all-to-alls into pieces
that a plan schedules one by one, with the exchanges between them as actions.

A captured region holds each MoE layer as `piper::moe_dispatch` ... `piper::expert_mm`
... `piper::moe_combine` nodes. Under `shard experts` those two nodes move tokens
between devices. `cut` rewrites each into its local halves and an exchange:

    dispatch(x, experts)  ->  sort (local)   | exchange "dispatch" |  regroup (local)
    combine(y, gates, h)  ->  unregroup      | exchange "combine"  |  home (weighted sum)

and splits the graph at the exchanges, in graph order: piece 0 runs up to the
first layer's sort, piece 1 from its regroup through the experts to its
unregroup, piece 2 from its home to the next layer's sort, and so on. A region
with L layers has 2L exchanges and 2L + 1 pieces. Every value a piece reads from
an earlier piece or exchange is one of its inputs (a `Source`), so the runtime
can run, and differentiate, each piece on its own, and issue the exchanges
itself (`piper.runtime.moe.pieces`).

Pure fx and torch, no process groups: the driver cuts too, to count the pieces
the plan must hold (`count_exchanges`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

DISPATCH = "dispatch"        # rows to their experts' devices (counts exchanged first)
COMBINE = "combine"          # the experts' results back home


@dataclass(frozen=True)
class Source:
    """Where a piece's (or an exchange's) input comes from.

    `kind` is "arg" (the region's input `index`), "piece" (output `out` of piece
    `index`) or "exchange" (output `out` of exchange `index`: a dispatch gives
    (rows, counts per source and local expert, send splits, receive splits), a
    combine gives (rows,)).
    """

    kind: str
    index: int
    out: int = 0


@dataclass
class Cut:
    """A region graph cut at its exchanges (see the module docstring)."""

    pieces: list                     # fx.GraphModule per piece, in run order
    inputs: list                     # per piece: the Source of each of its placeholders
    exchanges: list                  # per exchange: (DISPATCH | COMBINE, the Sources of its inputs)
    outputs: list                    # the region's outputs, as Sources
    size: int                        # members of the expert group the cut was made for

    def args_used(self, piece: int) -> list[int]:
        """The region inputs piece `piece` reads (positions in the region's inputs)."""
        return [s.index for s in self.inputs[piece] if s.kind == "arg"]


# -- the local halves (plain differentiable torch: autograd does their backward) -------------------------

def sort_tokens(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Token copies sorted by expert: (rows, counts per global expert, the order they were taken in)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return x.index_select(0, order // experts.shape[-1]), torch.bincount(flat, minlength=num_experts), order


def regroup_rows(received: torch.Tensor, recv_counts: torch.Tensor, size: int):
    """Rows received grouped by source then expert -> grouped by local expert (stable):
    (rows, counts per local expert, the permutation)."""
    local = recv_counts.numel() // size
    expert_of_row = torch.arange(local, device=received.device).repeat(size).repeat_interleave(recv_counts)
    regroup = torch.argsort(expert_of_row, stable=True)
    return received.index_select(0, regroup), recv_counts.view(size, local).sum(0), regroup


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def unregroup_rows(y: torch.Tensor, regroup: torch.Tensor) -> torch.Tensor:
    """The experts' results back in the order the rows arrived (the inverse of `regroup_rows`)."""
    return y.index_select(0, _inverse(regroup))


def home_rows(rows: torch.Tensor, gates: torch.Tensor, order: torch.Tensor):
    """Rows back home in sorted order -> `sum_k gates[t, k] * row(t, k)`: (out, rows in token order)."""
    tokens, top_k = gates.shape
    flat = rows.index_select(0, _inverse(order))
    out = (flat.view(tokens, top_k, -1) * gates.to(flat.dtype).unsqueeze(-1)).sum(1)
    return out, flat


# -- the cut ------------------------------------------------------------------------------------------

def _is(node: fx.Node, name: str) -> bool:
    target = node.target
    schema = getattr(target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.name == f"piper::{name}"


def cuttable(gm: fx.GraphModule) -> bool:
    """Whether `gm`'s MoE layers can be cut: dispatches and combines alternate in graph
    order (each layer's combine before the next layer's dispatch), and their results
    are read only through `getitem`."""
    open_layer = False
    found = False
    for node in gm.graph.nodes:
        if _is(node, "moe_dispatch") or _is(node, "moe_combine"):
            if _is(node, "moe_dispatch") == open_layer:
                return False
            open_layer = not open_layer
            found = True
            if any(u.target is not operator.getitem for u in node.users):
                return False
    return found and not open_layer


def count_exchanges(gm: fx.GraphModule) -> int:
    """How many exchanges `cut` makes of `gm` (0: nothing to cut)."""
    if not cuttable(gm):
        return 0
    return sum(1 for n in gm.graph.nodes if _is(n, "moe_dispatch") or _is(n, "moe_combine"))


class _Results(tuple):
    """The results of a cut dispatch or combine, as the region graph's getitems read them."""


class _Builder:
    """Builds the pieces' graphs while walking the region graph once, in order."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.graphs: list[fx.Graph] = []
        self.inputs: list[list[Source]] = []
        self.placeholders: list[dict[Source, fx.Node]] = []
        self.outputs: list[list[fx.Node]] = []
        self.exchanges: list[tuple[str, list[Source]]] = []
        self.new_piece()

    @property
    def piece(self) -> int:
        return len(self.graphs) - 1

    def new_piece(self) -> None:
        self.graphs.append(fx.Graph())
        self.inputs.append([])
        self.placeholders.append({})
        self.outputs.append([])

    def source(self, value) -> Source:
        """`value` (a Source, or (piece, node) made in a piece) as a Source: a piece output if need be."""
        if isinstance(value, Source):
            return value
        piece, node = value
        outs = self.outputs[piece]
        if node not in outs:
            outs.append(node)
        return Source("piece", piece, outs.index(node))

    def use(self, value) -> fx.Node:
        """`value` inside the current piece: its own node, or a placeholder for it."""
        if isinstance(value, tuple) and not isinstance(value, Source) and value[0] == self.piece:
            return value[1]
        src = self.source(value)
        found = self.placeholders[self.piece].get(src)
        if found is None:
            name = f"in_{len(self.inputs[self.piece])}"
            found = self.graphs[self.piece].placeholder(name)
            self.placeholders[self.piece][src] = found
            self.inputs[self.piece].append(src)
        return found

    def call(self, fn, args) -> tuple[int, fx.Node]:
        return self.piece, self.graphs[self.piece].call_function(fn, tuple(args))

    def item(self, value, i: int):
        piece, node = value
        return piece, self.graphs[piece].call_function(operator.getitem, (node, i))

    def exchange(self, kind: str, inputs) -> int:
        self.exchanges.append((kind, [self.source(v) for v in inputs]))
        self.new_piece()
        return len(self.exchanges) - 1


def cut(gm: fx.GraphModule, size: int) -> Cut:
    """Cut `gm` (a region graph, `cuttable`) for an expert group of `size` members."""
    assert cuttable(gm), "the compiler cuts only regions whose MoE layers alternate dispatch/combine"
    b = _Builder(gm)
    env: dict[fx.Node, object] = {}       # region node -> Source, (piece, node), or a tuple of those
    arg = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = Source("arg", arg)
            arg += 1
        elif node.op == "output":
            outs = node.args[0]
            outputs = [b.source(env[o]) for o in (outs if isinstance(outs, (tuple, list)) else (outs,))]
        elif _is(node, "moe_dispatch"):
            x, experts, num_experts = node.args
            sorted_ = b.call(sort_tokens, (b.use(env[x]), b.use(env[experts]), num_experts))
            rows, counts, order = (b.item(sorted_, i) for i in range(3))
            k = b.exchange(DISPATCH, (rows, counts))
            received, recv_counts = Source("exchange", k, 0), Source("exchange", k, 1)
            grouped = b.call(regroup_rows, (b.use(received), b.use(recv_counts), size))
            routed, local_counts, regroup = (b.item(grouped, i) for i in range(3))
            env[node] = _Results((routed, local_counts, order, regroup, Source("exchange", k, 2),
                                  Source("exchange", k, 3)))
        elif _is(node, "moe_combine"):
            y, gates, order, regroup, send_splits, recv_splits = node.args
            back = b.call(unregroup_rows, (b.use(env[y]), b.use(env[regroup])))
            k = b.exchange(COMBINE, (back, env[send_splits], env[recv_splits]))
            home = b.call(home_rows, (b.use(Source("exchange", k, 0)), b.use(env[gates]), b.use(env[order])))
            env[node] = _Results((b.item(home, 0), b.item(home, 1)))
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in env:
            value = env[node.args[0]]
            if isinstance(value, _Results):        # a result of a cut dispatch/combine
                env[node] = value[node.args[1]]
            else:                                  # stays with what it indexes (never a tuple between pieces)
                env[node] = b.item(value, node.args[1])
        else:
            new = b.graphs[b.piece].node_copy(node, lambda n: b.use(env[n]))
            env[node] = (b.piece, new)
    pieces = []
    for graph, outs in zip(b.graphs, b.outputs):
        graph.output(tuple(outs))
        pieces.append(fx.GraphModule(gm, graph))
    return Cut(pieces, b.inputs, b.exchanges, outputs, size)
