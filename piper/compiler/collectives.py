"""Data-parallel and ZeRO collectives, placed into the global order once it is known.

Where a reduction or a ZeRO-3 gather goes depends on what runs around it on
its devices, so these are added after `schedule`: each joins the lowered
DAG's `Table` as a node, with the edges that make its consumers wait for it.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import compress
from operator import itemgetter

from ..ir.dag import IR, Edge, Node, data_edge
from ..ir.table import Table
from ..ir.tied import units_used

_tuple_new = tuple.__new__
_KEY = itemgetter(8)
_GRAD_OPS = ("B", "BW")
_FIRST = itemgetter(0)


def _first_position(seq: list) -> int:
    return seq[0][0]


def _units_used(ir: IR) -> dict[int, tuple[int, ...]]:
    """Region -> the owner regions whose parameters it reads (a tied parameter's copy on its devices)."""
    return units_used(ir)


def _by_group(computes, groups: dict[int, tuple]) -> dict[tuple, list[tuple[int, Node]]]:
    """Device group -> its computes (but updates) with their positions in the global order;
    the groups in the order of their first compute."""
    lists: dict[tuple, list] = {}
    of_region = {r: lists.setdefault(g, []) for r, g in groups.items()}     # regions of a group share its list
    for i, n in computes:
        if n[0] != "UPD":
            of_region[n[1]].append((i, n))
    return {seq[0][1][6]: seq for seq in sorted((seq for seq in lists.values() if seq), key=_first_position)}


def _gradient_runs(by_group, units) -> dict[int, list[list[tuple[int, Node]]]]:
    """Unit -> its runs: backwards into the unit that follow each other on its devices.

    Each run gets one reduce-scatter: a run's gradients add up in one buffer,
    and the compute after it gives the reduce-scatter something to overlap
    with before the unit's next backward needs a new buffer.
    """
    runs: dict[int, list] = defaultdict(list)
    for seq in by_group.values():
        last: dict[int, int] = {}            # unit -> index in seq of its latest backward
        for j, (i, n) in enumerate(seq):
            if n[0] not in _GRAD_OPS:
                continue
            for u in units[n[1]]:
                if last.get(u) == j - 1:
                    runs[u][-1].append((i, n))
                else:
                    runs[u].append([(i, n)])
                last[u] = j
    return runs


def add_collectives(ir: IR, order: list[Node], zero: int,
                    computes_at: list[int] | None = None) -> tuple[list[Node], list[Edge], dict[str, tuple]]:
    """`place_collectives` on an order of nodes: the new order, its extra edges, and per
    compute key the units to release (if any)."""
    table = Table.of_nodes(ir, order, strict=False)
    if len(table.nodes) != len(order):
        raise AssertionError("an order holds each node once")
    numbers, (src, dst), release = place_collectives(table, list(range(len(order))), zero, computes_at)
    keys = list(map(_KEY, table.nodes))
    return (list(map(table.nodes.__getitem__, numbers)),
            list(map(data_edge, map(keys.__getitem__, src), map(keys.__getitem__, dst))),
            {keys[k]: units for k, units in release.items()})


def place_collectives(table: Table, order: list[int], zero: int, computes_at: list[int] | None = None
                      ) -> tuple[list[int], tuple[list[int], list[int]], dict[int, tuple]]:
    """Place DP/ZeRO collectives into the global order.

    - gradients of each parameter unit (the parameters a region owns): one
      ALL_REDUCE (replicated or ZeRO-1) right after the last compute that
      produces them, before UPD; under ZeRO-2/3 a REDUCE_SCATTER_<pass><mb>
      after each run of backwards into the unit (`_gradient_runs`; one plain
      REDUCE_SCATTER when there is one run);
    - ZeRO-1/2: ALL_GATHER of the updated shards right after UPD;
    - ZeRO-3: ALL_GATHER_<pass><mb> before a compute that needs a unit not
      already gathered, issued one compute early so it overlaps; the unit is
      released after the last of a run of computes that use it.
    The collectives join `table`; returns the new order (node numbers), the extra
    edges' ends, and per compute the units to release (if any). `computes_at`: the
    positions of the computes in `order`, if the caller has them (`schedule_table`).
    """
    ir = table.ir
    units = _units_used(ir)
    groups = {r.index: ir.devices_of(r.index) for r in ir.regions}
    owners = [r.index for r in ir.regions if r.owned and len(groups[r.index]) > 1]
    before: dict[int, list[int]] = defaultdict(list)   # insert before position i
    after: dict[int, list[int]] = defaultdict(list)    # insert after position i
    edges: tuple[list[int], list[int]] = ([], [])
    release: dict[int, tuple] = {}
    at = computes_at if computes_at is not None else table.computes(order)
    computes = list(zip(at, map(table.nodes.__getitem__, map(order.__getitem__, at))))
    by_group = _by_group(computes, groups) if zero >= 2 else {}
    reductions = _reductions(order, computes, units, owners, _gradient_runs(by_group, units) if zero >= 2 else {})
    ops, made, number = table.ops, [], len(table.nodes)
    updates = compress(at, map("UPD".__eq__, map(ops.__getitem__, map(order.__getitem__, at))))
    update = {table.nodes[order[i]][1]: (i, order[i]) for i in updates}
    for u in owners:
        upd = update[u][1]
        for pos, last, producers in reductions[u]:      # last: the run's last compute (None: the step's)
            if zero <= 1:
                red = Node("ALL_REDUCE", u, devices=groups[u])
            elif last is None:
                red = Node("REDUCE_SCATTER", u, devices=groups[u])
            else:       # Node("REDUCE_SCATTER", u, last.mb, last.op, devices=groups[u]), made directly
                red = _tuple_new(Node, ("REDUCE_SCATTER", u, last[2], last[0], None, None, groups[u], None,
                                        f"{u}REDUCE_SCATTER_{last[0]}{last[2]}"))
            while pos + 1 < len(order) and ops[order[pos + 1]] == "SEND":
                pos += 1   # let the gradient sends that unblock other stages go first
            k = number + len(made)
            made.append(red)
            after[pos].append(k)
            edges[0].append(k)
            edges[1].append(upd)
            edges[0].extend(producers)
            edges[1].extend([k] * len(producers))
        if zero in (1, 2):
            after[update[u][0]].append(number + len(made))
            edges[0].append(upd)
            edges[1].append(number + len(made))
            made.append(Node("ALL_GATHER", u, devices=groups[u]))
    table.extend(made)
    if zero == 3:
        _gathers(table, order, by_group, units, set(owners), groups, before, edges, release)
    out: list[int] = []
    done = 0
    for i in sorted(before.keys() | after.keys()):
        out += order[done:i]
        out += before.get(i, ())
        out.append(order[i])
        out += after.get(i, ())
        done = i + 1
    out += order[done:]
    return out, edges, release


def _reductions(order, computes, units, owners, runs) -> dict[int, list[tuple]]:
    """Unit -> its gradient reductions: (position of the compute it follows, that compute or
    None for the step's last, the numbers of the computes it reduces)."""
    out = {}
    alone = [u for u in owners if len(runs.get(u, ())) <= 1]
    for u in owners:
        if len(runs.get(u, ())) > 1:
            # ZeRO-2/3 hold 1/d of the gradients during the step as well: the
            # gradients of each run of backwards into a unit are reduce-scattered
            # after it, and the shards add up (FSDP's and DeepSpeed's way).
            out[u] = [(run[-1][0], run[-1][1], list(map(order.__getitem__, map(_FIRST, run)))) for run in runs[u]]
    if alone:       # one reduction after the step's last gradient, of every compute that makes one
        last_grad: dict[int, int] = {}
        grad_producers: dict[int, list[int]] = defaultdict(list)
        for i, n in computes:
            if n[0] in _GRAD_OPS:
                for u in units[n[1]]:
                    last_grad[u] = i
                    grad_producers[u].append(order[i])
        for u in alone:
            out[u] = [(last_grad[u], None, grad_producers[u])]
    return {u: out[u] for u in owners}


def _gathers(table: Table, order: list[int], by_group, units, shared, groups, before, edges, release) -> None:
    """ZeRO-3: per device group, the computes in order: gather a unit when the
    previous compute on these devices did not use it; release it when the next will not.

    What a compute gathers depends only on its region and the previous
    compute's (what it releases, on the next one's): both are worked out once
    per pair of regions."""
    need = {r: tuple(u for u in us if u in shared) for r, us in units.items()}
    gathered: dict[tuple, tuple[int, ...]] = {}     # (region, previous region or None) -> units
    released: dict[tuple, tuple[int, ...]] = {}     # (region, next region or None) -> units
    made = []
    number = len(table.nodes)
    for g, seq in by_group.items():
        last = len(seq) - 1
        prev_region = None
        for j, (i, n) in enumerate(seq):
            region = n[1]
            next_region = seq[j + 1][1][1] if j < last else None
            if region == prev_region == next_region:     # the same units before, now and after: nothing to do
                continue
            pair = (region, prev_region)
            fresh = gathered.get(pair)
            if fresh is None:
                fresh = gathered[pair] = tuple(u for u in need[region] if prev_region is None
                                               or u not in units[prev_region])
            if fresh:
                # Prefetch: issue before the previous compute on these devices.
                where = before[seq[j - 1][0] if j > 0 else i]
                for u in fresh:
                    where.append(number + len(made))
                    edges[0].append(number + len(made))
                    edges[1].append(order[i])
                    made.append(Node("ALL_GATHER", u, n.mb, n.op, devices=groups[u]))
            pair = (region, next_region)
            free = released.get(pair)
            if free is None:
                free = released[pair] = tuple(u for u in need[region] if next_region is None
                                              or u not in units[next_region])
            if free:        # most computes release nothing: the dict stays small for project's look-ups
                release[order[i]] = free
            prev_region = region
    table.extend(made)
