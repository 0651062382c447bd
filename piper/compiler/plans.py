"""The compiler: strategy DAG -> lowered DAG -> one ordered plan per device.

    compile_ir(ir) runs, in this order:
      resolve_placement  (ir/lower.py)     regions on groups, checked against the batch axes
      add_transfers      (ir/lower.py)     SEND/RECV where a value crosses groups, into a `Table`
      schedule           (schedule.py)     one global topological order (cycles are errors)
      add_collectives    (collectives.py)  DP/ZeRO collectives placed in that order
      project                              each device's actions, with p2p peers and waits
    and `check` (simulate.py) makes sure no plan can deadlock before anything runs.

Every device's plan is a projection of one global order, so collectives are
issued in the same order by every member of a group and every receive has
its send earlier: the plans cannot deadlock by construction, and the
verifier checks it. The passes from `add_transfers` on share one table of node
numbers (`piper.ir.table`); the objects of the result are made when read.
"""
from __future__ import annotations

from collections.abc import Mapping
from itertools import compress
from operator import and_, eq, itemgetter

from ..diagnostics import Diagnostic, error
from ..ir.dag import COLLECTIVES, COMPUTE, IR, Edge, Node, distinct_edges
from ..ir.lower import check_orders, lower_transfers, resolve_placement, temporal_edges, zero_levels
from ..ir.mesh_coords import axis_coords
from ..ir.table import Table
from ..ir.tied import add_tie_exchanges, tied_params
from .actions import Action
from .collectives import _units_used, add_collectives, place_collectives     # noqa: F401 (the compiler's passes)
from .plan_waits import waits_by_number
from .replay import replay, walk
from .schedule import _compute_entries, _priority, schedule, schedule_table, schedule_with_computes  # noqa: F401

_COLLECTIVE_OPS = frozenset(COLLECTIVES)
_COMPUTE = frozenset(COMPUTE)
_TRANSFER = frozenset(("SEND", "RECV"))


_tuple_new = tuple.__new__
_SRC, _DST, _KEY, _DEVICES = itemgetter(0), itemgetter(1), itemgetter(8), itemgetter(6)


class Compiled:
    """The result of compilation: the lowered IR, the global order, and the plans.

    `ir` and `order` hold one object per node and edge (225k nodes at 64 stages x
    512 microbatches): `compile_ir` makes them when first read, from its table
    (`piper check` never reads them; a job does).
    """

    def __init__(self, ir: IR | None, order: list[Node] | None, plans: "Plans", zero: int,
                 warnings: list[Diagnostic] | None = None, *, make=None):
        self._ir, self._order, self._make = ir, order, make
        self.plans, self.zero = plans, zero
        self.warnings = [] if warnings is None else warnings

    def _made(self) -> None:
        if self._make is not None:
            self._ir, self._order = self._make()
            self._make = None

    @property
    def ir(self) -> IR:
        self._made()
        return self._ir

    @property
    def order(self) -> list[Node]:
        self._made()
        return self._order

    def show(self) -> str:
        """Each device's plan as one line of action tokens."""
        return "\n".join(f"rank {r}: " + " ".join(a.key for a in self.plans[r]) for r in self.plans)

    def compute_order(self, rank: int) -> list[str]:
        return [a.key for a in self.plans[rank] if a.node.is_compute]


class _Sequences:
    """`Plans`' groups' node sequences and the actions common to each group's devices,
    made on first use."""

    def _group(self, rank: int) -> tuple | None:
        """The rank's group; the first call walks the order once for every group's sequence."""
        if self._sequences is None:
            groups, by_id = self._table.groups, {}
            self._sequences = sequences = {}
            for k in self._order:
                numbers = by_id.get(id(groups[k]))
                if numbers is None:
                    numbers = by_id[id(groups[k])] = sequences.setdefault(groups[k], [])
                numbers.append(k)
            self._group_of = {r: g for g in sequences for r in g}
            self._tags = _tags(self._table, self._order)
        return self._group_of.get(rank)

    def _base(self, group: tuple) -> tuple[list, list[tuple]]:
        """The group's actions but its SEND/RECVs (None), and those as (position, node number,
        tag, peer group); made once."""
        found = self._bases.get(id(group))      # by identity: a group of 100k ranks hashes in 100k steps
        if found is None:
            seq, table, release = self._sequences[group], self._table, self._release
            node, key, ops, tags = table.node, table.key, table.ops, self._tags
            actions, transfers = [], []
            for k, waits in zip(seq, map(self._waits_at.__getitem__, seq)):
                op = ops[k]
                if op in _TRANSFER:
                    transfers.append((len(actions), k, tags[table.pairs[k]], table.peer_groups[k]))
                    actions.append(None)
                elif op in _COMPUTE:
                    actions.append(_tuple_new(Action, (node(k), None, None, None, tuple(map(key, waits)),
                                                       release.get(k, ()))))
                else:
                    actions.append(_tuple_new(Action, (node(k), None, None, group, tuple(map(key, waits)), ())))
            found = self._bases[id(group)] = (actions, transfers)
        return found


class Plans(_Sequences, Mapping):
    """rank -> that device's actions, built on first use.

    Every device of a group runs the same node sequence; only the peers of
    its sends and receives differ. So the sequence is kept once per group, as
    node numbers of the compiler's table, and a device's plan is made when
    asked for: a runtime asks for its own, the verifier for one replica per
    data-parallel shard. The sequences, and the nodes of the actions, are made
    then too: `piper check` verifies a strategy without making any.
    """

    def __init__(self, world_size: int, table: Table, order: list[int], waits_at: list[tuple],
                 release: dict[int, tuple], peer_of, shard_of: dict[int, tuple]):
        self._world = world_size
        self._table, self._order, self._waits_at, self._release = table, order, waits_at, release
        self._peer_of = peer_of
        self._shard_of = shard_of
        self._sequences: dict[tuple, list[int]] | None = None      # group -> its node numbers in order
        self._group_of: dict[int, tuple] = {}
        self._tags: dict = {}
        self._bases: dict[int, tuple] = {}        # id(group) -> (its actions, None where a SEND/RECV goes; those);
        # the groups are kept alive by `_sequences`
        self._cache: dict[int, tuple[Action, ...]] = {}
        # Whether `verify`'s simulation of the representatives runs to the end on the global order
        # (`piper.compiler.replay`): then the plans cannot deadlock. Its times are found when asked.
        self.replays = False
        self._replay: tuple | None = None       # (shard_of, member_by_shard) for `replayed`
        self._replayed = None

    @property
    def replayed(self):
        """`verify`'s Simulation, run on the global order; None where it stops (`replay`)."""
        if self._replay is not None:
            self._replayed = replay(self._table, self._order, self._waits_at, *self._replay)
            self._replay = None
        return self._replayed

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        if rank not in self._cache:
            if not 0 <= rank < self._world:
                raise KeyError(rank)
            self._cache[rank] = self._plan(rank)
        return self._cache[rank]

    def _plan(self, rank: int) -> tuple[Action, ...]:
        """The group's sequence with this device's SEND/RECVs, each with its peer, in place."""
        group = self._group(rank)
        if group is None:
            return ()
        actions, transfers = self._base(group)
        plan, node = list(actions), self._table.node
        peers = {g: self._peer_of(rank, g) for g in dict.fromkeys(t[3] for t in transfers)}
        for i, k, tag, peer_group in transfers:
            plan[i] = _tuple_new(Action, (node(k), peers[peer_group], tag, None, (), ()))
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


def project(ir: IR, order: list[Node], release: dict[str, tuple]) -> Plans:
    """Each device's actions in `order`, with peers, tags and waits (`project_table`
    for an order of nodes; `release`: the units each compute key frees)."""
    table = Table.of_nodes(ir, order, strict=False)
    if len(table.nodes) != len(order):
        raise AssertionError("an order holds each node once")
    number = dict(zip(map(_KEY, table.nodes), range(len(order))))
    release = {number[k]: units for k, units in release.items() if k in number}
    return project_table(table, list(range(len(order))), release, waits_by_number(table))


def project_table(table: Table, order: list[int], release: dict[int, tuple],
                  waits_of: dict[int, list[int]]) -> Plans:
    """Each device's actions in global order, with peers, tags and waits. Every
    device of a group runs the same sequence, so it is kept once per group. The
    walk that finds the waits also finds whether `verify`'s replay on this order
    runs to the end (`Plans.replays`); the replay's times come when asked.

    `order`: node numbers; `release`: the units each compute frees;
    `waits_of`: the receives and collectives feeding each node (`waits_by_number`)."""
    ir = table.ir
    mesh = ir.mesh
    # A device's shard: its batch shard and, under tp, its tensor shard (transfers pair equals).
    tensor = ir.tensor_axis()
    batch_axes = ir.batch_axes() + ((tensor,) if tensor is not None else ())
    groups = {r.index: ir.devices_of(r.index) for r in ir.regions}
    shard_of, member_by_shard = _shards(mesh, batch_axes, tuple({id(g): g for g in groups.values()}.values()))

    def peer_of(rank: int, group: tuple[int, ...]) -> int:
        return member_by_shard[group][shard_of[rank]]

    waits_at, replays = walk(table, order, waits_of, shard_of, member_by_shard)
    plans = Plans(mesh.world_size, table, order, waits_at, release, peer_of, shard_of)
    plans.replays, plans._replay = replays, (shard_of, member_by_shard)
    return plans


_last_shards: list = [None]     # (mesh, batch axes, groups, shard_of, member_by_shard) of the last plan


def _shards(mesh, batch_axes: tuple, groups: tuple) -> tuple[dict, dict]:
    """(each device's shard, per group its device of each shard): a transfer pairs the devices
    that hold the same shard of the batch. Both are read only, and the compiler projects a plan
    twice on one mesh and placement (before and after TP's and MoE's exchanges), so the last
    pair is kept: at 1,048,576 devices each costs about 0.5 s. Kept by identity (the mesh and
    groups are held, so no id is reused)."""
    last = _last_shards[0]
    if last is not None and last[0] is mesh and last[1] == batch_axes and len(last[2]) == len(groups) \
            and all(a is b for a, b in zip(last[2], groups)):
        return last[3], last[4]
    shard_of = dict(enumerate(axis_coords(mesh, batch_axes)))
    member_by_shard = {g: {shard_of[r]: r for r in g} for g in groups}
    _last_shards[0] = (mesh, batch_axes, groups, shard_of, member_by_shard)
    return shard_of, member_by_shard


def _tags(table: Table, order: list[int]) -> dict:
    """Transfer (its pair) -> its message tag: both sides number a transfer alike, by
    where it first comes in `order`."""
    ops, pairs = table.ops, table.pairs
    transfers = map(_TRANSFER.__contains__, map(ops.__getitem__, order))
    first = dict.fromkeys(compress(map(pairs.__getitem__, order), transfers))
    return dict(zip(first, range(len(first))))


def compile_ir(ir: IR) -> Compiled:
    """Lower, schedule and project; raise `PiperError` on a bad strategy.

    The passes from `add_transfers` on work on one `Table` (node numbers, columns);
    `Compiled.ir` and `.order` are made from it when first read."""
    warnings: list[Diagnostic] = []
    ir = resolve_placement(ir, warnings)
    zero = zero_levels(ir)
    temporal = temporal_edges(ir)
    _check_order_devices(temporal)
    check_orders(ir, warnings, temporal)
    del temporal
    table = lower_transfers(ir)
    order, computes_at = schedule_table(table)
    order, (src, dst), release = place_collectives(table, order, zero, computes_at)
    table.src += src
    table.dst += dst
    order, ties = _tie_exchanges(table, order)        # tied weights across stages
    plans = project_table(table, order, release, waits_by_number(table))
    return Compiled(None, None, plans, zero, warnings, make=lambda: _objects(table, order, len(src), ties))


def _tie_exchanges(table: Table, order: list[int]) -> tuple[list[int], list[Edge]]:
    """`add_tie_exchanges` on the table: its nodes and edges join it. Returns the new
    order and the exchanges' edges."""
    ir = table.ir
    if not tied_params(ir):
        return order, []
    nodes = list(map(table.node, order))
    moved, ties = add_tie_exchanges(ir, nodes, _units_used(ir))
    number = dict(zip(map(_KEY, nodes), order))
    out = []
    for n in moved:
        k = number.get(n[8])
        if k is None:
            k = number[n[8]] = table.append(n)
        out.append(k)
    table.src += [number[e.src] for e in ties]
    table.dst += [number[e.dst] for e in ties]
    return out, ties


def _objects(table: Table, order: list[int], extra: int, ties: list[Edge]) -> tuple[IR, list[Node]]:
    """The final IR and the order as objects: the lowered IR's nodes in order, its edges
    and then the collectives' (`extra` of them) and the tied weights' exchanges'."""
    lowered = table.lowered_ir()
    nodes = list(map(table.nodes.__getitem__, order))
    new = table.edge_objects(table.lowered_edges, table.lowered_edges + extra)
    return lowered.with_(nodes=tuple(nodes), edges=_with_new_edges(lowered, new, ties)), nodes


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


def _check_order_devices(temporal: tuple[list[Edge], list[Node], list[Node]]) -> None:
    """A temporal edge between nodes on different devices cannot be enforced without data."""
    edges, srcs, dsts = temporal
    if all(map(eq, map(_DEVICES, srcs), map(_DEVICES, dsts))):
        return
    e, a, b = next((e, a, b) for e, a, b in zip(edges, srcs, dsts) if a.devices != b.devices)
    raise error("order-across-devices", f"this order puts {a.key} (on ranks {list(a.devices)}) "
                f"before {b.key} (on ranks {list(b.devices)}), which run on different devices",
                span=e.span, hint="order only the passes of regions placed on the same devices")
