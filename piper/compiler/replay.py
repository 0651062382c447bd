"""The verifier's simulation, run while `piper.compiler.plans.project` makes the plans.

`piper.compiler.simulate.verify` simulates one replica per data-parallel shard (the
plans `Plans.representatives()` returns) with unit costs and free
communication, and raises if they deadlock. Every plan is a projection of one
global order, and `project` walks that order once: at each node it knows the
action it puts in each device's plan (tag, peer group, waits). So the same
simulation can run there, in global order, on the representative of each
group, without building their plans or going round the devices until each
blocks.

Running in global order is sound: an action's times depend only on its
device's previous action and on what it waits for (its send, receive or
collective), never on the order in which devices are visited, so where every
dependency comes earlier in the global order, this gives what `verify`'s run
gives (the same float operations in the same order per device). Where one
does not (a receive before its send, a wait on what this device never
received, a group that is not one device per shard), the replay stops and
`verify` simulates the plans as before, finding the deadlock it would have
found.
"""
from __future__ import annotations

_COMPUTE = frozenset(("F", "B", "BI", "BW", "UPD"))


class Lane:
    """The representative device of one group: its clock, busy time and completed communication."""

    __slots__ = ("replay", "rank", "world", "peers", "sent_at", "sent_by", "costs", "now", "spent", "done",
                 "streams")

    def __init__(self, replay: "Replay", rank: int):
        self.replay, self.rank, self.world = replay, rank, replay.world_size
        self.sent_at, self.sent_by, self.costs = replay.sent_at, replay.sent_by, replay.costs
        self.peers: dict[int, int | None] = {}       # id(the other side's group) -> its member for this shard
        self.now = self.spent = 0.0
        self.done: dict[int, float] = {}       # node number of a receive or collective -> when it completed
        # When the last collective on this group completed, and the last all-to-all (their own process
        # group): the lane's group is the only one on those streams.
        self.streams = [0.0, 0.0]

    def peer(self, group: tuple) -> int | None:
        peer = self.peers[id(group)] = self.replay.member_by_shard[group].get(self.replay.first)
        return peer

    def send(self, pair, peer_group: tuple) -> None:
        """`verify`'s `sent[(tag, rank, peer)] = now`, kept by the transfer's pair (what its
        tag numbers): a send comes first (the order puts it before its receive), else the
        replay stops."""
        peer = self.peers.get(id(peer_group))
        if peer is None:
            peer = self.peer(peer_group)
        if peer is None or pair in self.sent_at:
            self.replay.stop()
            return
        self.sent_at[pair] = self.now
        self.sent_by[pair] = self.rank * self.world + peer

    def recv(self, pair, peer_group: tuple, key: int) -> None:
        peer = self.peers.get(id(peer_group))
        if peer is None:
            peer = self.peer(peer_group)
        if peer is None or self.sent_by.get(pair) != peer * self.world + self.rank:
            self.replay.stop()          # its send is not (yet) issued by the member it names
            return
        t_send, now = self.sent_at[pair], self.now
        self.done[key] = (t_send if t_send > now else now) + 0.0

    def compute(self, node, waits: tuple[int, ...]) -> None:
        t = self.now
        done = self.done
        for key in waits:
            finished = done.get(key)
            if finished is None:
                self.replay.stop()
                return
            if finished > t:
                t = finished
        cost = 0.0 if node[4] else self.costs.get(node[0], 1.0)    # a cut pass's later pieces: 0
        self.now = t + cost
        self.spent += cost

    def collective(self, node, key) -> None:
        """A collective on the lane's own group: with one member simulated, it completes when
        issued, after the group's previous one on its stream. `key` names it in `done`."""
        exchange = node[0] == "ALL_TO_ALL"
        marker = exchange and node[4] is None      # the exchanges a compute runs inside
        if not marker or key not in self.done:
            streams, now = self.streams, self.now
            previous = streams[exchange]
            streams[exchange] = self.done[key] = (now if now >= previous else previous) + 0.0
        if marker:              # the device waits for them
            self.now = max(self.now, self.done[key])


class Replay:
    """The shared state: sends issued, one `Lane` per group."""

    def __init__(self, world_size: int, shard_of: dict[int, tuple], member_by_shard: dict[tuple, dict]):
        from .simulate import UNIT_COSTS

        self.costs = dict(UNIT_COSTS)
        self.world_size = world_size
        self.member_by_shard = member_by_shard
        self.first = shard_of[0] if world_size else ()
        self.ranks = [r for r in range(world_size) if shard_of[r] == self.first]
        self.sent_at: dict = {}          # by transfer: when its send was issued
        self.sent_by: dict = {}          # by transfer: sending rank * world size + receiving rank
        self.lanes: dict[tuple, Lane] = {}
        self.stopped = False

    def lane(self, group: tuple) -> Lane | None:
        """The lane of `group`'s one representative (its member holding the first shard of the
        batch); None, and the replay stops, unless each of its members holds another shard."""
        lane = self.lanes.get(group)
        if lane is None and not self.stopped:
            members = self.member_by_shard.get(group)
            rank = members.get(self.first) if members is not None and len(members) == len(group) else None
            if rank is None:
                self.stop()
                return None
            lane = self.lanes[group] = Lane(self, rank)
        return lane

    def stop(self) -> None:
        self.stopped = True

    def result(self, group_of: dict[int, tuple]):
        """`verify`'s Simulation, or None if the replay stopped."""
        from .simulate import Simulation

        if self.stopped:
            return None
        lanes = {lane.rank: lane for lane in self.lanes.values()}
        if any(group_of.get(r) is not None and r not in lanes for r in self.ranks):
            return None
        busy = {r: lanes[r].spent if r in lanes else 0.0 for r in self.ranks}
        clocks = [lanes[r].now if r in lanes else 0.0 for r in self.ranks]
        step = max(clocks + [t for lane in self.lanes.values() for t in lane.streams] + [0.0])
        return Simulation(step, busy, {}, {})
