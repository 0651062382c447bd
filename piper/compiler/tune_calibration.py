"""What `piper tune` measures of the runtime on this machine before it predicts: a short run of two
candidates, turned into costs that apply to every candidate on the same number of devices.

The per-region compute that `piper.compiler.tune` times in its own process is only part of a step
on the CPU runtime. On a 2-core machine with 4 devices the step also holds the runtime's own work
around each action (`job.overheads()`), a latency per message that waits on a rendezvous of two
busy processes, Gloo's threads copying every byte sent, the driver's call, and whatever other
processes take of the cores. A `Calibration` holds each as it was measured:

- `runtime`: a `piper.compiler.runtime_costs.RuntimeModel` in CPU seconds (per op, per step, start
  skews, message latency), which `RuntimeModel.apply` lays onto any candidate's plans;
- `background`: CPU seconds per device and step on threads other than the step's, beyond what
  the device's bytes cost at the loopback throughput (`background_seconds` adds those);
- `compute` and `call`: a forward's or backward's CPU seconds in the workers are `compute` times
  what tune's profile (one process, one thread) says for it plus `call` per action, fitted over
  the two runs' actions (their microbatch sizes differ: a worker's compute at 4 sequences cost
  1.6-2.0x the profile's, at 8 1.2-1.4x, measured in the same rounds); `update` the same ratio
  for the optimizer's updates
  (a forward's or backward's ratio is not an update's: 1.6-2.2 against 0.9-1.6 measured);
- `collectives`: per (op, group size) a small collective's wall and CPU seconds per call
  (`job.collective_costs()`): on Gloo a call costs 0.2-1.5 ms of CPU and more of wall time
  beyond its bytes, which ZeRO-3 pays several times per region and step (`call_cost`);
- `driver`: the driver's step less the devices' span (the Ray call, the batch in, losses out);
- `wait`: seconds each data-parallel collective costs on the path beyond the above: a collective
  is a rendezvous of every member of its group, and under other load each must first get a core,
  so a structure with many (ZeRO-3's gathers and reduce-scatters) slows more than its CPU seconds
  and its calls timed between steps say (a pipeline's receive waits for one sender, whose message
  is sent ahead). Fitted with `scale` over the first run and a pure pipeline stepped in the same
  rounds, which has none (`fit_wait`), and kept where it lowers the error on a run held out of
  the pooled `scale` (below);
- `scale`: the runs' measured steps over what all of the above predicts for them (what they leave
  out on this machine, mostly the load's effect), pooled over the runs stepped together (`pool`: the
  geometric mean; the first run's alone carried its structure's own error to every other: ZeRO-3
  on dp x pp was predicted -17% to +2% before any scale, a pipeline beside it -4% to +21%, over six
  calibrations on an idle machine), carried to every candidate;
- `check_error`: the error, `scale` included, on a second candidate run beside the first (another
  mesh); `held_out`, the largest error on one run of the scale the others pool, and `spread`, how
  much the steps varied: `tolerance` makes of them which predictions can be told apart on this
  machine.

The run is cached (`$PIPER_CACHE`) by machine, torch, model, batch and device count, with the
load other processes put on the cores while it ran (`LoadMeter`): predictions are for that load.

    cal = calibrate(search)                       # two short jobs, or the cached result
    search = Search(model, 4, budget, 16, calibration=cal)
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field

from .runtime_costs import RuntimeModel, other_threads

UNCALIBRATED = 0.15   # without a calibration: the cost model's target on measured costs (suite 8)
FLOOR = 0.08       # the cost model's error measured where the machine was quiet (README, suite 8): -7.8%..+0.8%
SPLIT_SCHEDULES = ("zero_bubble", "interleaved_zero_bubble", "zbv", "dualpipev")   # BI and BW apart
STEPS = 6          # timed steps of the calibration run (after WARMUP)
WARMUP = 2


@dataclass(frozen=True)
class Calibration:
    """The runtime's costs on this machine for one device count (see the module docstring)."""

    runtime: RuntimeModel
    background: float = 0.0         # CPU s per device and step on other threads, beyond its bytes
    driver: float = 0.0             # s per step outside the devices' span
    cores: int = 1                  # the machine's cores the devices ran on
    candidate: str = ""             # the label of the run measured
    measured: float = 0.0           # its median step (s)
    predicted: float = 0.0          # what the calibrated model predicts for it (s)
    spread: float = 0.0             # its steps' median absolute deviation over their median
    external: float = 0.0           # cores other processes kept busy during it
    steps: tuple[float, ...] = field(default_factory=tuple)
    compute: float = 1.0            # the workers' compute CPU seconds over the profile's, same actions
    call: float = 0.0               # CPU s each forward or backward costs in the workers beyond that
    update: float = 1.0             # the same for the optimizer's updates (UPD)
    collectives: dict = field(default_factory=dict)   # (op, group size) -> (wall s, CPU s) per call
    check: str = ""                 # the label of another candidate run beside it
    check_measured: float = 0.0     # its median step (s)
    check_predicted: float = 0.0    # what this calibration predicts for it, `scale` included (s)
    wait: float = 0.0               # s each data-parallel collective waits beyond its costs (`fit_wait`)
    fitted: str = ""                # the label of the run `wait` was fitted on beside this one
    fitted_measured: float = 0.0    # its median step (s)
    fitted_predicted: float = 0.0   # what this calibration predicts for it, `scale` included (s)
    fitted_wait: float = 0.0        # the wait those two runs gave, kept as `wait` or not (`calibration_from`)
    pooled: float = 0.0             # `scale` fitted over every run stepped (`pool`); 0: the first's alone
    held_out: float = 0.0           # the largest error on a run of a scale pooled over the others

    @property
    def error(self) -> float:
        """The model's error on the run it was measured on, before `scale`: predicted / measured - 1."""
        return self.predicted / self.measured - 1 if self.measured and self.predicted else 0.0

    @property
    def scale(self) -> float:
        """What the runs measured over what the model predicts for them: the part of a step the
        measured costs leave out on this machine (the load's effect, mostly), carried to every
        candidate. Pooled over the runs stepped together where there were several (`pool`), else
        the first run's own."""
        if self.pooled:
            return self.pooled
        return self.measured / self.predicted if self.measured and self.predicted else 1.0

    @property
    def check_error(self) -> float | None:
        """The error on the other candidate (`check`): predicted / measured - 1; None without one."""
        return self.check_predicted / self.check_measured - 1 if self.check_measured and self.check_predicted \
            else None

    @property
    def fitted_error(self) -> float | None:
        """The error on the pipeline `wait` was fitted on (`fitted`): 0 where a wait gave both runs
        one scale, how far the first's scale carries to a pipeline where none did; None without one."""
        return self.fitted_predicted / self.fitted_measured - 1 if self.fitted_measured and self.fitted_predicted \
            else None

    @property
    def tolerance(self) -> float:
        """How far apart two predictions must be to be told apart on this machine: the largest of
        the error on a run predicted with the scale the other runs give (`held_out`; with one run,
        the model's own error), the run's step-to-step spread and `FLOOR`."""
        if self.pooled and self.held_out:
            return max(FLOOR, self.held_out, self.spread)
        check, fitted = self.check_error, self.fitted_error
        return max(FLOOR, abs(check if check is not None else self.error), abs(fitted or 0.0), self.spread)


def pool(measured, predicted) -> tuple[float, float]:
    """(scale, held_out) of runs stepped in the same rounds: their median steps `measured` and what
    the model predicts for each before any scale. The scale is the geometric mean of their
    measured over predicted (least squares on the log errors: one run's structure weighs no more
    than another's); `held_out` the largest error on one run of the scale the others pool, an
    error the scale did not see (0 with one run).

        pool([1.2, 0.9], [1.0, 1.0]) == (1.039..., 0.333...)     # 0.9 / 1.2 - 1, 1.2 / 0.9 - 1: the larger
    """
    logs = [math.log(m / p) for m, p in zip(measured, predicted) if m > 0 and p > 0]
    if not logs:
        return 1.0, 0.0
    scale = math.exp(statistics.fmean(logs))
    held_out = 0.0
    if len(logs) > 1:
        for i, own in enumerate(logs):
            rest = statistics.fmean(logs[:i] + logs[i + 1:])
            held_out = max(held_out, abs(math.exp(rest - own) - 1))
    return scale, held_out


def machine_busy() -> float:
    """CPU seconds every task on this machine has run: the root cpuacct cgroup's usage, else
    /proc/stat's busy ticks; 0 where neither can be read."""
    try:
        with open("/sys/fs/cgroup/cpuacct/cpuacct.usage") as f:
            return int(f.read()) / 1e9
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")      # less idle and iowait


class LoadMeter:
    """Cores other processes keep busy while this process works: the machine's busy CPU seconds
    less this process's (and `less`, e.g. the workers'), over the wall time since it was made."""

    def __init__(self):
        self.busy, self.own, self.wall = machine_busy(), time.process_time(), time.perf_counter()

    def cores(self, less: float = 0.0) -> float:
        wall = time.perf_counter() - self.wall
        if wall <= 0 or not self.busy:
            return 0.0
        other = machine_busy() - self.busy - (time.process_time() - self.own) - less
        return max(0.0, other / wall)


def cores_left(cores: int, external: float) -> float:
    """The cores the devices can count on: what other processes leave, at least a quarter core."""
    return max(0.25, cores - external)


def call_cost(collectives: dict, op: str, n: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one `op` call over `n` devices beyond its bytes: as measured for
    (op, n), else the nearest measured group size of `op` scaled by the ring's steps,
    (n - 1) / (m - 1), else (0, 0).

        call_cost({("ALL_GATHER", 2): (0.002, 0.0004)}, "ALL_GATHER", 4) == (0.006, 0.0012)
    """
    if n < 2:
        return 0.0, 0.0
    if (op, n) in collectives:
        wall, cpu = collectives[(op, n)]
        return wall, cpu
    sizes = sorted((abs(m - n), m) for o, m in collectives if o == op and m >= 2)
    if not sizes:
        return 0.0, 0.0
    m = sizes[0][1]
    wall, cpu = collectives[(op, m)]
    k = (n - 1) / (m - 1)
    return wall * k, cpu * k


def calls_seconds(plans, collectives: dict, runtime=None) -> float:
    """Per device (the mean over `plans`), the CPU seconds its collective calls cost beyond their
    bytes (`call_cost`), less what the runtime's thread spends issuing each (`runtime.per_action`,
    already in the plan's costs): the rest runs on Gloo's threads."""
    total = []
    for plan in plans.values():
        sec = 0.0
        for a in plan:
            node = getattr(a, "node", None)
            if node is None or node.is_compute or node.op in ("SEND", "RECV", "ALL_TO_ALL"):
                continue
            _, cpu = call_cost(collectives, node.op, len(node.devices or ()))
            sec += max(0.0, cpu - (runtime.per_action(node.op) if runtime is not None else 0.0))
        total.append(sec)
    return statistics.fmean(total) if total else 0.0


def call_latency(collectives: dict, comm):
    """`comm(node)` (the seconds of a node's bytes) plus, for a collective, its measured wall
    seconds per call (`call_cost`)."""
    def cost(node) -> float:
        extra = 0.0
        if node.op not in ("SEND", "RECV", "ALL_TO_ALL"):
            extra = call_cost(collectives, node.op, len(node.devices or ()))[0]
        return comm(node) + extra
    return cost


WAITED = ("ALL_GATHER", "ALL_REDUCE", "REDUCE_SCATTER")    # the rendezvous of a data-parallel group


def with_wait(comm, wait: float):
    """`comm(node)` plus `wait` seconds for each data-parallel collective (`WAITED`): the members'
    rendezvous, each of whom must get a core first on cores other work keeps busy."""
    if not wait:
        return comm

    def cost(node) -> float:
        return comm(node) + (wait if node.op in WAITED else 0.0)
    return cost


def fit_wait(predict, measured: tuple[float, float], *, probe: float = 5e-4, rounds: int = 10) -> float:
    """The `wait` per collective for which two runs stepped in the same rounds share one
    `scale`: `predict(wait)` gives both runs' steps (before `scale`), `measured` their median steps.
    The first root of predicted_0 / predicted_1 - measured_0 / measured_1 over 0, `probe`, 2 x
    `probe`, ... up to the first's measured step (the ratio is not monotone near 0: a few more ms
    on each collective can move the path), narrowed by `rounds` bisections; 0 where there is none
    (waits would have to cost less than nothing, or do not tell the two runs apart: the first
    run is the one with collectives, the second a pipeline without).

        fit_wait(lambda w: (0.010 + 20 * w, 0.010 + 5 * w), (0.05, 0.025)) == 0.001
    """
    m0, m1 = measured
    if m0 <= 0 or m1 <= 0:
        return 0.0

    def gap(w: float) -> float:
        p0, p1 = predict(w)
        return p0 / p1 - m0 / m1 if p1 > 0 else 0.0

    a, ga = 0.0, gap(0.0)
    if ga == 0:
        return 0.0
    b = probe
    while True:
        gb = gap(b)
        if gb == 0:
            return b
        if (gb > 0) != (ga > 0):
            break
        if b >= m0:
            return 0.0
        a, ga, b = b, gb, min(m0, 2 * b)
    for _ in range(rounds):
        c = a + ga * (b - a) / (ga - gb)          # the chord's root, inside the bracket
        c = min(max(c, a + 0.05 * (b - a)), b - 0.05 * (b - a))
        gc = gap(c)
        if gc == 0:
            return c
        if (gc > 0) == (ga > 0):
            a, ga = c, gc
        else:
            b, gb = c, gc
    return a if abs(ga) < abs(gb) else b


def comm_seconds(plans, comm) -> float:
    """Per device (the mean over `plans`), the seconds `comm(node)` gives its sends, receives and
    collectives: what Gloo's threads spend copying the device's bytes at that throughput."""
    total = [sum(comm(a.node) for a in plan if getattr(a, "node", None) is not None and not a.node.is_compute)
             for plan in plans.values()]
    return statistics.fmean(total) if total else 0.0


def pair(ordered, batch: int | None = None) -> list:
    """The candidate to calibrate on (`ordered`'s first) and one to check it with: the first after
    it on another mesh (its costs come from other kinds of action) and, with the global `batch`
    given, another microbatch size (so a compute's cost per call and per sequence can be told
    apart, `compute_fit`), else the first on another mesh, else the next."""
    if not ordered:
        return []
    first = ordered[0]
    size = (lambda c: c.microbatch(batch)) if batch else (lambda c: None)
    meshes = [c for c in ordered[1:] if (c.dp, c.pp) != (first.dp, first.pp)]
    other = next((c for c in meshes if size(c) != size(first)), None) or next(iter(meshes), None)
    return [first, other] if other is not None else ordered[:2]


def with_pipeline(chosen: list, ordered, batch: int | None = None) -> list:
    """`chosen` (`pair`'s) with a pure pipeline (dp=1, a whole backward) inserted second, where the
    first is not one and `ordered` holds one: it has no collectives, the first has ZeRO-3's
    gathers and reductions, so the two fit `wait` apart from `scale` (`fit_wait`). With the global
    `batch` given, one whose microbatch size neither of `chosen` has, nearest the first's (by
    ratio, the larger of two alike), where there is one: the three runs' computes then span three
    sizes for `compute_fit` (a forward's cost per sequence falls with the microbatch size, and
    with two sizes measured the candidates' larger ones were extrapolated)."""
    if not chosen or chosen[0].dp == 1:
        return list(chosen)
    pipes = [c for c in ordered if c.dp == 1 and c.pp > 1 and c.schedule not in SPLIT_SCHEDULES
             and c not in chosen]
    if batch:
        def size(c):
            return max(1, c.microbatch(batch))
        seen, first = {size(c) for c in chosen}, size(chosen[0])
        pipes = sorted(pipes, key=lambda c: (size(c) in seen, abs(math.log(size(c) / first)), -size(c)))
    pipe = next(iter(pipes), None)
    return [chosen[0], pipe, *chosen[1:]] if pipe is not None else list(chosen)


def choose(candidates):
    """The candidate to calibrate on: one with the most kinds of action (pipeline sends and receives,
    and ZeRO-3's gathers and reduce-scatters), a whole backward (no split), and few microbatches."""
    def score(c):
        split = c.schedule in SPLIT_SCHEDULES
        return (-(c.pp > 1) - (c.dp > 1), c.data != "zero3", split, c.schedule == "gpipe", c.microbatches < c.pp,
                c.microbatches)
    return sorted(candidates, key=score)


def measure_together(jobs, data, *, steps: int = STEPS, warmup: int = WARMUP) -> list[dict]:
    """Step `jobs` on `data` a step each in turn (a change of load falls on all alike): per job, each
    timed step's driver seconds, what its workers recorded (`job.timings(cpu=True)`,
    `job.overheads(cpu=True)`, the last traced step) and the cores other processes took meanwhile;
    after the steps, a collective call's cost on its groups (`job.collective_costs()`) and the job's
    `compiled` program."""
    runs = [{"times": [], "cpu_timings": [], "cpu_overheads": [], "traced": [], "external": []} for _ in jobs]
    for i in range(warmup + steps):
        for job, out in zip(jobs, runs):
            meter = LoadMeter()
            start = time.perf_counter()
            job.step(*data)
            wall = time.perf_counter() - start
            if i < warmup:
                continue
            timings = job.timings(cpu=True)
            out["external"].append(meter.cores(less=sum(r.get("step", 0.0) for r in timings.values())))
            out["times"].append(wall)
            out["cpu_timings"].append(timings)
            out["cpu_overheads"].append(job.overheads(cpu=True))
            out["traced"].append({"recorded": [{**r, "steps": r["steps"][-1:]} for r in job.traced()],
                                  "plans": job.compiled.plans})
    for job, out in zip(jobs, runs):     # after the steps: a call's own cost on each job's groups
        out["collectives"] = job.collective_costs() if hasattr(job, "collective_costs") else {}
        out["compiled"] = job.compiled
    return runs


def driver_seconds(times, traced) -> float:
    """The driver's step less the devices' span (first device's start to last device's last action),
    the median over steps."""
    gaps = []
    for wall, step in zip(times, traced):
        recorded = step["recorded"]
        if not all(r["steps"] for r in recorded):
            continue
        starts, ends = [], []
        for r in recorded:
            offset = r["clock"][1] - r["clock"][0]
            t0, spans, _done, _main = r["steps"][-1]
            starts.append(t0 + offset)
            ends.append(max((s[2] for s in spans), default=t0) + offset)
        gaps.append(wall - (max(ends) - min(starts)))
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def relative_spread(times) -> float:
    """The median absolute deviation of `times` over their median."""
    mid = statistics.median(times)
    return statistics.median(abs(t - mid) for t in times) / mid if mid else 0.0


def is_update(key: str) -> bool:
    """Whether a compute key is an optimizer update (`0UPD`)."""
    return key.lstrip("0123456789").startswith("UPD")


def key_samples(cpu_timings, estimated: dict[str, float], keep=None) -> list[tuple[float, float]]:
    """(measured, estimated) CPU seconds per compute key both have (`keep(key)` admits), the
    measured one the median over the timed steps."""
    samples: dict[str, list[float]] = {}
    for step in cpu_timings:
        for per_rank in step.values():
            for key, sec in per_rank.items():
                if key in estimated and (keep is None or keep(key)):
                    samples.setdefault(key, []).append(sec)
    return [(statistics.median(v), estimated[k]) for k, v in samples.items()]


def compute_ratio(cpu_timings, estimated: dict[str, float], keep=None) -> float:
    """The workers' compute CPU seconds over `estimated`'s for the same keys (each key's median over
    the timed steps, summed over the keys both have, those `keep(key)` admits); 1 where none match."""
    return _ratio(key_samples(cpu_timings, estimated, keep))


def _ratio(samples, call: float = 0.0) -> float:
    guess = sum(e for _, e in samples)
    return max(1e-3, sum(m - call for m, _ in samples) / guess) if guess > 0 else 1.0


def compute_fit(samples, *, call: float | None = None) -> tuple[float, float]:
    """(ratio, call): measured = ratio x estimated + call per action, fitted by least squares over
    `samples` ((measured, estimated) pairs); with `call` given, the ratio alone. Where the
    estimates are too alike to tell a ratio from a call (spread under 20% of their mean) or the
    fit gives a negative part, the plain ratio and no call.

        compute_fit([(0.003, 0.001), (0.005, 0.002)]) == (2.0, 0.001)
    """
    if call is not None:
        return _ratio(samples, call), call
    if len(samples) < 2:
        return _ratio(samples), 0.0
    ms, es = [m for m, _ in samples], [e for _, e in samples]
    me, mm = statistics.fmean(es), statistics.fmean(ms)
    var = sum((e - me) ** 2 for e in es)
    if me <= 0 or (var / len(es)) ** 0.5 < 0.2 * me:
        return _ratio(samples), 0.0
    ratio = sum((e - me) * (m - mm) for e, m in zip(es, ms)) / var
    intercept = mm - ratio * me
    if ratio <= 0 or intercept < 0:
        return _ratio(samples), 0.0
    return ratio, intercept


def from_run(run: dict, *, cores: int, comm, plans, candidate: str = "", estimated=None,
             collectives: dict | None = None, others=(), call: float | None = None) -> Calibration:
    """A `Calibration` from `measure`'s record of one job (`comm`: the job's `comm_cost` by bytes,
    `plans`: its representatives' plans; `estimated`: tune's compute costs per key for it;
    `collectives`: the calls' costs, default the run's own, `job.collective_costs()`), before
    its own prediction is known. `others`: (record, estimated) of other jobs stepped beside it,
    whose computes join the fit of `compute` and `call` (`compute_fit`); `call`: keep that one."""
    runtime = RuntimeModel.measured(run["cpu_overheads"], run["traced"])
    collectives = dict(collectives if collectives is not None else run.get("collectives", {}))
    background = max(0.0, other_threads(run["cpu_timings"], run["cpu_overheads"]) - comm_seconds(plans, comm)
                     - calls_seconds(plans, collectives, runtime))
    estimated = estimated or {}
    computes = lambda k: not is_update(k)  # noqa: E731
    samples = key_samples(run["cpu_timings"], estimated, computes)
    for other, guess in others:
        samples += key_samples(other["cpu_timings"], guess, computes)
    ratio, per_call = compute_fit(samples, call=call)
    return Calibration(runtime, background, driver_seconds(run["times"], run["traced"]), cores, candidate,
                       statistics.median(run["times"]), 0.0, relative_spread(run["times"]),
                       statistics.median(run["external"]) if run["external"] else 0.0, tuple(run["times"]),
                       ratio, per_call, compute_ratio(run["cpu_timings"], estimated, is_update), collectives)
