"""The global order: one topological order of the lowered DAG's nodes.

Every device's plan is a projection of this order (`piper.compiler.plans.project`),
so its choices are the plans' own: what no `order` statement constrains runs in
GPipe order, communication as soon as it is ready. A cycle is reported with the
statements that close it, or, through several devices, as a deadlock grid.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from itertools import compress
from operator import itemgetter, not_

from ..diagnostics import Label, error
from ..ir.dag import COMPUTE, IR, Edge, Node
from ..ir.table import Table

_PHASE = {"F": 0, "B": 1, "BI": 1, "BW": 2, "UPD": 3}
_COMPUTE = frozenset(COMPUTE)


def _priority(node: Node) -> tuple:
    """GPipe order for what no `order` constrains: forwards by microbatch, then backwards.

    Communication goes first whenever it is ready: a send right after its
    producer, a receive right after its send (so receives between two devices
    come in the order of their sends).
    """
    if not node.is_compute:
        return (0,)
    mb = node.mb if node.mb is not None else 1 << 30
    region = node.region if node.op == "F" else -node.region
    return (1, _PHASE[node.op] if node.op != "UPD" else 9, mb, region, node.op)


def schedule(ir: IR) -> list[Node]:
    """A topological order of all nodes over data and temporal edges.

    Among the nodes ready at each step the one first by (`_priority`, key)
    runs. A cycle means the `order` statements contradict the data flow (or
    each other); the error names the order statements whose edges close it.
    """
    return schedule_with_computes(ir)[0]


def schedule_with_computes(ir: IR) -> tuple[list[Node], list[int]]:
    """`schedule(ir)`, and the positions of the computes in it."""
    table = Table.of_nodes(ir, ir.nodes)
    order, computes_at = schedule_table(table)
    return list(map(table.nodes.__getitem__, order)), computes_at


def schedule_table(table: Table) -> tuple[list[int], list[int]]:
    """`schedule` of a table's nodes: their numbers in order, and the positions of
    the computes in it (`add_collectives` reads only those)."""
    ops = table.ops
    total = len(ops)
    # Communication (priority (0,)) goes before any compute, so the ready nodes
    # wait in two heaps: communication by (key, number), computes by one int
    # that orders as (priority, key) (`_compute_entries`) and holds the number.
    # A communication's key is read only if it waits in its heap.
    is_compute = list(map(_COMPUTE.__contains__, ops))
    entry = _entries(table, list(compress(range(total), is_compute)))
    succ: list[list[int]] = [[] for _ in range(total)]
    indeg = [0] * total
    for src, dst in zip(table.src, table.dst):
        succ[src].append(dst)
        indeg[dst] += 1
    key = table.key
    starts = list(compress(range(total), map(not_, indeg)))
    ready_comm = [(key(i), i) for i in starts if not is_compute[i]]
    ready_compute = [entry[i] for i in starts if is_compute[i]]
    heapq.heapify(ready_comm)
    heapq.heapify(ready_compute)
    pop, push = heapq.heappop, heapq.heappush
    out = []
    add = out.append
    computes_at = []        # positions in `out`
    # `alone`: a communication that became ready while no other was (a compute's one
    # send, a send's receive: most of them). It is the least ready one, so it runs
    # next without going through the heap; a second one sends both to the heap.
    alone = None
    while True:
        if alone is not None:
            i, alone = alone, None
        elif ready_comm:
            i = pop(ready_comm)[1]
        elif ready_compute:
            i = pop(ready_compute) % total
            computes_at.append(len(out))
        else:
            break
        add(i)
        for j in succ[i]:
            indeg[j] -= 1
            if not indeg[j]:
                if is_compute[j]:
                    push(ready_compute, entry[j])
                elif alone is None and not ready_comm:
                    alone = j
                else:
                    if alone is not None:
                        push(ready_comm, (key(alone), alone))
                        alone = None
                    push(ready_comm, (key(j), j))
    if len(out) != total:
        raise _cycle_error(table.lowered_ir(), {key(i) for i, d in enumerate(indeg) if d > 0})
    return out, computes_at


_OP_RANK = {op: rank for rank, op in enumerate(sorted(_PHASE))}     # ops as strings compare


def _entries(table: Table, at: list[int]) -> list:
    """Each node's heap entry (`_compute_entries`; None for communication).

    Where the table knows each pass's nodes by microbatch (`Table.passes`) and the
    other computes are updates, a pass's entries are one sum per microbatch, made
    without reading its nodes: at 64 x 512, 65k nodes spread over the heap."""
    total, nodes, passes = len(table.ops), table.nodes, table.passes
    entry: list = [None] * total
    updates = list(compress(at, map("UPD".__eq__, map(table.ops.__getitem__, at)))) if passes else []
    if passes and sum(len(p) - p.count(None) for p in passes.values()) + len(updates) == len(at):
        update_nodes = list(map(nodes.__getitem__, updates))
        top = max([_last_microbatch(p) for p in passes.values()]
                  + [n[2] for n in update_nodes if n[2] is not None] + [0]) + 1
        regions = max([r for _, r in passes] + [n[1] for n in update_nodes], default=0) + 1
        for (op, region), positions in passes.items():
            first, step = _packed(op, region, 0, top, regions), (2 * regions + 1) * 5
            made = [(first + mb * step) * total + p for mb, p in enumerate(positions) if p is not None]
            if positions and None not in positions and positions == list(range(positions[0], positions[0] + len(made))):
                entry[positions[0]:positions[0] + len(made)] = made
            else:
                for p, e in zip(filter(None.__ne__, positions), made):
                    entry[p] = e
        at, computes = updates, update_nodes
    else:
        computes = list(map(nodes.__getitem__, at))
        top = max((n.mb for n in computes if n.mb is not None), default=0) + 1
        regions = max((n.region for n in computes), default=0) + 1
    for i, e in zip(at, _compute_entries(computes, at, total, top, regions)):
        entry[i] = e
    return entry


def _last_microbatch(positions: list) -> int:
    for mb in range(len(positions) - 1, -1, -1):
        if positions[mb] is not None:
            return mb
    return 0


def _packed(op: str, region: int, mb: int, top: int, regions: int) -> int:
    """`_priority` of a compute as one int: `top` is past the last microbatch (an update's),
    `regions` past the last region."""
    phase = _PHASE[op] if op != "UPD" else 9
    return ((phase * (top + 1) + mb) * (2 * regions + 1) + (region if op == "F" else -region) + regions) * 5 \
        + _OP_RANK[op]


def _compute_entries(computes: list[Node], numbers: list[int], total: int, top: int | None = None,
                     regions: int | None = None) -> list[int]:
    """The heap entry of each compute, with its number: an int that orders
    as `(_priority(n), n.key)` and then holds the number (`entry % total`).

    A compute is one (op, region, mb), so its priority never ties with
    another's and the key is never consulted; the fields are packed into one
    int (an update's missing microbatch as one past the last) so the heap
    compares ints, not tuples of five. `top`, `regions`: one past the last
    microbatch and region, if the caller knows them."""
    if top is None:
        top = max((n.mb for n in computes if n.mb is not None), default=0) + 1
    if regions is None:
        regions = max((n.region for n in computes), default=0) + 1
    return [_packed(op, region, top if mb is None else mb, top, regions) * total + i
            for i, (op, region, mb) in zip(numbers, map(_OP_REGION_MB, computes))]


_OP_REGION_MB = itemgetter(0, 1, 2)


def _cycle_error(ir: IR, stuck: set[str]):
    """Find one cycle among the stuck nodes and explain it with the order lines that close it."""
    # Every stuck node has a stuck predecessor, so walking predecessors must repeat a node.
    pred = defaultdict(list)
    for e in ir.edges:
        if e.src in stuck and e.dst in stuck:
            pred[e.dst].append(e)
    path, seen = [], {}
    node = min(stuck)
    while node not in seen:
        seen[node] = len(path)
        edge = pred[node][0]
        path.append(edge)
        node = edge.src
    cycle = list(reversed(path[seen[node]:]))
    index = ir.index()
    if len({index[e.src].devices for e in cycle}) > 1:
        deadlock = _deadlock_error(ir, cycle)
        if deadlock is not None:
            return deadlock
    text = " -> ".join([e.src for e in cycle] + [cycle[0].src])
    temporal = [e for e in cycle if e.kind == "temporal"]
    span = temporal[0].span if temporal else None
    labels = tuple(Label(e.span, f"orders {e.src} before {e.dst}") for e in temporal[1:] if e.span)
    data = [f"{e.src} -> {e.dst}" for e in cycle if e.kind == "data"]
    return error("order-cycle", f"the order contradicts the data flow: {text}", span=span, labels=labels,
                 notes=(f"data edges in the cycle: {', '.join(data) or 'none'}",),
                 hint="a forward must run before its backward and a region after the one that feeds it; "
                      "reorder the slots so every microbatch's inputs come first")


def _deadlock_error(ir: IR, cycle: list[Edge]):
    """A cycle through several devices is a deadlock: run each device's own
    order until every device waits on another, and show where as a step x
    device grid. None if some device's order is cyclic on its own."""
    index = ir.index()
    compute = [n for n in ir.nodes if n.is_compute and n.op != "UPD"]
    groups = sorted({n.devices for n in compute})
    # Cross-device dependencies run compute -> SEND -> RECV -> compute.
    feeds: dict[str, list[str]] = defaultdict(list)      # SEND key -> producing computes
    preds: dict[str, list[str]] = defaultdict(list)       # compute -> computes it needs, any device
    needs: dict[str, list[str]] = defaultdict(list)       # the same, less what only an order asks
    for e in ir.edges:
        src, dst = index[e.src], index[e.dst]
        if dst.op == "SEND" and src.is_compute:
            feeds[dst.key].append(src.key)
    for e in ir.edges:
        src, dst = index[e.src], index[e.dst]
        if not dst.is_compute:
            continue
        if src.is_compute:
            preds[dst.key].append(src.key)
            if e.kind != "temporal":
                needs[dst.key].append(src.key)
        elif src.op == "RECV":
            send = Node("SEND", src.peer, src.mb, src.phase, src.value, src.region).key
            preds[dst.key] += feeds.get(send, [])
            needs[dst.key] += feeds.get(send, [])
    local_orders = {}
    for g in groups:
        mine = {n.key for n in compute if n.devices == g}
        indeg = {k: sum(1 for p in preds[k] if p in mine) for k in mine}
        succ = defaultdict(list)
        for k in mine:
            for p in preds[k]:
                if p in mine:
                    succ[p].append(k)
        heap = [(_priority(index[k]), k) for k, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        seq = []
        while heap:
            _, k = heapq.heappop(heap)
            seq.append(k)
            for nxt in succ[k]:
                indeg[nxt] -= 1
                if indeg[nxt] == 0:
                    heapq.heappush(heap, (_priority(index[nxt]), nxt))
        if len(seq) != len(mine):
            return None
        local_orders[g] = seq
    done, pos = _run_orders(local_orders, preds)
    rank_of = {g: g[0] for g in groups}
    width = max(len(k) for k in index) + 3
    lines = ["step  " + "".join(f"rank {rank_of[g]}".ljust(width) for g in groups)]
    for i in range(max(len(s) for s in local_orders.values())):
        cells = []
        for g in groups:
            seq = local_orders[g]
            cell = "" if i >= len(seq) else seq[i] if i < pos[g] else "*" + seq[i] if i == pos[g] else "."
            cells.append(cell.ljust(width))
        lines.append(f"{i:<6}" + "".join(cells))
    waits = []
    for g in groups:
        if pos[g] < len(local_orders[g]):
            k = local_orders[g][pos[g]]
            missing = [p for p in preds[k] if p not in done]
            owner = {p: rank_of[index[p].devices] for p in missing}
            waits.append(f"rank {rank_of[g]} waits at {k} for " + ", ".join(f"{p} (rank {owner[p]})" for p in missing))
    temporal = [e for e in cycle if e.kind == "temporal"]
    span = temporal[0].span if temporal else None
    hint = ("the devices' orders wait on each other; reorder the slots so each device's sends come before the "
            "receives that unblock the other")
    swap = _swap_that_runs(local_orders, needs, pos, [(e.src, e.dst) for e in temporal], index)
    if swap is None:
        # No one swap of two items runs through: name the other orders in the cycle, but no pair.
        labels = tuple(Label(e.span, "this order is part of the cycle") for e in temporal[1:]
                       if e.span and e.span != span)
        labels = tuple(dict.fromkeys(labels))
    else:
        g, a, b = swap
        where = next((e.span for e in ir.edges if e.kind == "temporal" and e.span is not None
                      and (e.src in (a, b) or e.dst in (a, b))), None)
        labels = (Label(where, f"swapping {a} and {b} here removes the deadlock"),) \
            if where is not None and where != span else ()       # the hint says it of the primary order
        hint = (f"swap {a} and {b} in rank {rank_of[g]}'s order: with that one change every device runs "
                "its order through; or " + hint[hint.index("reorder"):])
    return error("deadlock", "the schedule deadlocks: " + "; ".join(waits), span=span, labels=labels,
                 notes=("`*` marks where each device waits, `.` what it never reaches:\n" + "\n".join(lines),),
                 hint=hint)


def _run_orders(orders: dict, needs: dict) -> tuple[set[str], dict]:
    """Run each device's order in turn while what its next item needs is done: (done, position per device)."""
    done: set[str] = set()
    pos = {g: 0 for g in orders}
    progress = True
    while progress:
        progress = False
        for g, seq in orders.items():
            while pos[g] < len(seq) and all(p in done for p in needs[seq[pos[g]]]):
                done.add(seq[pos[g]])
                pos[g] += 1
                progress = True
    return done, pos


# Each candidate swap reruns every device's order: bound the search for long schedules.
MAX_SWAPS_TRIED = 400


def _swap_that_runs(orders: dict, needs: dict, stuck_at: dict, cycle_pairs, index):
    """One swap of two items in one device's order after which every order runs through, as
    `(device, a, b)`, or None. Tried first: the pairs the cycle's order edges name; then each
    item a waiting device is stuck at with each later item of its order. `needs` leaves out the
    edges orders made, so a swapped order is checked against the data flow and the other
    devices alone."""
    device_of = {k: g for g, seq in orders.items() for k in seq}
    candidates = [(device_of[a], a, b) for a, b in cycle_pairs
                  if a in device_of and device_of.get(b) == device_of[a]]
    for g, seq in orders.items():
        at = stuck_at[g]
        candidates += [(g, seq[at], later) for later in seq[at + 1:]] if at < len(seq) else []
    for g, a, b in list(dict.fromkeys(candidates))[:MAX_SWAPS_TRIED]:
        seq = list(orders[g])
        i, j = seq.index(a), seq.index(b)
        seq[i], seq[j] = seq[j], seq[i]
        _, pos = _run_orders({**orders, g: seq}, needs)
        if all(pos[h] == len(s) for h, s in {**orders, g: seq}.items()):
            return g, a, b
    return None
