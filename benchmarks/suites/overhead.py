"""Suite 7, `overhead`: what the runtime costs per action when compute is nearly free.

A chain of 8 regions, each one 4x4 linear, with many microbatches (GPipe
order), on 1 and 2 devices. Probes inside each worker time the compute
(forward graphs, autograd backward, optimizer steps; see probes.py), so

    µs per action = (step time - compute time) / actions in the device's plan

end to end (the driver's job.step: Ray call, batch shipping, plan loop,
communication) and inside the executor (run_step only).

    python -m benchmarks --suite overhead
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import torch

import piper

from ..baselines.torch_group import TorchGroup
from ..harness import probes
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, ms, short_error
from ..harness.workloads import make_chain, pipeline

REGIONS, WIDTH, ROWS = 8, 4, 2     # rows per microbatch


NOTES = [
    "compute = time inside the regions' forward graphs, torch.autograd.backward/grad and the optimizer "
    "steps, measured in each worker (benchmarks/harness/probes.py); everything else is runtime overhead: building "
    "arguments, routing values and gradients, issuing and waiting on send/recv, the plan loop.",
    "Piper runs each region's backward as its own torch.autograd.backward call (one per B action), where "
    "the eager loop runs one backward per microbatch through all 8 layers; the fwd/bwd/opt split shows "
    "where compute time goes.",
    "On 2 devices the per-action cost also holds the time a device waits for its peer (pipeline bubble, "
    "Gloo message latency and the peer's overhead), so it is an upper bound there.",
]
VERSUS_NOTE = ("1 device: a plain PyTorch loop (forward, backward of loss/m per microbatch, then "
               "AdamW) in one Ray actor; 2 devices: PipelineStage per half of the chain with "
               "ScheduleGPipe. Both sides are timed from the driver, Ray call included.")


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    microbatches = 8 if quick else 64
    warmup, steps = (1, 3) if quick else (3, 10)
    result = SuiteResult("overhead", 7, "Per-action dispatch cost", ctx.command("overhead"))
    table = Table(f"Chain of {REGIONS} regions (each a {WIDTH}x{WIDTH} linear), {microbatches} microbatches of "
                  f"{ROWS} rows, GPipe order, AdamW; medians of {steps} steps after {warmup} warm-up",
                  ["devices", "rank", "actions (compute + comm)", "step ms (driver)", "run_step ms (worker)",
                   "compute ms (fwd / bwd / opt)", "µs/action end to end", "µs/action in executor",
                   "compute µs/compute action"])
    versus = Table("The same chain, microbatches and AdamW in PyTorch, alternated step by step with Piper",
                   ["devices", "PyTorch", "torch ms", "Piper ms", "ratio torch/Piper", "max |Δloss|"])
    torch.manual_seed(0)
    x = torch.randn(microbatches * ROWS, WIDTH)
    y = torch.randn(microbatches * ROWS, WIDTH)
    floor = None
    with ray_cluster():
        for devices in (1, 2):
            ctx.log(f"overhead: {devices} device(s)")
            baseline = "eager loop (one process)" if devices == 1 else "pipelining ScheduleGPipe"
            try:
                m = _measure(devices, x, y, microbatches, warmup, steps, floor=floor is None)
            except Exception as exc:
                table.add(devices, "—", f"failed: {short_error(exc)}", *[None] * 6)
                continue
            floor = floor if m.floor is None else m.floor
            step = statistics.median(m.times["piper"])
            for rank in range(devices):
                _rank_row(table, result, devices, rank, step, m)
            t_ms = ms(statistics.median(m.times["torch"]))
            gap = max(abs(a - b) for a, b in zip(m.losses["torch"], m.losses["piper"]))
            versus.add(devices, baseline, t_ms, ms(step), f"{t_ms / ms(step):.2f}x", f"{gap:.1e}")
            result.metrics[f"dev{devices}.ratio_torch_over_piper"] = t_ms / ms(step)
    if floor is not None:
        result.metrics["ray_call_floor_ms"] = floor * 1e3
        table.notes.append(f"Ray round trip of an empty actor call: {floor * 1e3:.2f} ms (median of 20); it is "
                           "inside the end-to-end number once per step.")
    table.notes += NOTES
    versus.notes.append(VERSUS_NOTE)
    result.tables += [table, versus]
    return result


@dataclasses.dataclass
class Measured:
    """One device count's alternated steps: step times and losses per system, the workers' probe reads
    after each timed step, each rank's plan length and compute actions, and the Ray call floor."""

    times: dict[str, list[float]]
    losses: dict[str, list[float]]
    reads: list[list[dict]]
    lengths: list[int]
    compute_actions: list[int]
    floor: float | None


def _measure(devices: int, x, y, microbatches: int, warmup: int, steps: int, *, floor: bool) -> Measured:
    """The chain on `devices` in Piper and in PyTorch, alternated step by step, the probes reading the
    compute inside Piper's workers; with `floor`, also the Ray round trip of an empty call."""
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    with piper.compile(make_chain(REGIONS, WIDTH), (x, y),
                       strategy=pipeline(microbatches, regions=REGIONS, contiguous=True),
                       mesh={"pp": devices}, optimizer=optimizer, timeout=120) as job, \
            TorchGroup(devices, timeout=120) as group:
        group.setup("eager" if devices == 1 else "pipeline", model="chain",
                    model_kw={"regions": REGIONS, "width": WIDTH}, microbatches=microbatches,
                    schedule=None if devices == 1 else "ScheduleGPipe")
        lengths = probes.install(job, time_compute=True)
        compute_actions = [len(job.compiled.compute_order(r)) for r in range(devices)]
        times = {"torch": [], "piper": []}
        losses = {"torch": [], "piper": []}
        reads = []
        for i in range(warmup + steps):
            for name, step in (("torch", group.step), ("piper", job.step)):
                t0 = time.perf_counter()
                losses[name].append(step(x, y))
                dt = time.perf_counter() - t0
                if i >= warmup:
                    times[name].append(dt)
            read = probes.read(job)       # after the timed step
            if i >= warmup:
                reads.append(read)
        return Measured(times, losses, reads, lengths, compute_actions, _ray_floor(job) if floor else None)


def _rank_row(table: Table, result: SuiteResult, devices: int, rank: int, step: float, m: Measured) -> None:
    """One rank's row: its actions, times, and µs per action end to end and inside the executor."""
    reads, n, computes = m.reads, m.lengths[rank], m.compute_actions[rank]
    run_step = statistics.median(r[rank]["run_step"] for r in reads)
    compute = statistics.median(r[rank]["compute"] for r in reads)
    e2e = (step - compute) / n * 1e6
    inner = (run_step - compute) / n * 1e6
    split = [statistics.median(r[rank]["seconds"].get(k, 0.0) for r in reads)
             for k in ("forward", "backward", "optimizer")]
    split[1] += statistics.median(r[rank]["seconds"].get("grad", 0.0) for r in reads)
    table.add(devices, rank, f"{n} ({computes} + {n - computes})", ms(step),
              ms(run_step), f"{ms(compute):.3g} ({' / '.join(f'{ms(t):.3g}' for t in split)})",
              e2e, inner, compute / computes * 1e6)
    for kind, t in zip(("forward", "backward", "optimizer"), split):
        result.metrics[f"dev{devices}.rank{rank}.{kind}_ms"] = ms(t)
    result.metrics[f"dev{devices}.rank{rank}.us_per_action_end_to_end"] = e2e
    result.metrics[f"dev{devices}.rank{rank}.us_per_action_executor"] = inner


def _ray_floor(job) -> float:
    import ray

    calls = []
    for _ in range(20):
        t0 = time.perf_counter()
        ray.get(job.actors[0].__ray_call__.remote(probes.noop))
        calls.append(time.perf_counter() - t0)
    return statistics.median(calls)
