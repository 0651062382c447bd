"""The runtime's own work as a cost model: what each action and each step costs a device's thread
beyond its computes, measured by the runtime (`job.overheads()`, `piper/runtime/dispatch.py`), as
per-action costs for `simulate`.

`job.timings()` times the computes; between them a device's thread issues and
waits for communication, routes what arrives, samples memory and runs the plan
loop, and each step starts and ends with fixed work. A `DispatchModel` holds
those CPU seconds per action of each op (F, B, SEND, RECV, ...) and per step
(`start`, `end`), so it applies to any plan, not only the one it was measured
on: `fold` adds them to the compute costs of a plan, each action's share to the
compute that runs next to it on the same thread.

    model = DispatchModel.measured([job.overheads() for each timed step])
    sim = simulate(plans, costs=model.fold(plans, costs), ...)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .simulate import SLOT, STEP, actions_seconds

COMPUTE_OPS = ("F", "B", "BI", "BW", "UPD")
# An op the measured run did not have costs what its nearest measured kin did.
KIN = {"BI": ("B", "F"), "BW": ("B", "F"), "B": ("BI", "F"), "F": ("B",), "UPD": (),
       "SEND": ("RECV",), "RECV": ("SEND",)}


@dataclass(frozen=True)
class DispatchModel:
    """CPU seconds a device's thread spends outside its computes: `per_op` per action of each op,
    `start` before a step's first action and `end` after its last."""

    per_op: dict[str, float] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0

    @classmethod
    def measured(cls, records) -> "DispatchModel":
        """From `job.overheads()` results (one per step) or single ranks' dicts: per op, the median over
        ranks and steps of its mean per action; `start` and `end` the medians."""
        per: dict[str, list[float]] = {}
        starts, ends = [], []
        for record in _rank_records(records):
            if not record:
                continue
            starts.append(record["start"])
            ends.append(record["end"])
            for op, value in record.items():
                if op not in ("start", "end") and value[1]:
                    per.setdefault(op, []).append(value[0] / value[1])
        return cls({op: statistics.median(v) for op, v in per.items()},
                   statistics.median(starts) if starts else 0.0, statistics.median(ends) if ends else 0.0)

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
        first compute go to that compute), `start` on each rank's first compute, `end` on its last."""
        out: dict[str, float] = {}
        for plan in plans.values():
            computes = [a for a in plan if getattr(a, "node", None) is not None and a.node.is_compute]
            if not computes:
                continue
            last = computes[0].key
            out[last] = out.get(last, 0.0) + self.start
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
        """`costs` (compute key -> seconds) with `extra(plans)` added; an overlapped slot's timed cost
        (`a&b`, one of `overlap`'s groups) gets the sum of its members' extras."""
        extra = self.extra(plans)
        out = dict(costs)
        for key, sec in extra.items():
            out[key] = out.get(key, 0.0) + sec
        for group in overlap:
            slot = SLOT.join(group)
            if slot in out:
                out[slot] += sum(extra.get(k, 0.0) for k in group)
        return out

    def plan_seconds(self, plan) -> float:
        """One rank's runtime seconds per step under this model."""
        return self.start + self.end + sum(self.per_action(a.node.op) for a in plan
                                           if getattr(a, "node", None) is not None)


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

    `cpu_timings` and `overheads`: `job.timings(cpu=True)` and `job.overheads()` of the same steps."""
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
