"""Run every device's plan abstractly: find deadlocks before any device runs,
and predict step time and bubbles from a cost model.

Semantics match the runtime: sends, receives and collectives are issued
without blocking; a compute action starts when the device is free and every
communication it waits for has completed. A receive completes once its send
was issued; a collective once every member issued it and the group's
previous collective completed (Gloo and NCCL run a group's collectives in
issue order).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .actions import Action
from ..ir.dag import COMPUTE, node_key
from ..diagnostics import error

UNIT_COSTS = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0, "UPD": 0.0}
_COMPUTE = frozenset(COMPUTE)
_OWN_STREAM = {"ALL_TO_ALL": "ep", "TP": "tp"}      # collectives on process groups of their own


@dataclass(frozen=True)
class _Overlapped:
    """The compute actions of one overlapped slot (`[F(...), B(...)]`), run as one unit.

    `name` is its cost key: the members' passes joined by `&`, a BI and BW of
    the same region and microbatch counted as one B (DualPipe's `F&B`).
    """

    members: tuple[Action, ...]
    name: str

    @property
    def key(self) -> str:            # a pass cut into pieces (`piper.ir.moe_cut`) counts once, by its token
        return "&".join(a.key for a in self.members if a.node.is_compute and not a.node.value)

    @property
    def waits(self) -> tuple[str, ...]:
        inside = {a.key for a in self.members}      # a cut pass's exchanges run inside the unit
        return tuple(dict.fromkeys(k for a in self.members for k in a.waits if k not in inside))


def _unit_name(members: tuple[Action, ...]) -> str:
    backward = {(a.node.region, a.node.mb) for a in members if a.node.op == "BI"} & \
               {(a.node.region, a.node.mb) for a in members if a.node.op == "BW"}
    ops = []
    for a in members:
        n = a.node
        if n.value is not None:      # a later piece or an exchange of a cut pass: the pass counts once
            continue
        if (n.region, n.mb) in backward and n.op in ("BI", "BW"):
            if n.op == "BI":
                ops.append("B")
        else:
            ops.append(n.op)
    rank = {"F": 0, "B": 1, "BI": 2, "BW": 3}
    return "&".join(sorted(ops, key=lambda op: rank.get(op, 9)))


def _fuse_overlaps(plan: tuple, groups) -> tuple:
    """One device's plan with each overlapped group made one `_Overlapped` step.

    The group's span of the plan becomes: the receives and collectives its
    members wait for, the unit, then the rest of the span in order (its sends,
    and receives that later actions wait for).
    A group whose span holds another compute action stays as it is.
    """
    plan = tuple(plan)
    for group in groups:
        index = {a.key: i for i, a in enumerate(plan) if isinstance(a, Action) and a.node.is_compute}
        if len(group) < 2 or not all(k in index for k in group):
            continue
        at = sorted(index[k] for k in group)
        lo, hi = at[0], at[-1]
        # A pass cut at its collectives: its pieces and exchanges join the unit (a slot's time, as
        # `job.timings()` measures it, holds them).
        pieces = {i for i, a in enumerate(plan) if isinstance(a, Action) and a.node.value is not None
                  and (a.node.is_compute or a.node.op in _OWN_STREAM)
                  and node_key(a.node.phase if a.node.op in _OWN_STREAM else a.node.op, a.node.region,
                               a.node.mb) in group}
        if pieces:
            at = sorted(set(at) | pieces)
            lo, hi = at[0], at[-1]
        members = tuple(plan[i] for i in at)
        others = [plan[i] for i in range(lo, hi + 1) if i not in at]
        if any(a.node.is_compute for a in others):
            continue
        needed = {k for a in members for k in a.waits}
        first = [a for a in others if a.key in needed]
        rest = [a for a in others if a not in first]
        plan = plan[:lo] + tuple(first) + (_Overlapped(members, _unit_name(members)),) + tuple(rest) + plan[hi + 1:]
    return plan


@dataclass
class Simulation:
    step_time: float
    busy: dict[int, float]                        # compute time per device
    timeline: dict[int, list[tuple[float, float, str]]] = field(default_factory=dict)
    # With `record_comm`: per device, (issued, completed, key) of each send, receive and collective.
    comm: dict[int, list[tuple[float, float, str]]] = field(default_factory=dict)

    def bubble(self, rank: int) -> float:
        """Idle compute time of `rank` within the step."""
        return self.step_time - self.busy[rank]

    @property
    def bubble_fraction(self) -> float:
        total = self.step_time * len(self.busy)
        return 0.0 if total == 0 else 1 - sum(self.busy.values()) / total


def simulate(plans: dict[int, tuple[Action, ...]], costs=None, comm_cost=None, overlap=(), *,
             cores: int | None = None, devices: int | None = None, background: float = 0.0,
             record_comm: bool = False) -> Simulation:
    """Simulate `plans`; raise `PiperError(deadlock)` with a step x device grid if stuck.

    `costs` maps a pass (F, B, BI, BW, UPD) or a node key to its time
    (default: F=BI=BW=1, B=2); `comm_cost(node)` gives communication time (default 0).

    `overlap` lists groups of compute keys that a device runs as one unit (an
    overlapped slot such as DualPipeV's `[F(PP=0, MB=7), B(PP=7, MB=3)]`, found
    by `piper.frontend.interop.overlapped_slots`): the unit starts when the device is
    free and every member's inputs have arrived, its outputs leave when it
    ends, and it takes `costs[its members' keys joined by "&"]` (as `job.timings()`
    reports a slot run in lanes), else `costs["F&B"]` (its members' passes joined by `&`,
    BI+BW counted as B), or the sum of its members' costs when that is not
    given. Without `overlap`, every action runs one after another.

    `cores`: the devices are processes sharing this many CPU cores (`devices`
    of them in all; default one per plan), and `costs` are each action's
    time on a core of its own (`job.timings(cpu=True)`); `background` is CPU
    seconds per device and step spent outside the timed actions (the
    runtime's own work, communication threads). See `_on_shared_cores`.

    `record_comm` also records when each communication was issued and completed
    (`Simulation.comm`, for `piper.compiler.trace`).
    """
    if cores is not None:
        return _on_shared_cores(plans, costs, comm_cost, overlap, cores, devices or len(plans), background,
                                record_comm=record_comm)
    check_collective_order(plans)
    if overlap:
        groups = [tuple(g) for g in overlap]
        plans = {r: _fuse_overlaps(plan, groups) for r, plan in plans.items()}
    return _Run(plans, costs, comm_cost, record_comm=record_comm).run()


class _Collectives:
    """When collectives complete, and what a slot of overlapped items costs (`_Run`'s state)."""

    def slot_cost(self, a) -> float:
        costs = self.costs
        cost = costs.get(a.key, costs.get(a.name))   # this slot as timed, else its kind
        if cost is None:          # its computes (a cut pass's exchanges run inside it too)
            cost = sum(costs.get(m.key, 0.0 if m.node.value else costs.get(m.node.op, 1.0))
                       for m in a.members if m.node.is_compute)
        return cost

    def all_to_alls_inside(self, rank: int, a, now: float) -> float | None:
        """A marker for the all-to-alls a compute runs inside: the device waits for them (None: not
        every member has issued them yet). An exchange between pieces, `0ALL_TO_ALL_F3.0`, is
        issued like any collective instead; the piece after it waits for it."""
        key = (rank, a.node.key)
        if key not in self.done:
            self.collective(rank, a.group, a.node, now)
            if key not in self.done:
                return None
        return max(now, self.done[key])

    def collective(self, rank: int, group: tuple[int, ...], node, now: float) -> None:
        """`rank` issues a collective at `now`; it completes once every simulated member
        of its group has issued it and the group's previous collective has completed."""
        key = node.key
        members_simulated = self.simulated.get(group)
        if members_simulated is None:
            members_simulated = self.simulated[group] = tuple(m for m in group if m in self.plans)
        if len(members_simulated) == 1:      # one replica stands for the group: nothing to wait for
            members = {rank: now}
        else:
            members = self.issued[(key, group)]
            members[rank] = now
            if len(members) != len(members_simulated):
                return
        stream = (group, _OWN_STREAM[node.op]) if node.op in _OWN_STREAM else group   # own process groups
        group_last = self.group_last
        finish = max(max(members.values()), group_last[stream]) + (
            0.0 if self.comm_cost is None else self.comm_cost(node))
        group_last[stream] = finish
        done = self.done
        for member in members_simulated:
            done[(member, key)] = finish
        if self.comm is not None:
            for member, at in members.items():
                self.comm[member].append((at, finish, key))


class _Run(_Collectives):
    """One simulation: every device's position, clock and busy time, and what has completed.

    `run` advances each device in turn until it blocks, round after round,
    until no device moves. `timeline=False` skips recording each compute's
    span (the verifier needs only whether the plans finish).
    """

    def __init__(self, plans, costs=None, comm_cost=None, *, timeline: bool = True, record_comm: bool = False):
        self.plans = plans
        self.costs = {**UNIT_COSTS, **(costs or {})}
        # Whether any cost is a node's own (keyed by its token, which starts with its region's
        # number): else a compute costs what its pass does, one look-up instead of two.
        self.keyed = any(k[:1].isdigit() for k in self.costs)
        self.comm_cost = comm_cost        # None: communication takes no time
        self.pos = dict.fromkeys(plans, 0)
        self.clock = dict.fromkeys(plans, 0.0)
        self.busy = dict.fromkeys(plans, 0.0)
        self.timeline: dict[int, list] | None = {} if timeline else None
        self.sent: dict[tuple, float] = {}              # (tag, src, dst) -> issue time
        self.done: dict[tuple[int, str], float] = {}    # (rank, key) -> completion of waitable comm
        self.issued: dict[tuple, dict[int, float]] = defaultdict(dict)   # collective key -> rank -> time
        self.group_last: dict[tuple, float] = defaultdict(float)
        # group -> its ranks that are simulated: a plan set holding one replica per
        # data-parallel shard stands for its (identical) peers.
        self.simulated: dict[tuple, tuple[int, ...]] = {}
        self.comm: dict[int, list] | None = defaultdict(list) if record_comm else None

    def run(self) -> Simulation:
        plans, pos = self.plans, self.pos
        progress = True
        while progress:
            progress = False
            for rank, plan in plans.items():
                if self.advance(rank, plan):
                    progress = True
        if any(pos[r] < len(plans[r]) for r in plans):
            raise deadlock_error(plans, pos, self.done)
        step = max(list(self.clock.values()) + [t for t in self.group_last.values()] + [0.0])
        return Simulation(step, self.busy, self.timeline if self.timeline is not None else {},
                          dict(self.comm or {}))

    def advance(self, rank: int, plan) -> bool:
        """Run `rank` until it blocks or ends; whether it moved."""
        # Its clock and position live in locals meanwhile.
        i, end, now, spent = self.pos[rank], len(plan), self.clock[rank], self.busy[rank]
        start = i
        costs, comm_cost, done, sent, comm = self.costs, self.comm_cost or _free, self.done, self.sent, self.comm
        keyed, free = self.keyed, self.comm_cost is None
        line = None if self.timeline is None else _line(self.timeline, rank)
        while i < end:
            a = plan[i]
            if a.__class__ is _Overlapped:
                t = _ready_time(done, rank, now, a.waits)
                if t is None:
                    break
                cost = self.slot_cost(a)
                if line is not None:
                    line.append((t, t + cost, a.key))
                now = t + cost
                spent += cost
                i += 1
                continue
            node = a.node
            op = node.op
            if op == "SEND":
                sent[(a.tag, rank, a.peer)] = now
                if comm is not None:
                    comm[rank].append((now, now + comm_cost(node), node.key))
            elif op == "RECV":
                t_send = sent.get((a.tag, a.peer, rank))
                if t_send is None:
                    # The receive is posted; it completes when the send arrives. Posting
                    # never blocks, but its completion must be known for waiters, so
                    # stall this device until the sender reaches its send.
                    break
                finished = done[(rank, node.key)] = (t_send if t_send > now else now) + (
                    0.0 if free else comm_cost(node))
                if comm is not None:
                    comm[rank].append((now, finished, node.key))
            elif op in _COMPUTE:
                waits = a.waits
                if not waits:
                    t = now
                elif len(waits) == 1:         # the usual case, without a call
                    t = done.get((rank, waits[0]))
                    if t is None:
                        break
                    if not t > now:
                        t = now
                else:
                    t = _ready_time(done, rank, now, waits)
                    if t is None:
                        break
                if node.value:        # a later piece of a cut pass: the pass's cost falls on its piece 0
                    cost = costs.get(node.key, 0.0)
                else:
                    cost = costs.get(node.key, costs.get(op, 1.0)) if keyed else costs.get(op, 1.0)
                if line is not None:
                    line.append((t, t + cost, node.key))
                now = t + cost
                spent += cost
            elif op in _OWN_STREAM and node.value is None:     # a marker: the device waits for them
                t = self.all_to_alls_inside(rank, a, now)
                if t is None:
                    break             # until every member of the expert group is there
                now = t
            else:
                self.collective(rank, a.group, node, now)
            i += 1
        if line is not None and not line:
            del self.timeline[rank]      # a device's line starts with its first compute
        if i == start:
            return False
        self.pos[rank], self.clock[rank], self.busy[rank] = i, now, spent
        return True


def _free(node) -> float:
    return 0.0


def _ready_time(done: dict, rank: int, t: float, waits) -> float | None:
    """When an action waiting for `waits` can start on `rank`, free at `t`: None while one is pending."""
    for key in waits:
        finished = done.get((rank, key))
        if finished is None:
            return None
        if finished > t:
            t = finished
    return t


def _line(timeline: dict[int, list], rank: int) -> list:
    line = timeline.get(rank)
    if line is None:
        line = timeline[rank] = []
    return line


def check_collective_order(plans) -> None:
    """Every member of a group must issue the group's collectives in the same
    order: Gloo and NCCL match them by position, so a mismatch hangs or mixes data."""
    issued: dict[tuple, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for rank, plan in plans.items():
        for a in plan:
            if a.__class__ is Action and a.group:
                issued[a.group][rank].append(a.key)
    for group, by_rank in issued.items():
        sequences = list(by_rank.items())
        first_rank, first = sequences[0]
        for rank, seq in sequences[1:]:
            if seq != first:
                at = next((i for i, (x, y) in enumerate(zip(first, seq)) if x != y), min(len(first), len(seq)))
                mine = first[at] if at < len(first) else "(nothing)"
                theirs = seq[at] if at < len(seq) else "(nothing)"
                raise error("collective-mismatch", f"the devices of group {list(group)} issue their collectives in "
                            f"different orders: collective {at} is {mine} on rank {first_rank} but {theirs} on "
                            f"rank {rank}", notes=(f"rank {first_rank}: {' '.join(first)}",
                                                   f"rank {rank}: {' '.join(seq)}"),
                            hint="give every device of a group the same order of the passes that need "
                                 "collectives (ZeRO gathers and reductions follow the compute order)")


def deadlock_error(plans, pos, done):
    """Render where every device waits as a step x device grid."""
    ranks = sorted(plans)
    width = max(len(a.key) for p in plans.values() for a in p) + 2
    lines = ["step " + "".join(f"rank {r}".ljust(width) for r in ranks)]
    depth = max(len(p) for p in plans.values())
    for i in range(depth):
        cells = []
        for r in ranks:
            plan = plans[r]
            if i >= len(plan):
                cells.append("")
            elif i < pos[r]:
                cells.append(plan[i].key)
            elif i == pos[r]:
                cells.append("*" + plan[i].key)
            else:
                cells.append(".")
        lines.append(f"{i:<5}" + "".join(c.ljust(width) for c in cells))
    waiting = []
    for r in ranks:
        if pos[r] < len(plans[r]):
            a = plans[r][pos[r]]
            missing = [k for k in a.waits if (r, k) not in done]
            what = (f"waits for {', '.join(missing)}" if missing else
                    f"waits for the matching send from rank {a.peer}" if isinstance(a, Action) and a.node.op == "RECV"
                    else "blocked")
            waiting.append(f"rank {r} at step {pos[r]} ({a.key}) {what}")
    return error("deadlock", "the plans deadlock: " + "; ".join(waiting),
                 notes=("`*` marks where each device waits; `.` what it never reaches\n" + "\n".join(lines),),
                 hint="reorder the slots so every device's sends come before the receives they unblock")


def check(compiled) -> None:
    """Raise where the plans deadlock, as `verify` does; where the replay on the global
    order is known to run to the end (`Plans.replays`), they cannot, and nothing is simulated."""
    if not getattr(compiled.plans, "replays", False):
        verify(compiled)


def verify(compiled) -> Simulation:
    """Simulate one replica per data-parallel shard (the others run identical
    plans with their own peers): a deadlock is found, and costs nothing per replica.
    No timeline is kept: only whether the plans finish matters here. Plans from
    `project` come with this simulation already run as they were made."""
    replayed = getattr(compiled.plans, "replayed", None)    # run as the plans were made (`piper.compiler.replay`)
    if replayed is not None:
        return Simulation(replayed.step_time, dict(replayed.busy))
    plans = compiled.plans.representatives()
    check_collective_order(plans)
    return _Run(plans, timeline=False).run()


SLOT = "&"       # a job.timings() key for an overlapped slot run in lanes: its members' keys joined
STEP = "step"    # the job.timings(cpu=True) key for the worker process's CPU seconds over the step


def timed_slots(timings: dict[str, float]) -> tuple[tuple[str, ...], ...]:
    """The overlapped slots one rank's `job.timings()` timed as units: `simulate`'s `overlap`."""
    return tuple(tuple(k.split(SLOT)) for k in timings if SLOT in k)


def actions_seconds(timings: dict[str, float]) -> float:
    """The seconds of one rank's single actions (not its slots' spans, not the whole step)."""
    return sum(sec for key, sec in timings.items() if SLOT not in key and key != STEP)


def background_seconds(timings: dict[str, float]) -> float:
    """One rank's CPU seconds outside its actions, from `job.timings(cpu=True)`: `simulate`'s `background`."""
    return max(0.0, timings[STEP] - actions_seconds(timings)) if STEP in timings else 0.0


def _on_shared_cores(plans, costs, comm_cost, overlap, cores: int, devices: int, background: float = 0.0,
                     rounds: int = 20, record_comm: bool = False) -> Simulation:
    """Devices that outnumber the cores slow each other down: a mean-field model.

    When k devices compute at once on c < k cores, each runs at c/k of its
    speed. Tracking that exactly needs the simulation to know, at every
    instant, who is computing; instead every cost is stretched by one factor
    f = max(1, k/c), with k the average number of devices computing over the
    step that f itself produces (each device's busy time over the step,
    summed), iterated to a fixed point. k grows with f and is bounded, so the
    iteration settles within a few rounds. Each device's `background` CPU
    seconds compete for the cores too, stretched like the rest.
    """
    base = {**UNIT_COSTS, **(costs or {})}
    factor, sim = 1.0, None
    for _ in range(rounds):
        sim = simulate(plans, {k: v * factor for k, v in base.items()}, comm_cost, overlap, record_comm=record_comm)
        if sim.step_time <= 0:
            return sim
        per_device = sum(sim.busy.values()) / len(sim.busy) + background * factor
        busy = per_device / sim.step_time * devices      # devices computing, on average
        new = max(1.0, busy / cores)
        if abs(new - factor) < 1e-3 * factor:
            break
        factor = new
    return sim
