"""The verifier's simulation, run on the global order `piper.compiler.plans.project` projects.

`piper.compiler.simulate.verify` simulates one replica per data-parallel shard (the
plans `Plans.representatives()` returns) with unit costs and free
communication, and raises if they deadlock. Every plan is a projection of one
global order, and each node of it is one action in its group's plans (its
transfer, peer group and waits known). So the same simulation can run on that
order, on the representative of each group, without building their plans or
going round the devices until each blocks.

Running in global order is sound: an action's times depend only on its
device's previous action and on what it waits for (its send, receive or
collective), never on the order in which devices are visited, so where every
dependency comes earlier in the global order, this gives what `verify`'s run
gives (the same float operations in the same order per device). Where one
does not (a receive before its send, a wait on what this device never
received, a group that is not one device per shard), the replay stops and
`verify` simulates the plans as before, finding the deadlock it would have
found.

One loop with its state in local lists: it runs once per node (225k at 64
stages x 512 microbatches), so it makes no call per node.
"""
from __future__ import annotations

from ..ir.table import Table

_COMPUTE = frozenset(("F", "B", "BI", "BW", "UPD"))


def replay(table: Table, order: list[int], waits_at: list[tuple], shard_of: dict[int, tuple],
           member_by_shard: dict[tuple, dict]):
    """`verify`'s Simulation of `order` (node numbers; `waits_at[k]`: what node k waits
    for), or None where the replay stops."""
    from .simulate import UNIT_COSTS

    world = len(shard_of)
    first = shard_of[0] if world else ()
    costs = dict(UNIT_COSTS)
    ops, groups, pairs, peer_groups, nodes = table.ops, table.groups, table.pairs, table.peer_groups, table.nodes
    lane_of: dict[int, int] = {}        # id(group) -> its lane: the group's member holding the first shard
    ranks, now, spent, done, streams, lane_groups = [], [], [], [], [], []     # by lane
    peer_of: dict[int, int | None] = {}       # id(a peer group) -> its member holding the first shard
    sent_at: dict = {}           # by transfer (its pair): when its send was issued
    sent_by: dict = {}           # by transfer: sending rank * world size + receiving rank
    for k in order:
        g = groups[k]
        lane = lane_of.get(id(g))
        if lane is None:
            if g in lane_groups:        # an equal group (regions placed alike): the same lane
                lane = lane_of[id(g)] = lane_groups.index(g)
            else:
                members = member_by_shard.get(g)
                rank = members.get(first) if members is not None and len(members) == len(g) else None
                if rank is None:
                    return None     # not one device per shard: `verify` simulates the plans
                lane = lane_of[id(g)] = len(ranks)
                ranks.append(rank)
                lane_groups.append(g)
                now.append(0.0)
                spent.append(0.0)
                done.append({})     # node number of a receive or collective -> when it completed
                streams.append([0.0, 0.0])      # the last collective and the last all-to-all on the group
        op = ops[k]
        if op == "SEND" or op == "RECV":
            peer_group = peer_groups[k]
            peer = peer_of.get(id(peer_group), -1)
            if peer == -1:
                peer = peer_of[id(peer_group)] = member_by_shard[peer_group].get(first)
            if peer is None:
                return None
            pair = pairs[k]
            if op == "SEND":
                if pair in sent_at:
                    return None      # its receive came first
                sent_at[pair] = now[lane]
                sent_by[pair] = ranks[lane] * world + peer
            elif sent_by.get(pair) != peer * world + ranks[lane]:
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
            exchange = op == "ALL_TO_ALL"
            marker = exchange and nodes[k][4] is None      # the exchanges a compute runs inside
            finished, stream = done[lane], streams[lane]
            if not marker or k not in finished:
                clock, previous = now[lane], stream[exchange]
                stream[exchange] = finished[k] = (clock if clock >= previous else previous) + 0.0
            if marker:              # the device waits for them
                now[lane] = max(now[lane], finished[k])
    return _result(shard_of, first, ranks, lane_groups, now, spent, streams)


def _result(shard_of: dict[int, tuple], first: tuple, ranks: list[int], lane_groups: list[tuple],
            now: list[float], spent: list[float], streams: list[list[float]]):
    """The Simulation `verify` gives, or None where a representative in a group has no lane."""
    from .simulate import Simulation

    lane = {rank: i for i, rank in enumerate(ranks)}
    representatives = [r for r in range(len(shard_of)) if shard_of[r] == first]
    placed = {r for g in lane_groups for r in g}
    if any(r in placed and r not in lane for r in representatives):
        return None
    busy = {r: spent[lane[r]] if r in lane else 0.0 for r in representatives}
    clocks = [now[lane[r]] if r in lane else 0.0 for r in representatives]
    step = max(clocks + [t for s in streams for t in s] + [0.0])
    return Simulation(step, busy, {}, {})
