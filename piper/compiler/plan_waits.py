"""What each action of a plan waits for, found through the lowered IR's integer edge ids.

`piper.compiler.plans.project` gives every action the receives and collectives that
feed it by a data edge. Finding them means looking at the source of every edge
of the final IR (about 390k at 64 stages x 512 microbatches x dp 8). The final
IR's edges are the lowered IR's (whose ends `add_transfers` handed on as
positions) followed by the few the collectives and tied-weight exchanges add,
so the lowered part is filtered by a table of waitable positions instead of a
look-up of each source's key.
"""
from __future__ import annotations

from itertools import compress
from operator import itemgetter

from ..ir.dag import COLLECTIVES, IR, Node

WAITABLE = frozenset(("RECV",) + COLLECTIVES)
_OP = itemgetter(0)
_DIGITS = "0123456789"
_WAITABLE_TAILS = ("RECV", "ALL_", "REDUCE_SCATTER")     # a token's op after its region: RECV_..., ALL_GATHER...


def waits_after_lowering(final: IR, order: list[Node], lowered: IR) -> dict[str, list[str]] | None:
    """`piper.compiler.plans._waits_of(final, order)`, when `final`'s edges are `lowered`'s
    followed by new ones (else None: the caller then looks every edge up by key).

    `_waits_of` counts a source only if it is a node of `order`; here the caller
    (`compile_ir`) vouches that `order` holds every lowered node and every new
    edge's source: `schedule` orders all of them, and the passes after it only
    insert nodes (with the edges that reach them) and move them. Whether a new
    edge's source is a receive or a collective, its token says (`0RECV_...`,
    `3ALL_GATHER_F2`, `1REDUCE_SCATTER`): the op follows the region."""
    edges, n = lowered.edges, len(lowered.edges)
    if not lowered.keys_distinct() or len(order) < len(lowered.nodes) or final.edges[:n] != edges:
        return None
    src_ids, _ = lowered.edge_ids()
    waitable = bytes(map(WAITABLE.__contains__, map(_OP, lowered.nodes)))
    found = Feeds()
    # The IR's edges are distinct, so no (src, dst) data pair comes twice: `Feeds.add`'s
    # check for a repeat is not needed for the lowered edges (130k at 64 x 512).
    feeds_of = found.waits_of
    get = feeds_of.get
    for src, dst, kind, _ in compress(edges, map(waitable.__getitem__, src_ids)):
        if kind == "data":
            feeds = get(dst)
            if feeds is None:
                feeds_of[dst] = [src]
            else:
                feeds.append(src)
    add = found.add
    for src, dst, kind, _ in final.edges[n:]:
        if kind == "data" and src.lstrip(_DIGITS).startswith(_WAITABLE_TAILS):
            add(src, dst)
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
