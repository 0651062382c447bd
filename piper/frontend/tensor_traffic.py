"""The collectives tensor parallelism puts in each region, read off its graph: which passes
issue them, how many, and the bytes each device moves, for the plans' `TP` nodes and the costs.

Under `shard columns/rows/vocab ... over tp` a region graph holds `piper::tp_*` nodes
(`piper.tensor_ops`); what each moves, on n devices along tp (ring collectives; Gloo has no
reduce-scatter along a dimension, so the runtime runs it as an all-reduce and keeps its chunk):

    tp_copy          forward 0                     backward all-reduce of x
    tp_reduce        forward all-reduce of x       backward 0
    tp_gather        forward all-gather (full)     backward reduce-scatter (an all-reduce of full)
    tp_reduce_scatter forward all-reduce of full   backward all-gather (full)
    tp_collect       forward all-gather (full)     backward 0
    tp_max           forward all-reduce of x       backward 0
    tp_split         forward 0 (a local slice)     backward all-gather (full)

    traffic(program)[(3, "F")] == (bytes, collectives)     # region 3's forward, per microbatch

Read once at capture, while the program has its graphs, into `TensorLayout.exchanges` (per op)
and `TensorLayout.traffic` (per pass), which graph-less copies of the program (`piper tune`'s
cached profiles) keep.
"""
from __future__ import annotations

from .captured import op_schema

# op -> ((forward kind, size from), (backward kind, size from)); kind: "reduce" (all-reduce) or "gather".
_MOVES = {
    "piper::tp_copy": (None, ("reduce", "in")),
    "piper::tp_reduce": (("reduce", "in"), None),
    "piper::tp_gather": (("gather", "out"), ("reduce", "out")),
    "piper::tp_reduce_scatter": (("reduce", "in"), ("gather", "in")),
    "piper::tp_collect": (("gather", "out"), None),
    "piper::tp_max": (("reduce", "in"), None),
    "piper::tp_split": (None, ("gather", "in")),
}


def _nbytes(value) -> int:
    if value is None or not hasattr(value, "shape"):
        return 0
    n = 1
    for s in value.shape:
        n *= int(s)
    return n * value.element_size()


def _moved(kind: str, size: int, n: int) -> float:
    return size * (2 * (n - 1) / n if kind == "reduce" else (n - 1) / n)


def traffic(program) -> dict[tuple[int, str], tuple[float, int]]:
    """(region, "F" | "B") -> (bytes one device moves, collectives issued) per microbatch, for the
    regions whose graphs hold TP collectives ({} without tensor parallelism)."""
    tensor = getattr(program, "tensor", None)
    if tensor is None:
        return {}
    return dict(tensor.traffic)


def exchange_bytes(program) -> dict[int, tuple[tuple, ...]]:
    """Region -> (forward bytes, backward bytes) one device moves in each of its TP ops, in graph
    order (None: that direction issues no collective): what each `TP` exchange of a region cut
    at them moves (`piper.ir.region_cut`)."""
    tensor = getattr(program, "tensor", None)
    return dict(tensor.exchanges) if tensor is not None else {}


def read_moves(program, n: int) -> dict[int, tuple[tuple, ...]]:
    """`exchange_bytes` read off the program's region graphs, for tp size `n`."""
    out: dict[int, tuple[tuple[float, float], ...]] = {}
    for region in program.regions:
        if region.graph is None:
            continue
        moves = []
        for node in region.graph.graph.nodes:
            move = _MOVES.get(op_schema(node))
            if move is None:
                continue
            sizes = {"in": _nbytes(node.args[0].meta.get("val")), "out": _nbytes(node.meta.get("val"))}
            moves.append(tuple(None if m is None else _moved(m[0], sizes[m[1]], n) for m in move))
        if moves:
            out[region.index] = tuple(moves)
    return out


def read_traffic(moves: dict[int, tuple[tuple, ...]]) -> dict[tuple[int, str], tuple[float, int]]:
    """`traffic` from `read_moves`' per-op bytes: each pass's sum and count of collectives."""
    out: dict[tuple[int, str], tuple[float, int]] = {}
    for region, per_op in moves.items():
        for i, phase in enumerate("FB"):
            issued = [m[i] for m in per_op if m[i] is not None]
            if issued:
                out[(region, phase)] = (sum(issued), len(issued))
    return out
