"""The verifier's simulation, run on the global order `piper.compiler.plans.project` projects.

`piper.compiler.simulate.verify` simulates one replica per data-parallel shard (the
plans `Plans.representatives()` returns) with unit costs and free
communication, and raises if they deadlock. Every plan is a projection of one
global order, and each node of it is one action in its group's plans (its
transfer, peer group and waits known). So the same simulation can run on that
order, on the representative of each group, without building their plans or
going round the devices until each blocks (`replay`).

Running in global order is sound: an action's times depend only on its
device's previous action and on what it waits for (its send, receive or
collective), never on the order in which devices are visited, so where every
dependency comes earlier in the global order, this gives what `verify`'s run
gives (the same float operations in the same order per device). Where one
does not (a receive before its send, a wait on what this device never
received, a group that is not one device per shard), the replay stops and
`verify` simulates the plans as before, finding the deadlock it would have
found.

Whether the replay stops depends on the order alone, not on the times: `walk`
finds it while it finds what each node waits for, so a compile that only needs
to know the plans cannot deadlock (`piper check`, every job) leaves the times
to whoever asks for them. Each loop keeps its state in local lists: it runs
once per node (225k at 64 stages x 512 microbatches) and makes no call per node.
"""
from __future__ import annotations

from ..ir.table import Table

_COMPUTE = frozenset(("F", "B", "BI", "BW", "UPD"))


def walk(table: Table, order: list[int], waits_of: dict[int, list[int]], shard_of: dict[int, tuple],
         member_by_shard: dict[tuple, dict]) -> tuple[list[tuple], bool]:
    """What each node waits for (by number), and whether `replay` runs to the end.

    A node waits for the receives and collectives feeding it (`waits_of`), each once
    per device: after `split B` a received gradient feeds both BI and BW, and BI's wait
    already completed it. The replay runs to the end where every group is one device
    per shard, every send comes before its receive and its transfer's other send, and
    every wait is on what the node's devices completed before it; and where the
    table's transfers pair each group with its peer's (`Table.mirrored`), so each
    receive names the member its send was issued by."""
    first = shard_of[0] if shard_of else ()
    ops, groups, pairs = table.ops, table.groups, table.pairs
    waits_at: list[tuple] = [()] * len(ops)
    feeding = waits_of.get          # a SEND or RECV is never fed by a receive or a collective
    index_of: dict[int, int] = {}   # id(devices) -> the group's index: few groups, many nodes
    lanes = _Lanes(member_by_shard, first)
    waited, completed = lanes.waited, lanes.completed
    sent: set = set()           # the transfers (their pairs) whose send has come
    clean = table.mirrored
    for k in order:
        g = groups[k]
        lane = index_of.get(id(g))
        if lane is None:
            lane = index_of[id(g)] = lanes.index(g)
            clean = clean and lanes.ranks[lane] is not None
        op = ops[k]
        if op == "SEND":
            if clean:
                clean = pairs[k] not in sent
                sent.add(pairs[k])
            continue
        if op == "RECV":
            clean = clean and pairs[k] in sent
            completed[lane].add(k)
            continue
        feeds = feeding(k)
        if feeds:
            seen = waited[lane]
            if len(feeds) == 1:           # the usual case, without a generator
                if feeds[0] not in seen:
                    waits_at[k] = (feeds[0],)
                    seen.add(feeds[0])
            else:
                waits_at[k] = waits = tuple(f for f in feeds if f not in seen)
                seen.update(waits)
        if op in _COMPUTE:
            if clean and waits_at[k]:
                clean = completed[lane].issuperset(waits_at[k])
        else:
            completed[lane].add(k)
    return waits_at, clean


def replay(table: Table, order: list[int], waits_at: list[tuple], shard_of: dict[int, tuple],
           member_by_shard: dict[tuple, dict]):
    """`verify`'s Simulation of `order` (node numbers; `waits_at[k]`: what node k waits
    for), or None where the replay stops."""
    from .simulate import UNIT_COSTS

    first = shard_of[0] if shard_of else ()
    world, costs = len(shard_of), dict(UNIT_COSTS)
    ops, groups, pairs, peer_groups, nodes = table.ops, table.groups, table.pairs, table.peer_groups, table.nodes
    index_of: dict[int, int] = {}   # id(devices) -> the group's index: few groups, many nodes
    lanes = _Lanes(member_by_shard, first)
    ranks, now, spent, done, streams = lanes.ranks, lanes.now, lanes.spent, lanes.done, lanes.streams
    peer_of: dict[int, int | None] = {}       # id(a peer group) -> its member holding the first shard
    sent_at: dict = {}           # by transfer (its pair): when its send was issued
    sent_by: dict = {}           # by transfer: sending rank * world size + receiving rank
    for k in order:
        g = groups[k]
        lane = index_of.get(id(g))
        if lane is None:
            lane = index_of[id(g)] = lanes.index(g)
        if ranks[lane] is None:
            return None     # not one device per shard: `verify` simulates the plans
        op = ops[k]
        if op == "SEND" or op == "RECV":
            peer_group = peer_groups[k]
            peer = peer_of.get(id(peer_group), -1)
            if peer == -1:
                peer = peer_of[id(peer_group)] = member_by_shard[peer_group].get(first)
            pair = pairs[k]
            if op == "SEND":
                if peer is None or pair in sent_at:
                    return None      # its receive came first
                sent_at[pair] = now[lane]
                sent_by[pair] = ranks[lane] * world + peer
            elif peer is None or sent_by.get(pair) != peer * world + ranks[lane]:
                return None          # its send is not (yet) issued by the member it names
            else:
                t, clock = sent_at[pair], now[lane]
                done[lane][k] = (t if t > clock else clock) + 0.0
        elif op in _COMPUTE:
            t, finished = now[lane], done[lane]
            for w in waits_at[k]:
                at = finished.get(w)
                if at is None:
                    return None
                if at > t:
                    t = at
            cost = 0.0 if nodes[k][4] else costs.get(op, 1.0)    # a cut pass's later pieces: 0
            now[lane] = t + cost
            spent[lane] += cost
        else:
            # A collective on the lane's own group: with one member simulated, it completes
            # when issued, after the group's previous one on its stream.
            exchange = op in ("ALL_TO_ALL", "TP")             # on the expert or tensor group, not the unit's
            marker = exchange and nodes[k][4] is None      # the collectives a compute runs inside
            finished, stream = done[lane], streams[lane]
            if not marker or k not in finished:
                clock, previous = now[lane], stream[exchange]
                stream[exchange] = finished[k] = (clock if clock >= previous else previous) + 0.0
            if marker:              # the device waits for them
                now[lane] = max(now[lane], finished[k])
    return _result(shard_of, first, lanes)


class _Lanes:
    """Per group (by equality: regions placed alike share one): the replay's lane for its
    member holding the first shard (rank None where the group is not one device per
    shard), and for `walk` what its devices have waited for and completed."""

    def __init__(self, member_by_shard: dict[tuple, dict], first: tuple):
        self.member_by_shard, self.first = member_by_shard, first
        self.groups: list[tuple] = []
        self.waited: list[set[int]] = []
        self.completed: list[set[int]] = []
        self.ranks: list[int | None] = []
        self.now: list[float] = []
        self.spent: list[float] = []
        self.done: list[dict[int, float]] = []       # node number of a receive or collective -> when it completed
        self.streams: list[list[float]] = []         # when its last collective, and its last all-to-all, completed

    def index(self, group: tuple) -> int:
        if group in self.groups:
            return self.groups.index(group)
        members = self.member_by_shard.get(group)
        self.ranks.append(members.get(self.first) if members is not None and len(members) == len(group) else None)
        self.groups.append(group)
        self.waited.append(set())
        self.completed.append(set())
        self.now.append(0.0)
        self.spent.append(0.0)
        self.done.append({})
        self.streams.append([0.0, 0.0])
        return len(self.groups) - 1


def _result(shard_of: dict[int, tuple], first: tuple, lanes: _Lanes):
    """The Simulation `verify` gives, or None where a representative in a group has no lane."""
    from .simulate import Simulation

    lane = {rank: i for i, rank in enumerate(lanes.ranks) if rank is not None}
    representatives = [r for r in range(len(shard_of)) if shard_of[r] == first]
    placed = {r for g in lanes.groups for r in g}
    if any(r in placed and r not in lane for r in representatives):
        return None
    busy = {r: lanes.spent[lane[r]] if r in lane else 0.0 for r in representatives}
    clocks = [lanes.now[lane[r]] if r in lane else 0.0 for r in representatives]
    step = max(clocks + [t for i, s in enumerate(lanes.streams) if lanes.ranks[i] is not None for t in s] + [0.0])
    return Simulation(step, busy, {}, {})
