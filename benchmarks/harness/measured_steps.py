"""One job's steps measured and predicted: `Recorder` times `job.step` and keeps what the workers
recorded (`Measured`: per-action costs, the runtime's own costs, the machine's busy cores), and
`predict` runs the simulator on the job's plans with those costs. Suites 5, 8 and 9 use them.
"""
from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass, field

from piper.compiler.runtime_costs import RuntimeModel, other_threads
from piper.compiler.simulate import SLOT, STEP, actions_seconds, simulate, timed_slots
from piper.compiler.tune_calibration import machine_busy

from . import probes

CORES = len(os.sched_getaffinity(0))       # the cores this process may run on: what the job's devices share
_PASS = re.compile(r"^\d+(F|BI|BW|B|UPD)\d*$")


@dataclass
class Measured:
    """Steady-state step times of one job, and what its workers recorded in those steps."""

    times: list[float] = field(default_factory=list)             # driver job.step seconds
    run_steps: list[float] = field(default_factory=list)         # slowest worker's run_step seconds
    timings: list[dict[int, dict[str, float]]] = field(default_factory=list)   # job.timings() per step
    cpu_timings: list[dict[int, dict[str, float]]] = field(default_factory=list)   # job.timings(cpu=True)
    overheads: list[dict[int, dict]] = field(default_factory=list)     # job.overheads(): runtime time outside computes
    cpu_overheads: list[dict[int, dict]] = field(default_factory=list)     # job.overheads(cpu=True)
    traced: list[dict] = field(default_factory=list)     # {"recorded": job.traced() (last step), "plans": ...}
    machine: list[tuple[float, float, float]] = field(default_factory=list)   # (busy core-s, wall s, driver CPU s)
    losses: list[float] = field(default_factory=list)

    @property
    def step(self) -> float:
        return statistics.median(self.times)

    @property
    def worker(self) -> float | None:
        return statistics.median(self.run_steps) if self.run_steps else None

    @property
    def spread(self) -> float:
        return (max(self.times) - min(self.times)) / self.step

    def costs(self, cpu: bool = False) -> dict[str, float]:
        """Seconds per action key: the median over the timed steps and over the ranks that run it
        (CPU seconds with `cpu`)."""
        samples: dict[str, list[float]] = {}
        for step in (self.cpu_timings if cpu else self.timings):
            for per_rank in step.values():
                for key, sec in per_rank.items():
                    samples.setdefault(key, []).append(sec)
        return {k: statistics.median(v) for k, v in samples.items()}

    def background(self) -> float:
        """CPU seconds per device and step outside the timed actions (median over steps and ranks):
        the worker process's whole CPU time in the step (every thread) minus its actions' own."""
        rest = [per_rank[STEP] - actions_seconds(per_rank)
                for step in self.cpu_timings for per_rank in step.values() if STEP in per_rank]
        return max(0.0, statistics.median(rest)) if rest else 0.0

    def only(self, steps) -> "Measured":
        """These timed steps alone (indices)."""
        def pick(xs):
            return [xs[i] for i in steps] if len(xs) == len(self.times) else []
        return Measured(pick(self.times), pick(self.run_steps), pick(self.timings), pick(self.cpu_timings),
                        pick(self.overheads), pick(self.cpu_overheads), pick(self.traced), pick(self.machine))

    def runtime(self, cpu: bool = False) -> RuntimeModel:
        """The runtime's own costs in these steps (`piper.compiler.runtime_costs`): its time per action and
        per step, wall-clock (less blocking waits) or CPU seconds, start skews and message latency."""
        return RuntimeModel.measured(self.cpu_overheads if cpu else self.overheads, self.traced)

    def other_threads(self) -> float:
        """`background` less the step thread's runtime work (which `runtime(cpu=True)` puts into the costs)."""
        return other_threads(self.cpu_timings, self.cpu_overheads)

    def external_cores(self, steps=None) -> float | None:
        """Cores other processes kept busy on average during the timed steps (`steps`: their
        indices, default all): the machine's busy CPU seconds (`machine_busy`) less the workers'
        (`step`) and the driver's, over the wall time. Ray's own daemons count as other processes."""
        if not self.machine or len(self.machine) != len(self.cpu_timings):
            return None
        steps = range(len(self.machine)) if steps is None else steps
        busy = sum(self.machine[i][0] - self.machine[i][2] -
                   sum(r.get(STEP, 0.0) for r in self.cpu_timings[i].values()) for i in steps)
        return max(0.0, busy / sum(self.machine[i][1] for i in steps))

    def stretch(self) -> float | None:
        """The timed actions' wall seconds over their CPU seconds (every rank and step): 1 where every
        device had a core to itself while computing."""
        cpu = sum(actions_seconds(r) for step in self.cpu_timings for r in step.values())
        wall = sum(actions_seconds(r) for step in self.timings for r in step.values())
        return wall / cpu if cpu else None

    def compute(self, cpu: bool = False) -> float:
        """The busiest rank's compute seconds per step (median over steps; CPU seconds with `cpu`).

        Actions of an overlapped slot count one by one (the slot's own `a&b` entry,
        the span it kept the device busy, is not added again)."""
        return statistics.median(max(actions_seconds(r) for r in step.values())
                                 for step in (self.cpu_timings if cpu else self.timings))

    def by_pass(self) -> dict[str, float]:
        """The busiest rank's compute seconds per pass: F, backward (B + BI + BW), UPD (medians over steps)."""
        out: dict[str, list[float]] = {"F": [], "backward": [], "UPD": []}
        for step in self.timings:
            busiest = max(step.values(), key=actions_seconds)
            sums = {k: 0.0 for k in out}
            for key, sec in busiest.items():
                if SLOT in key:
                    continue
                op = _PASS.match(key).group(1) if _PASS.match(key) else "F"
                sums["F" if op == "F" else "UPD" if op == "UPD" else "backward"] += sec
            for k, v in sums.items():
                out[k].append(v)
        return {k: statistics.median(v) for k, v in out.items() if v}


class Recorder:
    """Time `job.step` and collect `job.timings()` (and each worker's run_step) after each timed step."""

    def __init__(self, job, *, worker_probe: bool = True):
        self.job = job
        self.data = Measured()
        self.worker_probe = worker_probe
        if worker_probe:
            probes.install(job)          # wraps run_step only (no compute probes)

    def step(self, *batch) -> float:
        b0, c0 = machine_busy(), time.process_time()
        t0 = time.perf_counter()
        loss = self.job.step(*batch)
        self._last = time.perf_counter() - t0
        self._machine = (machine_busy() - b0, self._last, time.process_time() - c0)
        return loss

    def record(self) -> None:
        """Keep the last step's numbers (call after a timed step; reading is not timed)."""
        self.data.times.append(self._last)
        self.data.timings.append(self.job.timings())
        self.data.cpu_timings.append(self.job.timings(cpu=True))
        self.data.overheads.append(self.job.overheads())
        self.data.cpu_overheads.append(self.job.overheads(cpu=True))
        recorded = [{**r, "steps": r["steps"][-1:]} for r in self.job.traced()]
        self.data.traced.append({"recorded": recorded, "plans": self.job.compiled.plans})
        self.data.machine.append(self._machine)
        if self.worker_probe:
            self.data.run_steps.append(max(r["run_step"] for r in probes.read(self.job)))


def run_steps(recorders: dict[str, Recorder], batches, *, warmup: int, steps: int) -> dict[str, BaseException]:
    """Step every recorder in turn (A B A B ...) on the same batches; record the steps after warm-up."""
    errors: dict[str, BaseException] = {}
    for i in range(warmup + steps):
        for name, rec in recorders.items():
            if name in errors:
                continue
            try:
                rec.data.losses.append(rec.step(*batches[i]))
                if i >= warmup:
                    rec.record()
            except Exception as exc:
                errors[name] = exc
    return errors


def missing_costs(plans, costs: dict[str, float]) -> list[str]:
    return sorted({a.key for plan in plans.values() for a in plan
                   if getattr(a, "node", None) is not None and a.node.is_compute and a.key not in costs})


def predict(job, costs: dict[str, float], comm_cost=None, overlap=None, cores: float | None = None,
            background: float = 0.0, runtime: RuntimeModel | None = None):
    """The simulator's step on the plans (one replica per data-parallel shard), with `costs` per key.

    Keys the runtime did not time cost 0 (reported by `missing_costs`). `overlap`
    defaults to the slots the runtime ran in lanes, each costing the span it was
    timed at. `cores`: the job's devices share this many cores (costs in CPU seconds), each
    also spending `background` CPU seconds per step outside its actions. `runtime`: the runtime's
    own costs (`RuntimeModel.apply`; its message latency prices receives, `comm_cost` the rest)."""
    plans = job.compiled.plans.representatives()
    full = {**{k: 0.0 for k in missing_costs(plans, costs)}, **costs}
    if overlap is None:
        overlap = timed_slots(costs)
    if runtime is not None:
        plans, full = runtime.apply(plans, full, overlap)
        comm_cost = runtime.comm_cost(comm_cost)
    return simulate(plans, costs=full, comm_cost=comm_cost, overlap=overlap, cores=cores,
                    devices=job.mesh.world_size, background=background)
