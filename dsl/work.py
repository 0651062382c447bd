"""What one statement costs when it runs: its own expression terms, tags and slot items.

`Limits.steps` counts statements and loop turns; a statement may still hold a
hundred-term expression or a slot line of thousands of items, so a loop of a
few lines can ask for billions of evaluations. `Limits.work` bounds the sum of
these weights, so the time of a run is bounded whatever its lines hold.

    >>> from piper.dsl.syntax import parse
    >>> weight(parse("let x = 1 + 2\\n").statements[0])     # the let, its name, +, 1, 2
    5
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass

_BLOCKS = frozenset(("body", "then", "orelse", "span"))   # a block's statements are weighed when they run


def weight(node) -> int:
    """The syntax nodes of `node` outside its blocks: 1 for a bare statement."""
    if isinstance(node, tuple):
        return sum(map(weight, node))
    if not is_dataclass(node):
        return 0
    return 1 + sum(weight(getattr(node, f.name)) for f in fields(node) if f.name not in _BLOCKS)


class Weights:
    """Each statement's weight, computed once per run (statements are keyed by id: the
    run's modules keep them alive)."""

    def __init__(self):
        self._by_id: dict[int, int] = {}

    def __call__(self, stmt) -> int:
        w = self._by_id.get(id(stmt))
        if w is None:
            w = self._by_id[id(stmt)] = weight(stmt)
        return w
