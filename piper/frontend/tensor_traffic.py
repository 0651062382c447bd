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

    traffic(program)[(3, "F")] == (bytes, collectives)     # region 3's forward, per microbatch

Read once at capture, while the program has its graphs, into `TensorLayout.traffic`, which
graph-less copies of the program (`piper tune`'s cached profiles) keep.
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


def read_traffic(program, n: int) -> dict[tuple[int, str], tuple[float, int]]:
    """`traffic` read off the program's region graphs, for tp size `n`."""
    out: dict[tuple[int, str], tuple[float, int]] = {}
    for region in program.regions:
        if region.graph is None:
            continue
        for node in region.graph.graph.nodes:
            moves = _MOVES.get(op_schema(node))
            if moves is None:
                continue
            sizes = {"in": _nbytes(node.args[0].meta.get("val")), "out": _nbytes(node.meta.get("val"))}
            for phase, move in zip("FB", moves):
                if move is None:
                    continue
                kind, side = move
                size, count = out.get((region.index, phase), (0.0, 0))
                out[(region.index, phase)] = (size + _moved(kind, sizes[side], n), count + 1)
    return out
