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

from .compiler import Action
from .diagnostics import error

UNIT_COSTS = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0, "UPD": 0.0}


@dataclass
class Simulation:
    step_time: float
    busy: dict[int, float]                        # compute time per device
    timeline: dict[int, list[tuple[float, float, str]]] = field(default_factory=dict)

    def bubble(self, rank: int) -> float:
        """Idle compute time of `rank` within the step."""
        return self.step_time - self.busy[rank]

    @property
    def bubble_fraction(self) -> float:
        total = self.step_time * len(self.busy)
        return 0.0 if total == 0 else 1 - sum(self.busy.values()) / total


def simulate(plans: dict[int, tuple[Action, ...]], costs=None, comm_cost=None) -> Simulation:
    """Simulate `plans`; raise `PiperError(deadlock)` with a step x device grid if stuck.

    `costs` maps a pass (F, B, BI, BW, UPD) or a node key to its time
    (default: F=BI=BW=1, B=2); `comm_cost(node)` gives communication time (default 0).
    """
    costs = {**UNIT_COSTS, **(costs or {})}
    comm_cost = comm_cost or (lambda node: 0.0)
    pos = {r: 0 for r in plans}
    clock = {r: 0.0 for r in plans}
    busy = {r: 0.0 for r in plans}
    timeline: dict[int, list] = defaultdict(list)
    sent: dict[tuple, float] = {}              # (tag, src, dst) -> issue time
    done: dict[tuple[int, str], float] = {}    # (rank, key) -> completion of waitable comm
    issued: dict[tuple, dict[int, float]] = defaultdict(dict)   # collective key -> rank -> time
    group_last: dict[tuple, float] = defaultdict(float)
    collective_done: dict[str, float] = {}

    def ready_time(rank: int, action: Action) -> float | None:
        t = clock[rank]
        for key in action.waits:
            if (rank, key) not in done:
                return None
            t = max(t, done[(rank, key)])
        return t

    progress = True
    while progress:
        progress = False
        for rank, plan in plans.items():
            while pos[rank] < len(plan):
                a = plan[pos[rank]]
                op = a.node.op
                if op == "SEND":
                    sent[(a.tag, rank, a.peer)] = clock[rank]
                elif op == "RECV":
                    t_send = sent.get((a.tag, a.peer, rank))
                    if t_send is None:
                        # The receive is posted; it completes when the send arrives. Posting
                        # never blocks, but its completion must be known for waiters, so
                        # stall this device until the sender reaches its send.
                        break
                    done[(rank, a.key)] = max(clock[rank], t_send) + comm_cost(a.node)
                elif a.node.is_compute:
                    t = ready_time(rank, a)
                    if t is None:
                        break
                    cost = costs.get(a.key, costs.get(op, 1.0))
                    timeline[rank].append((t, t + cost, a.key))
                    clock[rank] = t + cost
                    busy[rank] += cost
                else:  # collective
                    members = issued[(a.key, a.group)]
                    members[rank] = clock[rank]
                    if len(members) == len(a.group):
                        start = max(max(members.values()), group_last[a.group])
                        end = start + comm_cost(a.node)
                        group_last[a.group] = end
                        for member in a.group:
                            done[(member, a.key)] = end
                pos[rank] += 1
                progress = True
    stuck = {r: pos[r] for r in plans if pos[r] < len(plans[r])}
    if stuck:
        raise deadlock_error(plans, pos, done)
    step = max(list(clock.values()) + [t for t in group_last.values()] + [0.0])
    return Simulation(step, busy, dict(timeline))


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
                    f"waits for the matching send from rank {a.peer}" if a.node.op == "RECV" else "blocked")
            waiting.append(f"rank {r} at step {pos[r]} ({a.key}) {what}")
    return error("deadlock", "the plans deadlock: " + "; ".join(waiting),
                 notes=("`*` marks where each device waits; `.` what it never reaches\n" + "\n".join(lines),),
                 hint="reorder the slots so every device's sends come before the receives they unblock")
