"""Data-parallel and ZeRO collectives, placed into the global order once it is known.

Where a reduction or a ZeRO-3 gather goes depends on what runs around it on
its devices, so these are added after `schedule`: each joins the lowered
DAG's `Table` as a node, with the edges that make its consumers wait for it.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import chain, compress, repeat
from operator import itemgetter

from ..ir.dag import IR, Edge, Node, data_edge
from ..ir.table import Table
from ..ir.tied import units_used

_tuple_new = tuple.__new__
_KEY = itemgetter(8)
_GRAD_OPS = ("B", "BW")
_FIRST, _LAST = itemgetter(0), itemgetter(-1)
_OP, _REGION = itemgetter(0), itemgetter(1)


def _units_used(ir: IR) -> dict[int, tuple[int, ...]]:
    """Region -> the owner regions whose parameters it reads (a tied parameter's copy on its devices)."""
    return units_used(ir)


def _by_group(ops: list[str], regions: list[int], groups: dict[int, tuple]) -> dict[tuple, list[int]]:
    """Device group -> its computes but updates, as indices into the computes in global
    order; the groups in the order of their first compute."""
    lists: dict[tuple, list] = {}
    of_region = {r: lists.setdefault(g, []) for r, g in groups.items()}     # regions of a group share its list
    for j in compress(range(len(ops)), map("UPD".__ne__, ops)):
        of_region[regions[j]].append(j)
    return {groups[regions[seq[0]]]: seq for seq in sorted((seq for seq in lists.values() if seq), key=_FIRST)}


def _gradient_runs(by_group: dict[tuple, list[int]], ops: list[str], regions: list[int],
                   units: dict[int, tuple]) -> dict[int, list[list[int]]]:
    """Unit -> its runs: backwards into the unit that follow each other on its devices.

    Each run gets one reduce-scatter: a run's gradients add up in one buffer,
    and the compute after it gives the reduce-scatter something to overlap
    with before the unit's next backward needs a new buffer.
    """
    runs: dict[int, list] = defaultdict(list)
    for seq in by_group.values():
        last: dict[int, int] = {}            # unit -> index in seq of its latest backward
        for i, j in enumerate(seq):
            if ops[j] not in _GRAD_OPS:
                continue
            for u in units[regions[j]]:
                if last.get(u) == i - 1:
                    runs[u][-1].append(j)
                else:
                    runs[u].append([j])
                last[u] = i
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
    computes = _Computes(table, order, computes_at if computes_at is not None else table.computes(order))
    ops, regions = computes.ops, computes.regions
    by_group = _by_group(ops, regions, groups) if zero >= 2 else {}
    runs = _gradient_runs(by_group, ops, regions, units) if zero >= 2 else {}
    updates = {regions[j]: j for j in compress(range(len(ops)), map("UPD".__eq__, ops))}
    made: list[Node] = []
    grads_into: dict = {u: [] for u in owners}      # unit -> the computes that make a gradient of it, in order
    for j in range(len(ops)):
        if ops[j] in _GRAD_OPS:
            for u in units[regions[j]]:
                if u in grads_into:
                    grads_into[u].append(j)
    for u in owners:
        if len(runs.get(u, ())) > 1:
            # ZeRO-2/3 hold 1/d of the gradients during the step as well: the
            # gradients of each run of backwards into a unit are reduce-scattered
            # after it, and the shards add up (FSDP's and DeepSpeed's way).
            lasts = list(map(_LAST, runs[u]))
            reduced = [_tuple_new(Node, ("REDUCE_SCATTER", u, n[2], n[0], None, None, groups[u], None,
                                         f"{u}REDUCE_SCATTER_{n[0]}{n[2]}"))
                       for n in map(computes.nodes.__getitem__, lasts)]
            _reduce(computes, reduced, lasts, runs[u], updates[u], after, edges, table, made)
        else:       # one reduction after the step's last gradient, of every compute that makes one
            producers = grads_into[u]
            red = Node("ALL_REDUCE" if zero <= 1 else "REDUCE_SCATTER", u, devices=groups[u])
            _reduce(computes, [red], [producers[-1]], [producers], updates[u], after, edges, table, made)
        if zero in (1, 2):
            k = len(table.nodes) + len(made)
            after[computes.at[updates[u]]].append(k)
            edges[0].append(computes.numbers[updates[u]])
            edges[1].append(k)
            made.append(Node("ALL_GATHER", u, devices=groups[u]))
    table.extend(made)
    if zero == 3:
        _gathers(table, computes, by_group, units, set(owners), groups, before, edges, release)
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


class _Computes:
    """The computes of a global order as columns: their positions in it, numbers, nodes,
    ops and regions."""

    def __init__(self, table: Table, order: list[int], at: list[int]):
        self.order, self.at = order, at
        self.numbers = list(map(order.__getitem__, at))
        self.nodes = list(map(table.nodes.__getitem__, self.numbers))
        self.ops = list(map(_OP, self.nodes))
        self.regions = list(map(_REGION, self.nodes))


def _reduce(computes: _Computes, reduced: list[Node], lasts: list[int], runs: list[list[int]], update: int,
            after: dict, edges: tuple[list, list], table: Table, made: list[Node]) -> None:
    """A unit's reductions `reduced`, one after each run's last compute (`lasts`), each
    fed by its run's computes and feeding the unit's update."""
    order, ops, numbers = computes.order, table.ops, computes.numbers
    first = len(table.nodes) + len(made)
    made += reduced
    keys = list(range(first, first + len(reduced)))
    end = len(order) - 1
    for pos, k in zip(map(computes.at.__getitem__, lasts), keys):
        while pos < end and ops[order[pos + 1]] == "SEND":
            pos += 1   # let the gradient sends that unblock other stages go first
        after[pos].append(k)
    upd = numbers[update]
    if all(len(run) == 1 for run in runs):     # (k -> update, producer -> k) per reduction, in one go
        edges[0].extend(chain.from_iterable(zip(keys, map(numbers.__getitem__, map(_FIRST, runs)))))
        edges[1].extend(chain.from_iterable(zip(repeat(upd), keys)))
        return
    for k, run in zip(keys, runs):
        edges[0].append(k)
        edges[1].append(upd)
        edges[0].extend(map(numbers.__getitem__, run))
        edges[1].extend([k] * len(run))


def _gathers(table: Table, computes: _Computes, by_group, units, shared, groups, before, edges, release) -> None:
    """ZeRO-3: per device group, the computes in order: gather a unit when the
    previous compute on these devices did not use it; release it when the next will not.

    What a compute gathers depends only on its region and the previous
    compute's (what it releases, on the next one's): both are worked out once
    per pair of regions."""
    need = {r: tuple(u for u in us if u in shared) for r, us in units.items()}
    gathered: dict[tuple, tuple[int, ...]] = {}     # (region, previous region or None) -> units
    released: dict[tuple, tuple[int, ...]] = {}     # (region, next region or None) -> units
    regions, at, numbers = computes.regions, computes.at, computes.numbers
    made = []
    number = len(table.nodes)
    for g, seq in by_group.items():
        last = len(seq) - 1
        prev_region = None
        for i, j in enumerate(seq):
            region = regions[j]
            next_region = regions[seq[i + 1]] if i < last else None
            if region == prev_region == next_region:     # the same units before, now and after: nothing to do
                continue
            pair = (region, prev_region)
            fresh = gathered.get(pair)
            if fresh is None:
                fresh = gathered[pair] = tuple(u for u in need[region] if prev_region is None
                                               or u not in units[prev_region])
            if fresh:
                # Prefetch: issue before the previous compute on these devices.
                where = before[at[seq[i - 1]] if i > 0 else at[j]]
                n = computes.nodes[j]
                for u in fresh:
                    where.append(number + len(made))
                    edges[0].append(number + len(made))
                    edges[1].append(numbers[j])
                    made.append(Node("ALL_GATHER", u, n.mb, n.op, devices=groups[u]))
            pair = (region, next_region)
            free = released.get(pair)
            if free is None:
                free = released[pair] = tuple(u for u in need[region] if next_region is None
                                              or u not in units[next_region])
            if free:        # most computes release nothing: the dict stays small for project's look-ups
                release[numbers[j]] = free
            prev_region = region
    table.extend(made)
