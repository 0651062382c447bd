"""The runtime's own costs as a cost model, measured by the runtime, for `simulate`.

`job.timings()` times the computes. A step costs more: between computes a
device's thread issues and waits for communication, routes what arrives,
samples memory and runs the plan loop (`job.overheads()`,
`piper/runtime/execution/overheads.py`); each step starts and ends with fixed work, and
the devices do not start together (the driver's calls reach them one after
another); and a point-to-point message on the CPU runtime is a rendezvous of
the two processes' Gloo threads, which on busy cores takes far longer than a
ping-pong between idle processes. A `RuntimeModel` holds each as a measured
quantity that applies to any plan, not only the one it was measured on:

- `per_op`: seconds per action of each op (F, B, SEND, RECV, ...), added to the
  compute that runs next to it on the same thread (`extra`, `fold`);
- `start`, `end`: seconds per step before a device's first action and after its
  last, and `skew`: per rank, how long after the first device its step started;
  `apply` puts `start` + `skew` on a leading action of each device's plan;
- `latency`: seconds from the later of a message's send and its receive's issue
  to its arrival (`receive_latencies`), the RECV cost of `comm_cost`.

    model = RuntimeModel.measured([job.overheads() per timed step], [job.traced() per timed step])
    plans, costs = model.apply(plans, costs)
    sim = simulate(plans, costs=costs, comm_cost=model.comm_cost())
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .actions import Action
from ..ir.dag import Node
from .simulate import SLOT, STEP, UNIT_COSTS, actions_seconds

COMPUTE_OPS = ("F", "B", "BI", "BW", "UPD")
# An op the measured run did not have costs what its nearest measured kin did.
KIN = {"BI": ("B", "F"), "BW": ("B", "F"), "B": ("BI", "F"), "F": ("B",), "UPD": (),
       "SEND": ("RECV",), "RECV": ("SEND",)}
START_MB = -1          # the leading action `apply` adds to each plan: `{rank}F-1`, a forward of microbatch -1


@dataclass(frozen=True)
class RuntimeModel:
    """The runtime's measured costs outside the computes (see the module docstring)."""

    per_op: dict[str, float] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0
    skew: dict[int, float] = field(default_factory=dict)
    latency: float = 0.0

    @classmethod
    def measured(cls, overheads, traced=()) -> "RuntimeModel":
        """From `job.overheads()` results (one per step; or single ranks' dicts): per op, the median
        over ranks and steps of its mean per action; `start`, `end` the medians. From `job.traced()`
        results of the same steps: each rank's median `start_skews`, and the mean of every
        message's `receive_latencies` (the mean: a step's delays add up, and their spread is wide)."""
        per_op, start, end = _per_op_medians(overheads)
        skews: dict[int, list[float]] = {}
        latencies: list[float] = []
        for step in traced:
            for rank, s in start_skews(step["recorded"]).items():
                skews.setdefault(rank, []).append(s)
            latencies += receive_latencies(step["recorded"], step["plans"])
        return cls(per_op, start, end, {r: statistics.median(v) for r, v in skews.items()},
                   statistics.fmean(latencies) if latencies else 0.0)

    def per_action(self, op: str) -> float:
        """Seconds per action of `op`: measured, else its kin's, else the mean over compute ops (a
        compute) or communication ops (the rest) that were measured, else 0."""
        if op in self.per_op:
            return self.per_op[op]
        for kin in KIN.get(op, ()):
            if kin in self.per_op:
                return self.per_op[kin]
        compute = op in COMPUTE_OPS
        same = [v for o, v in self.per_op.items() if (o in COMPUTE_OPS) == compute and o != "SLOT"]
        return statistics.mean(same) if same else 0.0

    def extra(self, plans) -> dict[str, float]:
        """Seconds to add to each compute key of `plans` (rank -> actions): its own op's share, the
        shares of the communication actions after it until the next compute (those before a rank's
        first compute go to that compute), and `end` on each rank's last compute."""
        out: dict[str, float] = {}
        for plan in plans.values():
            computes = [a for a in plan if getattr(a, "node", None) is not None and a.node.is_compute]
            if not computes:
                continue
            last = computes[0].key
            for a in plan:
                node = getattr(a, "node", None)
                if node is None:
                    continue
                if node.is_compute:
                    last = a.key
                out[last] = out.get(last, 0.0) + self.per_action(node.op)
            out[computes[-1].key] += self.end
        return out

    def fold(self, plans, costs: dict[str, float], overlap=()) -> dict[str, float]:
        """`costs` (compute key or pass -> seconds) with `extra(plans)` added to each compute key (one
        priced by its pass so far starts from that pass's cost); an overlapped slot's timed cost
        (`a&b`, one of `overlap`'s groups) gets the sum of its members' extras."""
        extra = self.extra(plans)
        out = dict(costs)
        ops = {a.key: a.node.op for plan in plans.values() for a in plan if getattr(a, "node", None) is not None}
        for key, sec in extra.items():
            if key not in out:       # priced by its pass until now (`simulate`'s default)
                out[key] = costs.get(ops[key], UNIT_COSTS.get(ops[key], 1.0))
            out[key] += sec
        for group in overlap:
            slot = SLOT.join(group)
            if slot in out:
                out[slot] += sum(extra.get(k, 0.0) for k in group)
        return out

    def apply(self, plans, costs: dict[str, float], overlap=()) -> tuple[dict, dict[str, float]]:
        """(plans, costs) for `simulate`: `fold`, and each rank's plan led by an action costing `start`
        plus its `skew` (the device is busy with the step's fixed work, or not yet called, meanwhile)."""
        costs = self.fold(plans, costs, overlap)
        led = {}
        for rank, plan in plans.items():
            lead = Action(Node("F", rank, START_MB))
            costs[lead.key] = self.start + self.skew.get(rank, 0.0)
            led[rank] = (lead, *plan)
        return led, costs

    def comm_cost(self, other=None):
        """`simulate`'s `comm_cost`: a RECV costs `latency`; anything else what `other(node)` says
        (e.g. a link model for collectives), else 0."""
        def cost(node) -> float:
            if node.op == "RECV":
                return self.latency
            return other(node) if other is not None else 0.0
        return cost

    def plan_seconds(self, plan) -> float:
        """One rank's runtime seconds per step under this model (`per_op`, `start`, `end`; not `skew`)."""
        return self.start + self.end + sum(self.per_action(a.node.op) for a in plan
                                           if getattr(a, "node", None) is not None)


def _per_op_medians(overheads) -> tuple[dict[str, float], float, float]:
    """Per op, the median over ranks and steps of its mean per action; the medians of `start`, `end`."""
    per: dict[str, list[float]] = {}
    starts, ends = [], []
    for record in _rank_records(overheads):
        if not record:
            continue
        starts.append(record["start"])
        ends.append(record["end"])
        for op, value in record.items():
            if op not in ("start", "end") and value[1]:
                per.setdefault(op, []).append(value[0] / value[1])
    return ({op: statistics.median(v) for op, v in per.items()},
            statistics.median(starts) if starts else 0.0, statistics.median(ends) if ends else 0.0)


def _rank_records(records):
    """Each rank's dict from a list of `job.overheads()` results or of rank dicts."""
    for record in records:
        if record and all(isinstance(k, int) for k in record):
            yield from record.values()
        else:
            yield record


def other_threads(cpu_timings, overheads) -> float:
    """CPU seconds per device and step spent by threads other than the step's (Gloo's, lanes') and
    outside the model: each rank's `step` less its actions and its thread's runtime work, the
    median over ranks and steps (`simulate`'s `background` once the runtime work is in the costs).

    `cpu_timings` and `overheads`: `job.timings(cpu=True)` and `job.overheads(cpu=True)` of the same steps."""
    rest = []
    for timings, over in zip(cpu_timings, overheads):
        for rank, per_rank in timings.items():
            if STEP not in per_rank or not over.get(rank):
                continue
            record = over[rank]
            runtime = record["start"] + record["end"] + sum(v[0] for k, v in record.items()
                                                            if k not in ("start", "end"))
            rest.append(per_rank[STEP] - actions_seconds(per_rank) - runtime)
    return max(0.0, statistics.median(rest)) if rest else 0.0


def _offsets(recorded) -> list[float]:
    """Per rank, what turns its `perf_counter` times into wall-clock ones (its trace's clock pair)."""
    return [rec["clock"][1] - rec["clock"][0] for rec in recorded]


def start_skews(recorded: list[dict]) -> dict[int, float]:
    """Per rank, how long after the first rank its last traced step started (`recorded`: per rank, a
    worker's `trace()`)."""
    starts = [rec["steps"][-1][0] + off for rec, off in zip(recorded, _offsets(recorded)) if rec["steps"]]
    if len(starts) != len(recorded):
        return {}
    first = min(starts)
    return {r: t - first for r, t in enumerate(starts)}


def receive_latencies(recorded: list[dict], plans) -> list[float]:
    """Seconds each message of the last traced step took to arrive once both sides were ready: for
    every receive a device blocked on, its arrival (its completion in the trace) less the later of
    its send's issue on the peer and its own issue.

    `recorded`: per rank, a worker's `trace()`; `plans`: every rank's plan (`job.compiled.plans`)."""
    offsets = _offsets(recorded)
    actions = [{a.key: a for a in plans[r]} for r in range(len(recorded))]
    if not all(rec["steps"] for rec in recorded):
        return []
    sends = {}
    for r, rec in enumerate(recorded):
        for key, start, _end, _tid in rec["steps"][-1][1]:
            a = actions[r].get(key)
            if a is not None and a.node.op == "SEND":
                sends[(r, a.peer, a.tag)] = start + offsets[r]
    out = []
    for r, rec in enumerate(recorded):
        _t0, spans, done, main = rec["steps"][-1]
        spans = [s for s in spans if s[3] == main]
        issued = {key: start + offsets[r] for key, start, _e, _t in spans}
        for prev, (key, _start, _end, _tid) in zip(spans, spans[1:]):
            a = actions[r].get(key)
            for wait in (a.waits if a is not None else ()):
                w = actions[r].get(wait)
                sent = sends.get((w.peer, r, w.tag)) if w is not None and w.node.op == "RECV" else None
                if sent is None or wait not in done or wait not in issued:
                    continue
                arrived, began = done[wait] + offsets[r], prev[2] + offsets[r]
                if arrived > began:             # it blocked: the arrival time is the message's
                    out.append(arrived - max(sent, issued[wait]))
    return out
