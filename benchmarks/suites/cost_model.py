"""Suite 8, `cost-model`: how well Piper's simulator predicts a real step.

For each strategy of suites 1 and 2 (pipeline schedules on pp=2 and pp=4;
dp and zero3 on dp=2), a few steps run on Ray workers; the per-action compute
times the runtime records (`job.timings()`) in the steady-state steps are the
costs, keyed by action key (`0F3`, `1B2`, `0BI1`, `0UPD`; the median over the
timed steps, and over data-parallel replicas, whose actions share keys), and

    simulate(job.compiled.plans.representatives(), costs=..., comm_cost=...)

predicts the step time, compared with the measured median step time. Two
communication models: none (comm cost 0), and latency + bytes / bandwidth
from a Gloo ping-pong between two Ray actors. The simulator predicts what
happens inside the workers, so the driver's per-step cost (the Ray call,
shipping the batch, collecting losses) is measured apart: the gap between
the driver's step time and the slowest worker's `run_step`, and a trivially
small model's step time minus its own prediction.

    python -m benchmarks --suite cost-model
"""
from __future__ import annotations

import functools
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

import piper
from piper.compiler.report import inflight_peak

from ..harness.machine import ray_cluster
from ..harness.measured_steps import CORES, Recorder, missing_costs, predict, run_steps
from ..harness.results import SuiteResult, Table, ms, short_error
from ..harness.workloads import (PIPELINE_SCHEDULES, GPTWorkload, gpt_batches, make_chain, make_gpt,
                                 schedule_strategy, zero_strategy)

MICROBATCHES = 8
TARGET = 0.15


# -- the communication model ------------------------------------------------------------------------

@dataclass
class LinkModel:
    """t(bytes) = latency + bytes / bandwidth for one point-to-point message on this machine."""

    latency: float
    bandwidth: float            # bytes per second

    def p2p(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def for_job(self, job):
        """A `comm_cost(node)` for `simulate`: receives by value size; ring collectives by unit size."""
        sizes = {(v.producer, v.index): v.spec.nbytes for v in job.program.values}
        units = {u: sum(b.padded * torch.empty((), dtype=b.dtype).element_size() for b in layout.buckets)
                 for u, layout in job.layouts.items()}
        groups = {u: len(layout.group) for u, layout in job.layouts.items()}

        def cost(node) -> float:
            if node.op == "RECV":
                producer = node.region if node.phase == "B" else node.peer
                return self.p2p(sizes.get((producer, node.value), 0))
            n = groups.get(node.region, 1)
            if n <= 1:
                return 0.0
            nbytes = units.get(node.region, 0)
            hops = 2 * (n - 1) if node.op == "ALL_REDUCE" else n - 1
            return hops * self.latency + hops / n * nbytes / self.bandwidth
        return cost


def _ping(worker, sizes: list[int], reps: int) -> list[float]:
    """Inside a TorchWorker (via __ray_call__): Gloo ping-pong, rank 0 times half a round trip per size."""
    import torch.distributed as dist

    out = []
    for n in [sizes[-1]] + sizes:                  # one warm-up pass at the largest size
        buf = torch.zeros(n // 4, dtype=torch.float32)
        samples = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if worker.rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i:
                samples.append((time.perf_counter() - t0) / 2)
        out.append(statistics.median(samples))
    return out[1:]


def measure_link(timeout: float = 60.0) -> tuple[LinkModel, list[tuple[int, float]]]:
    """Fit latency and bandwidth from a Gloo ping-pong between two Ray actors."""
    import ray

    from ..baselines.torch_group import TorchGroup

    sizes = [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20]
    with TorchGroup(2, timeout=timeout) as group:
        times = ray.get([a.__ray_call__.remote(_ping, sizes, 9) for a in group.actors], timeout=timeout)[0]
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sum((x - mx) ** 2 for x in sizes)
    latency = max(0.0, my - slope * mx)
    return LinkModel(latency, 1 / slope if slope > 0 else float("inf")), list(zip(sizes, times))


# -- the suite --------------------------------------------------------------------------------------

def workloads(quick: bool) -> tuple[GPTWorkload, GPTWorkload, int]:
    """(pipelines' model as suite 1, data parallel's model as suite 2, its regions)."""
    if quick:
        return (GPTWorkload(n_layer=4, n_embd=32, n_head=2, block_size=16, batch=16),
                GPTWorkload(n_layer=2, n_embd=32, n_head=2, block_size=16, batch=8), 2)
    return (GPTWorkload(n_layer=8, n_embd=128, n_head=4, block_size=64, batch=32),
            GPTWorkload(n_layer=4, n_embd=128, n_head=4, block_size=64, batch=32), 4)


def cases(quick: bool):
    """(label, mesh, kind) in order: pipelines on pp=2 and pp=4, then dp and zero3 on dp=2."""
    if quick:
        pp = [(2, k) for k in ("1f1b", "dualpipev")]
    else:
        pp = [(p, k) for p in (2, 4) for k in PIPELINE_SCHEDULES]
    out = [(f"pp={p}", {"pp": p}, k) for p, k in pp]
    out += [("dp=2", {"dp": 2}, level) for level in (("zero3",) if quick else ("dp", "zero3"))]
    return out


ACCURACY_NOTES = [
        "costs: job.timings() of every timed (steady-state) step, per action key; the median over those steps, "
        "and over data-parallel replicas (their actions share keys). Pipeline ranks have distinct keys (their "
        "regions differ), so each device keeps its own costs.",
        "predicted: simulate(job.compiled.plans.representatives(), costs=...) — one replica per data-parallel "
        "shard, communication issued asynchronously as the runtime does. 'comm 0': every transfer and "
        "collective is free; '+ Gloo model': a receive costs latency + bytes / bandwidth, a ring collective "
        "(n-1) or 2(n-1) hops of latency + its share of the unit's bytes, from the ping-pong below.",
        "error = predicted / measured - 1 (negative: the prediction is low). 'measured' is the driver's "
        "job.step; 'worker run_step' the slowest worker's own time for the step (the gap is the Ray call, "
        "shipping the batch in and the losses out); 'error vs run_step' compares the prediction with it; "
        "'error + overhead model' adds the small-model overhead below (fixed + per action of the busiest "
        "device's plan) to the prediction. 'error + runtime model': instead, the runtime's own costs measured "
        "in the same steps (piper.compiler.runtime_costs.RuntimeModel: its time per action of each op outside computes "
        "and blocking waits and per step, job.overheads(); each device's start after the first's and the time a "
        "message took to arrive once both sides were ready, job.traced()); '(CPU, cores left) + runtime model' the "
        "same in CPU seconds (job.overheads(cpu=True)) with the background less the step thread's runtime work, on "
        "the cores other processes left the job (the machine's cores less 'other load': the machine's busy CPU "
        "during the timed steps less the job's workers and driver, Ray's daemons included; at least 1).",
        "overlapped slots (dualpipev's [F, B]) run in two lanes at once on the CPU runtime; the simulator "
        "runs each as one unit costing the span the runtime timed it at (first lane's start to last lane's "
        "end, job.timings()'s `a&b` entries).",
        "Every device is a single-threaded CPU process on a 2-core machine, so with 4 devices the compute of "
        "two devices shares a core: the recorded wall-clock per-action times include that slowdown where it "
        "happened, which the simulator then treats as fixed costs. 'CPU costs, cores shared': each action "
        "costs its worker thread's CPU seconds (job.timings(cpu=True): its time on a core of its own), and "
        f"simulate(..., cores={CORES}) stretches every cost by max(1, devices computing on average / cores), "
        "iterated to a fixed point (a mean-field model of devices sharing cores), with the Gloo model; each "
        "device also demands its measured background CPU per step (the worker process's CPU seconds in the "
        "step, every thread, minus its actions': runtime work and Gloo's threads).",
]

SHAPE_NOTES = [
        "bubble fraction: 1 - compute / (devices x predicted step), from the simulated timeline; in-flight "
        "peak: piper.compiler.report.inflight_peak, the most microbatches whose forward ran and whose backward has not "
        "finished, per device (rank order); a device holding two regions counts a microbatch once per region "
        "it is live in (interleaved, zbv, dualpipev).",
        "compute: the busiest device's sum of job.timings() per step (median over the timed steps). On this "
        "CPU runtime a split backward (BI then BW, two autograd passes: zbv, and dualpipev's drain) costs more "
        "than one whole B; compare with interleaved, which has as many regions per device but whole backwards.",
]


def _case(mesh: dict, kind: str, pp_wl, dp_wl, dp_regions: int, pp_batches, dp_batches):
    """(strategy, its source, why it is missing, model_kw, batches) for one row of `cases`."""
    if "pp" in mesh:
        p = mesh["pp"]
        strategy, source, note = schedule_strategy(kind, pp=p, microbatches=MICROBATCHES)
        return strategy, source, note, pp_wl.model_kw(p * PIPELINE_SCHEDULES[kind][1]), pp_batches
    strategy, source, note = zero_strategy(kind, dp=mesh["dp"])
    return strategy, source, note, dp_wl.model_kw(dp_regions), dp_batches


def _predictions(job, data, link) -> dict:
    """The step each model predicts from one job's timed steps (see ACCURACY_NOTES)."""
    costs, cpu_costs = data.costs(), data.costs(cpu=True)
    comm = link.for_job(job) if link else None
    return {
        "comm 0": predict(job, costs),
        "gloo": predict(job, costs, comm_cost=comm) if link else None,
        "cpu": predict(job, cpu_costs, comm_cost=comm, cores=CORES, background=data.background()),
        # The runtime's own costs, measured in these steps (piper.compiler.runtime_costs): wall and CPU.
        "runtime": predict(job, costs, comm_cost=comm, runtime=data.runtime()),
        "cpu runtime": predict(job, cpu_costs, comm_cost=comm,
                               cores=max(1.0, CORES - (data.external_cores() or 0.0)),
                               background=data.other_threads(), runtime=data.runtime(cpu=True)),
    }


def _report(tables, result, errors: dict, key: str, row: tuple, job, data, sims: dict, overhead) -> None:
    """One strategy's row of both tables, its metrics, and its errors for the summary."""
    accuracy, shape = tables
    sim0, simc, simcpu = sims["comm 0"], sims["gloo"], sims["cpu"]
    measured = data.step
    err0 = sim0.step_time / measured - 1
    errc = simc.step_time / measured - 1 if simc else None
    err_worker = (simc or sim0).step_time / data.worker - 1 if data.worker else None
    err_fixed = ((simc or sim0).step_time + overhead(job)) / measured - 1 if overhead is not None else None
    err_cpu = simcpu.step_time / measured - 1
    err_cpu_fixed = (simcpu.step_time + overhead(job)) / measured - 1 if overhead is not None else None
    err_rt = sims["runtime"].step_time / measured - 1
    err_cpu_rt = sims["cpu runtime"].step_time / measured - 1
    errors["runtime"].append(err_cpu_rt)
    errors["raw"].append(err0)
    if err_fixed is not None:
        errors["fixed"].append(err_fixed)
    errors["cpu"].append(err_cpu_fixed if err_cpu_fixed is not None else err_cpu)
    accuracy.add(*row, ms(measured), ms(data.worker), ms(sim0.step_time), _pct(err0),
                 ms(simc.step_time) if simc else None, _pct(errc), _pct(err_worker), _pct(err_fixed),
                 _pct(err_rt), ms(simcpu.step_time), _pct(err_cpu), _pct(err_cpu_fixed), _pct(err_cpu_rt),
                 data.external_cores(), data.spread)
    sim = simc or sim0
    plans = job.compiled.plans.representatives()
    n_compute = {r: len(job.compiled.compute_order(r)) for r in plans}
    shape.add(*row, "/".join(str(n_compute[r]) for r in sorted(n_compute)),
              ms(data.compute()), f"{sim.bubble_fraction:.3f}",
              "/".join(str(inflight_peak(sim, r)) for r in sorted(plans)))
    for metric, value in (("measured_ms", ms(measured)), ("worker_ms", ms(data.worker)),
                          ("predicted_ms", ms(sim0.step_time)), ("error", err0),
                          ("predicted_comm_ms", ms(simc.step_time) if simc else None), ("error_comm", errc),
                          ("error_vs_worker", err_worker), ("error_plus_overhead", err_fixed),
                          ("predicted_cpu_shared_ms", ms(simcpu.step_time)), ("error_cpu_shared", err_cpu),
                          ("error_cpu_shared_plus_overhead", err_cpu_fixed),
                          ("error_plus_runtime", err_rt), ("error_cpu_shared_plus_runtime", err_cpu_rt),
                          ("bubble_fraction", sim.bubble_fraction)):
        if value is not None:
            result.metrics[f"{key}.{metric}"] = value


def _summary(result, errors: dict) -> None:
    errors_raw, errors_fixed, errors_cpu, errors_runtime = (errors[k] for k in ("raw", "fixed", "cpu", "runtime"))
    if not errors_raw:
        return
    within = sum(1 for e in errors_raw if abs(e) <= TARGET)
    line = (f"{within} of {len(errors_raw)} strategies predicted within ±{TARGET:.0%} (comm 0, raw); "
            f"median |error| {statistics.median(abs(e) for e in errors_raw):.1%}")
    if errors_fixed:
        line += (f"; with the overhead model {sum(1 for e in errors_fixed if abs(e) <= TARGET)} of "
                 f"{len(errors_fixed)}, median |error| {statistics.median(abs(e) for e in errors_fixed):.1%}")
    if errors_cpu:
        line += (f"; CPU costs on shared cores (+ overhead model) {sum(1 for e in errors_cpu if abs(e) <= TARGET)}"
                 f" of {len(errors_cpu)}, median |error| {statistics.median(abs(e) for e in errors_cpu):.1%}")
    if errors_runtime:
        line += (f"; CPU costs on the cores left + the runtime model (measured, nothing fitted) "
                 f"{sum(1 for e in errors_runtime if abs(e) <= TARGET)} of {len(errors_runtime)}, median |error| "
                 f"{statistics.median(abs(e) for e in errors_runtime):.1%}")
    result.notes.append(line + ". With wall-clock costs predictions are low, more so on 4 devices, where 4 "
                        "single-threaded devices share 2 cores and a device whose input has arrived can still "
                        "wait for a core; CPU costs with simulate(cores=...) model that sharing.")
    result.metrics["within_target.raw"] = within
    result.metrics["within_target.cpu_shared"] = sum(1 for e in errors_cpu if abs(e) <= TARGET)
    result.metrics["within_target.cpu_shared_runtime"] = sum(1 for e in errors_runtime if abs(e) <= TARGET)


def _link_notes(accuracy, result, link, link_points, overhead) -> None:
    if link:
        accuracy.notes.append(
            f"Gloo link model: latency {link.latency * 1e6:.0f} µs, bandwidth {link.bandwidth / 2**30:.2f} GiB/s "
            "(fit of half round trips: " + ", ".join(f"{n >> 10} KiB {t * 1e6:.0f} µs" for n, t in link_points) + ")")
        result.metrics["link.latency_us"] = link.latency * 1e6
        result.metrics["link.bandwidth_gib_s"] = link.bandwidth / 2**30
    if overhead is not None:
        accuracy.notes.append(
            f"overhead model: {overhead.fixed * 1e3:.1f} ms per step + {overhead.per_action * 1e6:.0f} µs per action "
            "of the busiest device's plan, fitted on a 2-region chain of 4x4 linears (1F1B on pp=2; compute nearly "
            "free) from its measured step minus its own prediction: "
            + ", ".join(f"{n} actions: {o * 1e3:.1f} ms" for n, o in overhead.points) + ".")
        result.metrics["overhead.fixed_ms"] = overhead.fixed * 1e3
        result.metrics["overhead.per_action_us"] = overhead.per_action * 1e6


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    pp_wl, dp_wl, dp_regions = workloads(quick)
    warmup, steps = (1, 3) if quick else (2, 5)
    timeout = 120.0
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    pp_batches = gpt_batches(pp_wl, warmup + steps)
    dp_batches = gpt_batches(dp_wl, warmup + steps)
    result = SuiteResult("cost-model", 8, "Cost-model accuracy: simulated vs measured step time",
                         ctx.command("cost-model"))
    accuracy = Table(f"Predicted vs measured step time (median of {steps} steps after {warmup} warm-up); "
                     f"pipelines: {pp_wl.describe()}, {MICROBATCHES} microbatches; dp=2: {dp_wl.describe(dp_regions)}",
                     ["mesh", "strategy", "measured ms", "worker run_step ms", "predicted ms (comm 0)",
                      "error (comm 0)", "predicted ms (+ Gloo model)", "error (+ Gloo model)",
                      "error vs run_step", "error + overhead model", "error + runtime model",
                      f"predicted ms (CPU costs, {CORES} cores shared)", "error (CPU, shared)",
                      "error (CPU, shared) + overhead model", "error (CPU, cores left) + runtime model", "other load (cores)",
                      "spread"])
    shape = Table("What the simulator predicts about each schedule (measured per-action costs, Gloo model)",
                  ["mesh", "strategy", "compute actions / device", "busiest device compute ms",
                   "predicted bubble fraction", "in-flight peak per device (microbatches)"])
    link = link_points = None
    overhead = None
    errors: dict[str, list[float]] = {"raw": [], "fixed": [], "cpu": [], "runtime": []}
    with ray_cluster():
        try:
            ctx.log("cost-model: Gloo ping-pong between two actors")
            link, link_points = measure_link()
        except Exception as exc:
            result.notes.append(f"the Gloo ping failed ({short_error(exc)}): predictions use comm cost 0 only")
            ctx.log(traceback.format_exc())
        try:
            ctx.log("cost-model: fixed per-step overhead on a trivially small model")
            overhead = _fixed_overhead(optimizer, timeout, quick)
        except Exception as exc:
            result.notes.append(f"the fixed-overhead run failed: {short_error(exc)}")
            ctx.log(traceback.format_exc())
        for mesh_label, mesh, kind in cases(quick):
            ctx.log(f"cost-model: {kind} on {mesh_label}")
            strategy, source, note, kw, batches = _case(mesh, kind, pp_wl, dp_wl, dp_regions, pp_batches,
                                                        dp_batches)
            name = f"{kind} ({source})"
            if strategy is None:
                accuracy.add(mesh_label, name, f"not available: {note}", *[None] * 14)
                continue
            try:
                with piper.compile(make_gpt(kw)[0], batches[0], strategy=strategy, mesh=mesh, optimizer=optimizer,
                                   timeout=timeout) as job:
                    rec = Recorder(job)
                    failed = run_steps({"job": rec}, batches, warmup=warmup, steps=steps)
                    if failed:
                        raise failed["job"]
                    sims = _predictions(job, rec.data, link)
                    missing = missing_costs(job.compiled.plans.representatives(), rec.data.costs())
                    _report((accuracy, shape), result, errors, f"{kind}.{mesh_label.replace('=', '')}",
                            (mesh_label, name), job, rec.data, sims, overhead)
            except Exception as exc:
                accuracy.add(mesh_label, name, f"failed: {short_error(exc)}", *[None] * 14)
                ctx.log(traceback.format_exc())
                continue
            if missing:
                accuracy.notes.append(f"{kind} on {mesh_label}: no timing for {', '.join(missing[:6])}"
                                      f"{' ...' if len(missing) > 6 else ''} (cost 0)")
    accuracy.notes += ACCURACY_NOTES
    _link_notes(accuracy, result, link, link_points, overhead)
    shape.notes += SHAPE_NOTES
    _summary(result, errors)
    result.tables += [accuracy, shape]
    return result


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{x:+.1%}"


@dataclass
class Overhead:
    """Step time a prediction misses, as a fixed part per step plus a part per plan action
    (the busiest device's actions, compute and communication), fitted on a model whose compute is
    nearly free: a 2-region chain of 4x4 linears, 1F1B on pp=2, at two microbatch counts."""

    fixed: float
    per_action: float
    points: list[tuple[int, float]]            # (actions on the busiest device, measured - predicted)

    def __call__(self, job) -> float:
        return self.fixed + self.per_action * plan_length(job)


def plan_length(job) -> int:
    return max(len(plan) for plan in job.compiled.plans.representatives().values())


def _fixed_overhead(optimizer, timeout: float, quick: bool) -> Overhead:
    points = []
    for m in (2, 16):
        strategy, _, _ = schedule_strategy("1f1b", pp=2, microbatches=m)
        torch.manual_seed(0)
        x, y = torch.randn(m * 2, 4), torch.randn(m * 2, 4)
        with piper.compile(make_chain(2, 4), (x, y), strategy=strategy, mesh={"pp": 2}, optimizer=optimizer,
                           timeout=timeout) as job:
            rec = Recorder(job, worker_probe=False)
            warmup, steps = (2, 6) if quick else (4, 10)
            errors = run_steps({"job": rec}, [(x, y)] * (warmup + steps), warmup=warmup, steps=steps)
            if errors:
                raise errors["job"]
            points.append((plan_length(job), rec.data.step - predict(job, rec.data.costs()).step_time))
    (n1, o1), (n2, o2) = points
    per = max(0.0, (o2 - o1) / (n2 - n1))
    return Overhead(max(0.0, o1 - per * n1), per, points)
