"""The parts a region graph is cut into (`piper.ir.region_cut`): where each piece's inputs come
from (`Source`), the exchanges between the pieces (`Exchange`), the cut itself (`Cut`), and the
`Builder` that makes the pieces' graphs in one walk over the region graph. Shared by the cut at
TP collectives and the MoE layers' halves (`piper.ir.moe_cut`).

Pure fx, imported only where a graph is cut: `piper check --regions` plans without torch.
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import fx

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
