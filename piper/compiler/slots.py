"""How the executor runs the `order` slots that hold more than one item.

Two kinds of slot get special treatment:

- A whole backward written `B(...)` after `split B into BI, BW` reaches the plan
  as a BI and a BW of the same region and microbatch in one slot. The script
  asked for one backward, so the executor runs one autograd pass at the BI
  and makes the BW a no-op: splitting costs a second engine pass and, on CPU,
  about 1.2-1.4x one whole backward.
- An overlapped slot, `[F(...), B(...)]` (DualPipeV's main phase), runs its
  items at once, each in its own lane with the sends that carry its results,
  so one item's waits and communication hide behind the other's compute.
- Items of one microbatch whose regions pass values to each other are one
  chain and share a lane, in plan order: `F(MB=0)` over a stage cut into a
  region per block names all of them.

The compiler lays a slot's items out one after another in the plan, with the
communication they need around them. `span` regroups that stretch of the
plan: receives, prefetches and sends of earlier work are issued before the
lanes start (they depend on nothing the lanes do), each member goes to its
lane followed by the sends of its results, and collectives that follow a
member run after both lanes are done, in plan order. Every replica of a
data-parallel group has the same plan and regroups it the same way, so
collectives are still issued in the same order on all members of a group.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.dag import node_key

@dataclass(frozen=True)
class Span:
    """One overlapped slot, regrouped: plan[start:stop] runs as `before`, the lanes at once, then `after`."""

    start: int
    stop: int
    key: str                  # the members' keys in plan order, joined by "&" (piper.compiler.simulate.SLOT)
    before: tuple
    lanes: tuple[tuple, ...]
    after: tuple


def _pass_of(node) -> tuple[int, int, str]:
    """The item an action belongs to: (region, microbatch, F or B); BI and BW are parts of B."""
    if node.op in ("SEND", "RECV", "ALL_TO_ALL", "TP"):
        return node.region, node.mb, "F" if node.phase == "F" else "B"
    return node.region, node.mb, "F" if node.op == "F" else "B"


def _member(node, members: set[str]) -> bool:
    """Whether the action is part of a slot member: the member itself, or a piece or an expert
    exchange of a pass cut at its all-to-alls (`piper.ir.moe_cut`), which run in the member's lane
    (an exchange on that lane's own expert group)."""
    if node.is_compute:
        return node_key(node.op, node.region, node.mb) in members
    return (node.op in ("ALL_TO_ALL", "TP") and node.phase is not None
            and node_key(node.phase, node.region, node.mb) in members)


def whole_backwards(plan, slots) -> tuple[frozenset, frozenset]:
    """(BI keys to run as one whole backward, the BW keys that become no-ops) from the device's slots.

    `slots` are tuples of compute keys per slot (`piper.frontend.interop.compute_slots`)
    of the device's `plan`.
    """
    nodes = {a.key: a.node for a in plan}
    whole, skip = set(), set()
    for slot in slots:
        halves = {(nodes[k].op, nodes[k].region, nodes[k].mb): k for k in slot}
        for (op, region, mb), key in halves.items():
            if op == "BI" and ("BW", region, mb) in halves:
                whole.add(key)
                skip.add(halves[("BW", region, mb)])
    return frozenset(whole), frozenset(skip)


def _lane_of(items, feeds: dict[int, set]) -> dict[tuple, tuple]:
    """Item -> its lane: items of one microbatch whose regions pass data to each other share one.

    A slot `F(MB=0)` over a stage cut into several regions names a chain of
    forwards; those run one after another, in plan order, in one lane.
    """
    lane = {item: item for item in items}

    def find(item):
        while lane[item] != item:
            item = lane[item]
        return item

    for a in items:
        for b in items:
            if a < b and a[1] == b[1] and (a[0] in feeds.get(b[0], ()) or b[0] in feeds.get(a[0], ())):
                lane[find(b)] = find(a)
    return {item: find(item) for item in items}


def span(plan, members: set[str], units_of: dict[int, set], feeds: dict[int, set] | None = None) -> Span | None:
    """Regroup the stretch of `plan` from the first to the last of `members`; None if it cannot run in lanes.

    `members` are the compute keys of one slot, `units_of` maps a region to
    the parameter units it reads and `feeds` to the regions whose values it
    reads. Items that depend on each other share a lane. The slot runs in
    lanes only when that leaves at least two lanes (a B's BI and BW are one
    item), the lanes read disjoint units (one lane never frees parameters the
    other is using), no other compute falls inside its stretch, and no lane
    waits on a collective: collectives stay on one thread, in an order every
    replica shares.
    """
    at = [i for i, a in enumerate(plan) if _member(a.node, members)]
    if not at:
        return None
    start, stop = at[0], at[-1] + 1
    owner = _lane_of({_pass_of(plan[i].node) for i in at}, feeds or {})
    items: dict[tuple, list] = {}     # lane -> its members, in plan order
    for i in at:
        items.setdefault(owner[_pass_of(plan[i].node)], []).append(plan[i])
    if len(items) < 2:
        return None
    used = [set().union(*(units_of.get(a.node.region, ()) for a in lane)) for lane in items.values()]
    if sum(map(len, used)) != len(set().union(*used)):
        return None
    while stop < len(plan) and plan[stop].node.op == "SEND" and _pass_of(plan[stop].node) in owner:
        stop += 1                     # the last member's sends leave from its lane, not after the others
    lanes: dict[tuple, list] = {lane: [] for lane in items}     # members and their sends, in plan order
    before, after = [], []
    done: set[tuple] = set()          # items whose compute came earlier in the stretch
    busy: set = set()                 # units those items read
    for a in plan[start:stop]:
        node = a.node
        if _member(node, members):
            done.add(_pass_of(node))
            busy |= units_of.get(node.region, set())
            lanes[owner[_pass_of(node)]].append(a)
        elif node.is_compute:
            return None
        elif node.op == "RECV":
            before.append(a)
        elif node.op == "SEND":
            item = _pass_of(node)
            if item in done:
                lanes[owner[item]].append(a)
            else:
                before.append(a)      # its data was made before the slot
        elif node.op == "ALL_GATHER" and node.phase and node.region not in busy:
            before.append(a)          # a prefetch: it needs nothing from the lanes
        else:
            after.append(a)           # after a lane that reads (and may free) the same unit
    waited = {k for lane in lanes.values() for a in lane for k in a.waits}
    if any(a.key in waited for a in after):
        return None
    key = "&".join(a.key for a in plan[start:stop] if a.key in members)
    return Span(start, stop, key, tuple(before), tuple(tuple(v) for v in lanes.values()), tuple(after))


def spans(plan, slots, units_of: dict[int, set], feeds: dict[int, set] | None = None) -> dict[int, Span]:
    """Plan index of each overlapped slot's first action -> its `Span`."""
    out = {}
    for slot in slots:
        s = span(plan, set(slot), units_of, feeds)
        if s is not None:
            out[s.start] = s
    return out


def interleaved(span: Span) -> tuple:
    """An overlapped slot's lanes as one thread's order, switching lanes after each exchange (expert or TP).

        lanes:  F0 X_F0.0 F0.1 X_F0.1 F0.2 SEND_F0 | B1.2 X_B1.1 B1.1 X_B1.0 B1 SEND_B1
        order:  F0 X_F0.0 B1.2 X_B1.1 F0.1 X_F0.1 B1.1 X_B1.0 F0.2 SEND_F0 B1 SEND_B1

    An exchange is issued and not waited for, so the other item's next piece
    runs while its data travels (DualPipe's overlapped forward and backward,
    from the plan's pieces). Each lane keeps its own order; every replica
    derives the same order, so each expert group sees the same collectives in
    the same sequence on every member. Used where the lanes do not run at once.

    The plan (what the simulator verified) runs the first item whole, sends
    included, before the second. So a later item that waits for a message from
    another device (a pipeline receive) keeps its place after the first: that
    message may need one of the first item's sends, which switching would hold
    back. Then the lanes run one after another.
    """
    first, *later = span.lanes
    if any("RECV" in k for lane in later for a in lane for k in a.waits):
        return tuple(a for lane in span.lanes for a in lane)
    parts: list[list[list]] = []
    for lane in span.lanes:
        chunks, chunk = [], []
        for a in lane:
            chunk.append(a)
            if _exchange(a.node):
                chunks.append(chunk)
                chunk = []
        chunks.append(chunk)
        parts.append(chunks)
    out = []
    for i in range(max(map(len, parts))):
        for chunks in parts:
            if i < len(chunks):
                out += chunks[i]
    return tuple(out)


def _exchange(node) -> bool:
    """An exchange between the pieces of a pass cut at its collectives (expert or tensor-parallel)."""
    return node.op in ("ALL_TO_ALL", "TP") and node.value is not None


def exchanges(span: Span) -> bool:
    """Whether any lane of the slot issues exchanges between pieces (`interleaved` changes its order)."""
    return any(_exchange(a.node) for lane in span.lanes for a in lane)
