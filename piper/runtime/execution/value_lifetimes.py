"""How long a step holds each value it keeps by id (`Executor.values`): a region's output, or
an activation received from the previous stage, until the last action of the plan that reads it.

A value is read in forward only: by the first piece of each region that takes it as an input
(`ForwardActions._args` makes a leaf of it there) and by each SEND that carries it on. What
later needs its data holds it itself: a consumer's autograd graph saves the leaf it read (the
same storage), and its producer's own backward starts from the tensor its pass kept. Held
beyond its last reader, every finished microbatch's outputs sat beside the activations of
those still in flight, until the step's end.
"""
from __future__ import annotations

from ..launch.specs import VALUE


def last_readers(plan, regions, by_value) -> dict[str, tuple[tuple[int, int], ...]]:
    """Action key -> the (value id, microbatch) entries of `Executor.values` it reads last."""
    last: dict[tuple[int, int], str] = {}
    for action in plan:
        node = action.node
        if node.op == "F" and not node.value:           # a region's forward, or its first piece
            for inp in regions[node.region].inputs:
                if inp.kind == VALUE:
                    last[(inp.ref, node.mb)] = action.key
        elif node.op == "SEND" and node.phase == "F":
            last[(by_value[(node.region, node.value)], node.mb)] = action.key
    readers: dict[str, list] = {}
    for entry, key in last.items():
        readers.setdefault(key, []).append(entry)
    return {key: tuple(entries) for key, entries in readers.items()}
