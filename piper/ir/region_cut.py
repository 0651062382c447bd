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
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # torch only where a graph is cut: `piper check --regions` plans without it
    import torch
    from torch import fx

# The TP ops cut at (`piper.tensor_ops`); `tp_offset` moves nothing and stays in its piece.
TP_KINDS = ("tp_copy", "tp_reduce", "tp_gather", "tp_reduce_scatter", "tp_collect", "tp_max", "tp_split")
TP, ALL_TO_ALL = "TP", "ALL_TO_ALL"          # the plan's node ops for the two kinds of exchange


@dataclass(frozen=True)
class Source:
    """Where a piece's (or an exchange's) input comes from.

    `kind` is "arg" (the region's input `index`), "piece" (output `out` of piece
    `index`) or "exchange" (output `out` of exchange `index`: a MoE dispatch gives
    (rows, counts per source and local expert, send splits, receive splits), a
    combine and every TP exchange give one tensor).
    """

    kind: str
    index: int
    out: int = 0


@dataclass(frozen=True)
class Exchange:
    """One exchange between two pieces: its kind (a MoE "dispatch" or "combine", or a TP op's
    name), the Sources of its inputs, and the op's static arguments (a TP gather's dim and size)."""

    kind: str
    sources: tuple
    args: tuple = ()

    @property
    def op(self) -> str:
        """The plan's node op: `TP` or `ALL_TO_ALL`."""
        return TP if self.kind.startswith("tp_") else ALL_TO_ALL


@dataclass
class Cut:
    """A region graph cut at its exchanges (see the module docstring)."""

    pieces: list                     # fx.GraphModule per piece, in run order
    inputs: list                     # per piece: the Source of each of its placeholders
    exchanges: list                  # per exchange: an `Exchange`
    outputs: list                    # the region's outputs, as Sources
    size: int                        # members of the expert group the cut was made for
    freeable: frozenset = frozenset()    # piece outputs a TP exchange alone reads, and not as its own result
    after_piece: dict = field(default_factory=dict)   # piece -> values no piece after it reads (`Builder.finish`)
    readers: dict = field(default_factory=dict)       # such a value -> the pieces that read it
    ops: tuple = field(init=False)

    def __post_init__(self):
        self.ops = tuple(e.op for e in self.exchanges)

    def args_used(self, piece: int) -> list[int]:
        """The region inputs piece `piece` reads (positions in the region's inputs)."""
        return [s.index for s in self.inputs[piece] if s.kind == "arg"]


def op_name(node: fx.Node) -> str | None:
    """`moe_dispatch` for a `piper::moe_dispatch` call, and so on; None for anything else."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.name.startswith("piper::"):
        return None
    return schema.name[len("piper::"):]


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


class _Results(tuple):
    """The results of a cut dispatch or combine, as the region graph's getitems read them."""


class Builder:
    """Builds the pieces' graphs while walking the region graph once, in order."""

    def __init__(self, gm: fx.GraphModule):
        from torch import fx

        self._fx = fx
        self.gm = gm
        self.graphs: list[fx.Graph] = []
        self.inputs: list[list[Source]] = []
        self.placeholders: list[dict[Source, fx.Node]] = []
        self.outputs: list[list[fx.Node]] = []
        self.exchanges: list[Exchange] = []
        self.new_piece()

    @property
    def piece(self) -> int:
        return len(self.graphs) - 1

    def new_piece(self) -> None:
        self.graphs.append(self._fx.Graph())
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

    def exchange(self, kind: str, inputs, args: tuple = ()) -> int:
        self.exchanges.append(Exchange(kind, tuple(self.source(v) for v in inputs), tuple(args)))
        self.new_piece()
        return len(self.exchanges) - 1

    def finish(self, outputs, size: int) -> Cut:
        pieces = []
        for graph, outs in zip(self.graphs, self.outputs):
            graph.output(tuple(outs))
            pieces.append(self._fx.GraphModule(self.gm, graph))
        uses = Counter(outputs)
        for sources in self.inputs + [e.sources for e in self.exchanges]:
            uses.update(sources)
        # Data the runtime may let go once the exchange has read it (tp_copy's result is its input).
        freeable = frozenset(e.sources[0] for e in self.exchanges
                             if e.op == TP and e.kind != "tp_copy" and uses[e.sources[0]] == 1
                             and self.outputs[e.sources[0].index][e.sources[0].out].op != "placeholder")
        after_piece, readers = self._read_last(outputs)
        return Cut(pieces, self.inputs, self.exchanges, outputs, size, freeable, after_piece, readers)

    def _read_last(self, outputs) -> tuple[dict, dict]:
        """The values passed between pieces that the runtime may let go once the last piece reading
        them has run: a piece's output or a TP exchange's result that no exchange reads and is not a
        region output. (A graph run whole frees them there; kept, every one would stay until the
        pass's backward.) Not tp_copy's result (its input's tensor), nor a MoE exchange's (its
        splits serve the backward), nor a piece's input it hands on as it is."""
        kept = set(outputs) | {src for e in self.exchanges for src in e.sources}
        for piece, outs in enumerate(self.outputs):      # handed on as it is: the same tensor lives on
            handed = {n for n in outs if n.op == "placeholder"}
            kept |= {src for src, n in self.placeholders[piece].items() if n in handed}
        readers: dict[Source, list[int]] = {}
        for piece, sources in enumerate(self.inputs):
            for src in sources:
                readers.setdefault(src, []).append(piece)
        after_piece: dict[int, list[Source]] = {}
        for src, pieces in readers.items():
            if src.kind == "arg" or src in kept:
                continue
            if src.kind == "exchange" and (self.exchanges[src.index].op != TP
                                           or self.exchanges[src.index].kind == "tp_copy"):
                continue
            if src.kind == "piece" and self.outputs[src.index][src.out].op == "placeholder":
                continue
            after_piece.setdefault(pieces[-1], []).append(src)
        return ({p: tuple(v) for p, v in after_piece.items()},
                {src: tuple(readers[src]) for v in after_piece.values() for src in v})


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
    from . import moe_cut

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
