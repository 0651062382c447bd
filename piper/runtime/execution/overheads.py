"""The runtime's own time in a step, outside its computes (`job.overheads()`).

A step's thread does more than its computes: it issues sends, receives and
collectives, routes what arrives, samples memory, runs the plan loop, and
before the first action and after the last moves the batch in, readies the
gradient buffers, waits for the last sends and collects the losses. A cost
model that charges only the computes (`job.timings()`) misses that time, which
matters most for small models. `StepMarks` stamps the wall clock before each
plan entry (and the thread's CPU clock three times a step), and adds up the
wall time the thread blocks in waits for communication; `overheads` turns the
stamps, when read, into seconds per op:

    {"start": 6e-05, "end": 3e-04, "F": (1.3e-04, 8), "SEND": (8.1e-04, 8), "RECV": ..., "B": ..., "UPD": ...}

An entry's time runs from its stamp to the next one, less the computes it ran
on this thread (`timings`) and the time blocked waiting for communication (the
simulator's own business): what is left is routing, issuing, the loop, and
stalls inside communication calls. In CPU seconds, the loop's CPU time outside
computes is shared out over the ops by that wall time. An overlapped slot run in lanes counts as one entry, op
`SLOT` (its other lanes run in other threads). CPU devices: on a GPU the wall
times of computes are the device's, not the host's. `piper.compiler.runtime_costs`
makes these a per-action cost for the simulator.
"""
from __future__ import annotations

import time

SLOT_OP = "SLOT"


class StepMarks:
    """The thread's wall clock before each plan entry (and its CPU clock at the first), both clocks at
    the step's start, after the loop and at the end; `waited` gathers the wall seconds blocked in
    waits since the last stamp (`StepLoop._run`). A stamp costs ~0.3 µs: the CPU clock is a system
    call, read three times a step."""

    __slots__ = ("start", "first_cpu", "marks", "waits", "waited", "loop_end", "end")

    def __init__(self):
        self.start = self.loop_end = self.end = self.first_cpu = None
        self.marks: list[tuple[int, float]] = []
        self.waits: list[float] = []
        self.waited = 0.0

    def begin(self) -> None:
        self.marks, self.waits, self.waited, self.loop_end, self.end = [], [], 0.0, None, None
        self.start = (time.thread_time(), time.perf_counter())
        self.first_cpu = None

    def mark(self, index: int) -> None:
        if self.first_cpu is None:
            self.first_cpu = time.thread_time()
        self.waits.append(self.waited)
        self.waited = 0.0
        self.marks.append((index, time.perf_counter()))

    def loop_done(self) -> None:
        self.waits.append(self.waited)
        self.loop_end = (time.thread_time(), time.perf_counter())

    def done(self) -> None:
        self.end = (time.thread_time(), time.perf_counter())


def _own_computes(executor, span, timings) -> float:
    """Seconds of the computes of `span` that ran on the step's thread."""
    lanes = span.lanes if executor._interleave else span.lanes[:1]
    actions = [*span.before, *(a for lane in lanes for a in lane), *span.after]
    return sum(timings.get(a.key, 0.0) for a in actions if a.node.is_compute)


def overheads(executor, cpu: bool = False) -> dict:
    """The last step's runtime seconds (wall, or the thread's CPU with `cpu`): `start`, `end`, and per op
    (seconds, entries); {} before a step has finished.

    Entries are stamped on the wall clock only; in CPU seconds each op gets its wall share of the
    loop's CPU time outside computes (the thread's CPU over the loop less its computes', read once),
    so the total is exact and the split follows where the wall time went."""
    m = executor._marks
    if m.end is None or m.loop_end is None or not m.marks:
        return {}
    plan = executor.spec.plan
    out: dict[str, list] = {}
    ends = [t for _, t in m.marks[1:]] + [m.loop_end[1]]
    own_cpu = 0.0
    for (i, t0), t1, waited in zip(m.marks, ends, m.waits[1:]):
        span = executor._spans.get(i)
        if span is None:
            node = plan[i].node
            op = node.op
            own = executor.timings.get(plan[i].key, 0.0) if node.is_compute else 0.0
            own_cpu += executor.cpu_timings.get(plan[i].key, 0.0) if node.is_compute else 0.0
        else:
            op, own = SLOT_OP, _own_computes(executor, span, executor.timings)
            own_cpu += _own_computes(executor, span, executor.cpu_timings)
        entry = out.setdefault(op, [0.0, 0])
        entry[0] += max(0.0, t1 - t0 - own - waited)
        entry[1] += 1
    c = 0 if cpu else 1
    scale = 1.0
    if cpu:
        wall = sum(sec for sec, _ in out.values())
        scale = max(0.0, m.loop_end[0] - m.first_cpu - own_cpu) / wall if wall > 0 else 0.0
    start = (m.first_cpu if cpu else m.marks[0][1]) - m.start[c]
    return {"start": start, "end": m.end[c] - m.loop_end[c],
            **{op: (sec * scale, n) for op, (sec, n) in out.items()}}


def read_overheads(worker, cpu: bool = False) -> dict:
    """Inside a worker (`actor.__ray_call__`): `overheads` of its executor."""
    return overheads(worker.executor, cpu)
