"""The compiler: strategy DAG -> lowered DAG -> one ordered plan per device.

    compile_ir(ir) runs, in this order:
      resolve_placement  (lower.py)  regions on groups, checked against the batch axes
      add_transfers      (lower.py)  SEND/RECV where a value crosses groups
      schedule                       one global topological order (cycles are errors)
      add_collectives                DP/ZeRO collectives placed in that order
      project                        each device's actions, with p2p peers and waits
    and `verify` (simulate.py) runs every plan abstractly before anything runs.

Every device's plan is a projection of one global order, so collectives are
issued in the same order by every member of a group and every receive has
its send earlier: the plans cannot deadlock by construction, and the
simulator checks it.
"""
from __future__ import annotations

import heapq
from collections import defaultdict, namedtuple
from collections.abc import Mapping
from itertools import compress
from operator import and_, itemgetter, not_
from dataclasses import dataclass, field

from ..diagnostics import Diagnostic, Label, error
from ..ir.dag import COLLECTIVES, COMPUTE, IR, Edge, Node, _not_same, distinct_edges
from ..ir.lower import add_transfers, check_orders, resolve_placement, temporal_edges, zero_levels
from .plan_waits import Feeds, waits_after_lowering
from .replay import Replay
from ..ir.tied import add_tie_exchanges, units_used

_PHASE = {"F": 0, "B": 1, "BI": 1, "BW": 2, "UPD": 3}
_COLLECTIVE_OPS = frozenset(COLLECTIVES)
_COMPUTE = frozenset(COMPUTE)


_tuple_new = tuple.__new__
_ActionFields = namedtuple("_ActionFields", "node peer tag group waits release")


class Action(tuple):
    """One step of a device's plan.

    `peer` is the other rank of a SEND/RECV and `tag` its message tag;
    `group` the ranks of a collective; `waits` the keys of communication this
    action must see completed first; `release` the parameter units (owner
    regions) whose gathered parameters can be freed after it (ZeRO-3).

    An immutable value compared by all its fields, as the frozen dataclass it
    replaces was; a tuple because plans hold millions of them (see `Node`).
    """

    __slots__ = ()
    node, peer, tag, group, waits, release = (
        _ActionFields.node, _ActionFields.peer, _ActionFields.tag, _ActionFields.group, _ActionFields.waits,
        _ActionFields.release)

    def __new__(cls, node: Node, peer: int | None = None, tag: int | None = None,
                group: tuple[int, ...] | None = None, waits: tuple[str, ...] = (),
                release: tuple[int, ...] = ()) -> "Action":
        return _tuple_new(cls, (node, peer, tag, group, waits, release))

    @property
    def key(self) -> str:
        return self[0].key

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return tuple.__eq__(self, other)
        return _not_same(other)

    def __ne__(self, other):
        if other.__class__ is self.__class__:
            return tuple.__ne__(self, other)
        return _not_same(other, True)

    __hash__ = tuple.__hash__

    def __reduce__(self):
        return Action, tuple(self)

    def __repr__(self) -> str:
        return "Action(" + ", ".join(f"{f}={v!r}" for f, v in zip(_ActionFields._fields, self)) + ")"

    def __str__(self) -> str:
        return self[0].key


@dataclass
class Compiled:
    """The result of compilation: the lowered IR, the global order, and the plans."""

    ir: IR
    order: list[Node]
    plans: "Plans"
    zero: int
    warnings: list[Diagnostic] = field(default_factory=list)

    def show(self) -> str:
        """Each device's plan as one line of action tokens."""
        return "\n".join(f"rank {r}: " + " ".join(a.key for a in self.plans[r]) for r in self.plans)

    def compute_order(self, rank: int) -> list[str]:
        return [a.key for a in self.plans[rank] if a.node.is_compute]


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
    """`schedule(ir)`, and the positions of the computes in it: `add_collectives`
    then reads only those nodes of the order (reading each node's op costs a
    cache miss apiece at 200k nodes)."""
    if not ir.keys_distinct():       # a key twice: the node it names is scheduled once
        ir = ir.with_(nodes=tuple(ir.index().values()))
    nodes = ir.nodes
    total = len(nodes)
    try:
        src_ids, dst_ids = ir.edge_ids()      # nodes are numbered by their position
    except KeyError:
        index = ir.index()
        bad = next(e for e in ir.edges if e.src not in index or e.dst not in index)
        raise AssertionError(f"edge to unknown node {bad}") from None
    # Communication (priority (0,)) goes before any compute, so the ready nodes
    # wait in two heaps: communication by (key, number), computes by one int
    # that orders as (priority, key) (`_compute_entries`) and holds the number.
    keys = list(map(_KEY, nodes))
    is_compute = list(map(_COMPUTE.__contains__, map(_OP, nodes)))
    entry: list = list(zip(keys, range(total)))
    at = list(compress(range(total), is_compute))
    for i, e in zip(at, _compute_entries(list(map(nodes.__getitem__, at)), at, total)):
        entry[i] = e
    succ: list[list[int]] = [[] for _ in keys]
    indeg = [0] * total
    for src, dst in zip(src_ids, dst_ids):
        succ[src].append(dst)
        indeg[dst] += 1
    starts = list(compress(range(total), map(not_, indeg)))
    ready_comm = [entry[i] for i in starts if not is_compute[i]]
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
        add(nodes[i])
        for j in succ[i]:
            indeg[j] -= 1
            if not indeg[j]:
                if is_compute[j]:
                    push(ready_compute, entry[j])
                elif alone is None and not ready_comm:
                    alone = j
                else:
                    if alone is not None:
                        push(ready_comm, entry[alone])
                        alone = None
                    push(ready_comm, entry[j])
    if len(out) != len(keys):
        raise _cycle_error(ir, {keys[i] for i, d in enumerate(indeg) if d > 0})
    return out, computes_at


_OP_RANK = {op: rank for rank, op in enumerate(sorted(_PHASE))}     # ops as strings compare


def _compute_entries(computes: list[Node], numbers: list[int], total: int) -> list[int]:
    """The heap entry of each compute, with its number: an int that orders
    as `(_priority(n), n.key)` and then holds the number (`entry % total`).

    A compute is one (op, region, mb), so its priority never ties with
    another's and the key is never consulted; the fields are packed into one
    int (an update's missing microbatch as one past the last) so the heap
    compares ints, not tuples of five."""
    top = max((n.mb for n in computes if n.mb is not None), default=0) + 1
    regions = max((n.region for n in computes), default=0) + 1
    span = 2 * regions + 1
    out = []
    for i, (op, region, mb) in zip(numbers, map(_OP_REGION_MB, computes)):
        phase = _PHASE[op] if op != "UPD" else 9
        mb = top if mb is None else mb
        code = ((phase * (top + 1) + mb) * span + (region if op == "F" else -region) + regions) * 5 + _OP_RANK[op]
        out.append(code * total + i)
    return out


_OP_REGION_MB = itemgetter(0, 1, 2)
_SRC, _DST, _KEY = itemgetter(0), itemgetter(1), itemgetter(8)
_OP = itemgetter(0)          # a Node's op, without the attribute lookup
_AS_SEND = itemgetter(5, 2, 3, 4, 1)     # a RECV's (peer, mb, phase, value, region): its SEND's fields


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
        elif src.op == "RECV":
            send = Node("SEND", src.peer, src.mb, src.phase, src.value, src.region).key
            preds[dst.key] += feeds.get(send, [])
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
    done: set[str] = set()
    pos = {g: 0 for g in groups}
    progress = True
    while progress:
        progress = False
        for g in groups:
            seq = local_orders[g]
            while pos[g] < len(seq) and all(p in done for p in preds[seq[pos[g]]]):
                done.add(seq[pos[g]])
                pos[g] += 1
                progress = True
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
    labels = tuple(Label(e.span, f"orders {e.src} before {e.dst}") for e in temporal[1:] if e.span)
    return error("deadlock", "the schedule deadlocks: " + "; ".join(waits), span=span, labels=labels,
                 notes=("`*` marks where each device waits, `.` what it never reaches:\n" + "\n".join(lines),),
                 hint="the devices' orders wait on each other; reorder the slots so each device's sends "
                      "come before the receives that unblock the other")


def _units_used(ir: IR) -> dict[int, tuple[int, ...]]:
    """Region -> the owner regions whose parameters it reads (a tied parameter's copy on its devices)."""
    return units_used(ir)


def _by_group(computes) -> dict[tuple, list[tuple[int, Node]]]:
    """Device group -> its computes (but updates) with their positions in the global order."""
    by_group: dict[tuple, list[tuple[int, Node]]] = defaultdict(list)
    for i, n in computes:
        if n.op != "UPD":
            by_group[n.devices].append((i, n))
    return by_group


def _gradient_runs(by_group, units, grad_ops) -> dict[int, list[list[tuple[int, Node]]]]:
    """Unit -> its runs: backwards into the unit that follow each other on its devices.

    Each run gets one reduce-scatter: a run's gradients add up in one buffer,
    and the compute after it gives the reduce-scatter something to overlap
    with before the unit's next backward needs a new buffer.
    """
    runs: dict[int, list] = defaultdict(list)
    for seq in by_group.values():
        last: dict[int, int] = {}            # unit -> index in seq of its latest backward
        for j, (i, n) in enumerate(seq):
            if n.op not in grad_ops:
                continue
            for u in units[n.region]:
                if last.get(u) == j - 1:
                    runs[u][-1].append((i, n))
                else:
                    runs[u].append([(i, n)])
                last[u] = j
    return runs


def add_collectives(ir: IR, order: list[Node], zero: int,
                    computes_at: list[int] | None = None) -> tuple[list[Node], list[Edge], dict[str, tuple]]:
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
    Returns the new order, its extra edges, and per compute key the units to release (if any).
    `computes_at`: the positions of the computes in `order`, if the caller has them
    (`schedule_with_computes`).
    """
    units = _units_used(ir)
    groups = {r.index: ir.devices_of(r.index) for r in ir.regions}
    owners = [r.index for r in ir.regions if r.owned and len(groups[r.index]) > 1]
    shared = set(owners)
    before: dict[int, list[Node]] = defaultdict(list)   # insert before position i
    after: dict[int, list[Node]] = defaultdict(list)    # insert after position i
    edges: list[Edge] = []
    release: dict[str, tuple] = {}

    at = computes_at
    if at is None:
        at = list(compress(range(len(order)), map(_COMPUTE.__contains__, map(_OP, order))))
    computes = list(zip(at, map(order.__getitem__, at)))
    grad_ops = ("B", "BW")
    last_grad: dict[int, int] = {}
    grad_producers: dict[int, list[str]] = defaultdict(list)
    for i, n in computes:
        if n.op in grad_ops:
            for u in units[n.region]:
                last_grad[u] = i
                grad_producers[u].append(n.key)
    by_group = _by_group(computes) if zero >= 2 else {}
    runs = _gradient_runs(by_group, units, grad_ops) if zero >= 2 else {}
    position = {n[8]: i for i, n in computes if n[0] == "UPD"} if zero in (1, 2) else {}
    for u in owners:
        upd = Node("UPD", u).key
        if len(runs.get(u, ())) > 1:
            # ZeRO-2/3 hold 1/d of the gradients during the step as well: the
            # gradients of each run of backwards into a unit are reduce-scattered
            # after it, and the shards add up (FSDP's and DeepSpeed's way).
            reductions = [(run[-1][0], run[-1][1], [n.key for _, n in run]) for run in runs[u]]
        else:
            reductions = [(last_grad[u], None, grad_producers[u])]
        for pos, last, producers in reductions:      # last: the run's last compute (None: the step's)
            if zero <= 1:
                red = Node("ALL_REDUCE", u, devices=groups[u])
            elif last is None:
                red = Node("REDUCE_SCATTER", u, devices=groups[u])
            else:       # Node("REDUCE_SCATTER", u, last.mb, last.op, devices=groups[u]), made directly
                red = _tuple_new(Node, ("REDUCE_SCATTER", u, last[2], last[0], None, None, groups[u], None,
                                        f"{u}REDUCE_SCATTER_{last[0]}{last[2]}"))
            while pos + 1 < len(order) and order[pos + 1][0] == "SEND":
                pos += 1   # let the gradient sends that unblock other stages go first
            after[pos].append(red)
            red_key = red[8]
            edges.append(_tuple_new(Edge, (red_key, upd, "data", None)))
            edges += [_tuple_new(Edge, (k, red_key, "data", None)) for k in producers]
        if zero in (1, 2):
            gather = Node("ALL_GATHER", u, devices=groups[u])
            after[position[upd]].append(gather)
            edges.append(Edge(upd, gather.key))

    if zero == 3:
        _gathers(by_group, units, shared, groups, before, edges, release)
    out: list[Node] = []
    done = 0
    for i in sorted(before.keys() | after.keys()):
        out += order[done:i]
        out += before.get(i, ())
        out.append(order[i])
        out += after.get(i, ())
        done = i + 1
    out += order[done:]
    return out, edges, release


def _gathers(by_group, units, shared, groups, before, edges, release) -> None:
    """ZeRO-3: per device group, the computes in order: gather a unit when the
    previous compute on these devices did not use it; release it when the next will not.

    What a compute gathers depends only on its region and the previous
    compute's (what it releases, on the next one's): both are worked out once
    per pair of regions."""
    need = {r: tuple(u for u in us if u in shared) for r, us in units.items()}
    gathered: dict[tuple, tuple[int, ...]] = {}     # (region, previous region or None) -> units
    released: dict[tuple, tuple[int, ...]] = {}     # (region, next region or None) -> units
    for g, seq in by_group.items():
        last = len(seq) - 1
        prev_region = None
        for j, (i, n) in enumerate(seq):
            region = n.region
            next_region = seq[j + 1][1].region if j < last else None
            pair = (region, prev_region)
            fresh = gathered.get(pair)
            if fresh is None:
                fresh = gathered[pair] = tuple(u for u in need[region] if prev_region is None
                                               or u not in units[prev_region])
            if fresh:
                # Prefetch: issue before the previous compute on these devices.
                where = before[seq[j - 1][0] if j > 0 else i]
                for u in fresh:
                    gather = Node("ALL_GATHER", u, n.mb, n.op, devices=groups[u])
                    where.append(gather)
                    edges.append(Edge(gather.key, n.key))
            pair = (region, next_region)
            free = released.get(pair)
            if free is None:
                free = released[pair] = tuple(u for u in need[region] if next_region is None
                                              or u not in units[next_region])
            if free:        # most computes release nothing: the dict stays small for project's look-ups
                release[n.key] = free
            prev_region = region


class Plans(Mapping):
    """rank -> that device's actions, built on first use.

    Every device of a group runs the same node sequence; only the peers of
    its sends and receives differ. So the sequence is kept once per group and
    a device's plan is made when asked for: a runtime asks for its own, the
    verifier for one replica per data-parallel shard.
    """

    def __init__(self, world_size: int, group_of: dict[int, tuple], sequences: dict[tuple, list],
                 transfers: dict[tuple, "_Transfers"], peer_of, shard_of: dict[int, tuple]):
        self._world = world_size
        self._group_of = group_of
        self._sequences = sequences      # group -> its actions, None where a SEND/RECV goes
        self._transfers = transfers      # group -> its SEND/RECVs, filled in per device
        self._peer_of = peer_of
        self._shard_of = shard_of
        self._cache: dict[int, tuple[Action, ...]] = {}
        # `verify`'s simulation of the representatives, run as `project` made the plans (`piper.compiler.replay`);
        # None where it could not be.
        self.replayed = None

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        if rank not in self._cache:
            if not 0 <= rank < self._world:
                raise KeyError(rank)
            self._cache[rank] = self._plan(rank)
        return self._cache[rank]

    def _plan(self, rank: int) -> tuple[Action, ...]:
        """The group's sequence with this device's SEND/RECVs, each with its peer, in place."""
        group = self._group_of.get(rank)
        plan = list(self._sequences.get(group, ()))
        if group in self._transfers:
            t = self._transfers[group]
            peers = {g: self._peer_of(rank, g) for g in dict.fromkeys(t.peer_groups)}
            for i, node, tag, peer_group in zip(t.positions, t.nodes, t.tags, t.peer_groups):
                plan[i] = _tuple_new(Action, (node, peers[peer_group], tag, None, (), ()))
        return tuple(plan)

    def __iter__(self):
        return iter(range(self._world))

    def __len__(self) -> int:
        return self._world

    def representatives(self) -> dict[int, tuple[Action, ...]]:
        """One replica per group: the devices holding the first batch shard.

        Not kept: verification reads them once, and plans kept for every group
        would be that many more objects for the garbage collector to scan.
        """
        first = self._shard_of[0]
        return {r: self._cache.get(r) or self._plan(r) for r in range(self._world) if self._shard_of[r] == first}


@dataclass
class _Transfers:
    """A group's SEND/RECVs, as columns: where each goes in the sequence, its
    node and tag, and the group on the other side (which picks the peer)."""

    positions: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    tags: list[int] = field(default_factory=list)
    peer_groups: list[tuple] = field(default_factory=list)


def project(ir: IR, order: list[Node], release: dict[str, tuple],
            waits_of: dict[str, list[str]] | None = None) -> Plans:
    """Each device's actions in global order, with peers, tags and waits.

    `waits_of`: `_waits_of(ir, order)`, if the caller found it another way
    (`compile_ir`: through the lowered IR's edge ids, `waits_after_lowering`)."""
    mesh = ir.mesh
    batch_axes = ir.batch_axes()
    shard_of = {}
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        shard_of[rank] = tuple(c[a] for a in batch_axes)
    groups = {r.index: ir.devices_of(r.index) for r in ir.regions}
    # A transfer pairs the devices that hold the same shard of the batch.
    member_by_shard = {g: {shard_of[r]: r for r in g} for g in set(groups.values())}

    def peer_of(rank: int, group: tuple[int, ...]) -> int:
        return member_by_shard[group][shard_of[rank]]

    if waits_of is None:
        waits_of = _waits_of(ir, order)
    sequences: dict[tuple, list] = {}
    transfers: dict[tuple, _Transfers] = {}
    waited: dict[tuple, set[str]] = {}
    replay = Replay(mesh.world_size, shard_of, member_by_shard)
    tags: dict[tuple, int] = {}
    by_id: dict[int, tuple] = {}     # id(devices) -> that group's state: few groups, many nodes
    for n in order:
        op, g = n.op, n.devices
        state = by_id.get(id(g))
        if state is None:
            if g not in sequences:
                sequences[g], transfers[g], waited[g] = [], _Transfers(), set()
            state = by_id[id(g)] = (sequences[g], transfers[g], waited[g], replay.lane(g))
        seq, t, done, lane = state
        if op == "SEND" or op == "RECV":
            # The tag names the transfer; both sides compute it from the SEND's
            # (region, mb, phase, value, peer), which its key spells out.
            send_key = n[1:6] if op == "SEND" else _AS_SEND(n)
            tag, peer_group = tags.setdefault(send_key, len(tags)), groups[n.peer]
            t.positions.append(len(seq))
            t.nodes.append(n)
            t.tags.append(tag)
            t.peer_groups.append(peer_group)
            seq.append(None)
            if lane is not None:
                lane.send(tag, peer_group) if op == "SEND" else lane.recv(tag, peer_group, n[8])
            continue
        # Each communication is waited for once per device: after `split B` a
        # received gradient feeds both BI and BW, and BI's wait already completed it.
        waits = ()
        feeds = waits_of.get(n.key)
        if feeds:
            if len(feeds) == 1:           # the usual case, without a generator
                if feeds[0] not in done:
                    waits = (feeds[0],)
                    done.add(feeds[0])
            else:
                waits = tuple(k for k in feeds if k not in done)
                done.update(waits)
        if op in _COMPUTE:
            seq.append(_tuple_new(Action, (n, None, None, None, waits, release.get(n.key, ()))))
            if lane is not None:
                lane.compute(n, waits)
        else:
            seq.append(_tuple_new(Action, (n, None, None, g, waits, ())))
            if lane is not None:
                lane.collective(n)
    group_of = {rank: g for g in sequences for rank in g}
    plans = Plans(mesh.world_size, group_of, sequences, transfers, peer_of, shard_of)
    plans.replayed = replay.result(group_of)
    return plans


_WAITABLE = frozenset(("RECV",) + COLLECTIVES)


def _waits_of(ir: IR, order: list[Node]) -> dict[str, list[str]]:
    """Node key -> the receives and collectives feeding it by a data edge:
    what an action waits for, nothing else (a send completes on its own)."""
    waitable = {n[8] for n in order if n[0] in _WAITABLE}
    found = Feeds()
    for src, dst, kind, _ in compress(ir.edges, map(waitable.__contains__, map(_SRC, ir.edges))):
        if kind == "data":
            found.add(src, dst)
    return found.waits_of


def compile_ir(ir: IR) -> Compiled:
    """Lower, schedule and project; raise `PiperError` on a bad strategy."""
    warnings: list[Diagnostic] = []
    ir = resolve_placement(ir, warnings)
    zero = zero_levels(ir)
    temporal = temporal_edges(ir)
    _check_order_devices(temporal)
    check_orders(ir, warnings, temporal)
    del temporal
    ir = add_transfers(ir)
    order, computes_at = schedule_with_computes(ir)
    order, extra, release = add_collectives(ir, order, zero, computes_at)
    order, ties = add_tie_exchanges(ir, order, _units_used(ir))     # tied weights across stages
    lowered, ir = ir, ir.with_(nodes=tuple(order), edges=_with_new_edges(ir, extra, ties))
    waits_of = waits_after_lowering(ir, order, lowered)
    del lowered        # its indexes (~20 MB at 64 x 512) go before the plans are made
    plans = project(ir, order, release, waits_of)
    return Compiled(ir, order, plans, zero, warnings)


def _with_new_edges(ir: IR, extra: list[Edge], ties: list[Edge] = ()) -> tuple[Edge, ...]:
    """`dict.fromkeys(ir.edges + extra + ties)`. The IR's edges are already distinct
    and join its nodes (`schedule` checked), so an extra edge reaching a new
    node repeats none of them: only the extra edges need deduplicating.

    Each of `extra` (`add_collectives`') joins a collective it adds: where `ir`
    vouches that its nodes hold no collective (`add_transfers`' output), none
    of them is looked up."""
    if _COLLECTIVE_OPS.isdisjoint(ir.vouched_ops() or _COLLECTIVE_OPS):
        check = ties
    else:
        check = [*extra, *ties]
    extra = [*extra, *ties]
    if check:
        known = ir.index().__contains__
        if any(map(and_, map(known, map(_SRC, check)), map(known, map(_DST, check)))):
            return distinct_edges(ir.edges + tuple(extra))
    return ir.edges + distinct_edges(extra)


def _check_order_devices(temporal: list[tuple[Edge, Node, Node]]) -> None:
    """A temporal edge between nodes on different devices cannot be enforced without data."""
    for e, a, b in temporal:
        if a.devices != b.devices:
            raise error("order-across-devices", f"this order puts {a.key} (on ranks {list(a.devices)}) "
                        f"before {b.key} (on ranks {list(b.devices)}), which run on different devices",
                        span=e.span, hint="order only the passes of regions placed on the same devices")
