"""What each action of a plan waits for, found through the table's node numbers.

`piper.compiler.plans.project` gives every action the receives and collectives that
feed it by a data edge. Finding them means looking at the source of every edge
of the final DAG (about 390k at 64 stages x 512 microbatches x dp 8): the
table holds them as node numbers, filtered by a table of waitable ops.
"""
from __future__ import annotations

from itertools import compress

from ..ir.dag import COLLECTIVES
from ..ir.table import Table

WAITABLE = frozenset(("RECV",) + COLLECTIVES)


def waits_by_number(table: Table) -> dict[int, list[int]]:
    """Node number -> the receives and collectives feeding it by a data edge, each
    once, in the order of the edges: what an action waits for, nothing else (a
    send completes on its own).

    Only edges from a waitable node are read, picked out by a table of the
    nodes' ops. The table's first `distinct` edges repeat no pair (a receive's
    edges are made once per consumer and microbatch), so those need no check."""
    waitable = bytes(map(WAITABLE.__contains__, table.ops))
    src, dst, kept = table.src, table.dst, table.kept
    found = Feeds()
    feeds_of = found.waits_of
    get, add = feeds_of.get, found.add
    for i in compress(range(len(src)), map(waitable.__getitem__, src)):
        if i < len(kept) and kept[i][2] != "data":
            continue
        if i < table.distinct:
            feeds = get(dst[i])
            if feeds is None:
                feeds_of[dst[i]] = [src[i]]
            else:
                feeds.append(src[i])
        else:
            add(src[i], dst[i])
    return found.waits_of


class Feeds:
    """Node key -> the keys feeding it, each once, in the order first added.

    A node fed by many (an update after one reduce-scatter per backward: 512
    at 512 microbatches) gets a set beside its list, so adding stays O(1)."""

    def __init__(self):
        self.waits_of: dict[str, list[str]] = {}
        self._seen: dict[str, set[str]] = {}

    def add(self, src: str, dst: str) -> None:
        feeds = self.waits_of.get(dst)
        if feeds is None:
            self.waits_of[dst] = [src]
        elif len(feeds) < 8:
            if src not in feeds:
                feeds.append(src)
        else:
            seen = self._seen.get(dst)
            if seen is None:
                seen = self._seen[dst] = set(feeds)
            if src not in seen:
                seen.add(src)
                feeds.append(src)
