"""Suite 10, `experts`: expert parallelism on the example MoE transformer (examples/moe.py).

(a) experts divided (`expert_parallel` over dp=2) vs replicated (plain `dp`):
    step time, alternating the two jobs step by step on the same batches, and
    per-device parameter bytes (`job.memory()[rank]["params"]`).
(b) DualPipeV x EP (pp=2 x dp=2) with its overlapped slots in lanes, the same
    with the slots' items in turn in one thread, switching items at each expert
    exchange (`overlap=False`), and 1F1B x EP: step time, each device's
    process CPU per step, its idle time (step minus the computes' own wall
    time), and the time its expert exchanges took from issue to arrival. Every
    MoE pass runs as pieces with its dispatch/combine exchanges as plan actions
    (`piper/ir/moe_cut.py`). One job at a time: 4 workers each.

    python -m benchmarks --suite experts [--quick]
"""
from __future__ import annotations

import functools
import statistics
import time

import torch

import piper
from piper.dsl import load_strategy

from ..harness.divided_experts import EP_AGAINST_DP, divided_and_replicated
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, ms, mib, short_error


def _model(quick: bool, regions: int):
    from examples.moe import make_model

    size = dict(n_layer=4, n_embd=32, hidden=64, num_experts=4, shared_hidden=32, block_size=16) if quick else \
        dict(n_layer=4, n_embd=128, hidden=256, num_experts=8, shared_hidden=128, block_size=64)
    return make_model(n_regions=regions, **size)


def _batches(quick: bool, n: int):
    from examples.moe import training_batches

    batch, block = (16, 16) if quick else (32, 64)
    stream = training_batches(batch)
    return [tuple(t[:, :block].contiguous() for t in next(stream)) for _ in range(n)]


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    result = SuiteResult("experts", 10, "Expert parallelism: EP vs replicated experts; DualPipeV x EP lanes",
                         ctx.command("experts"))
    warmup, steps = (2, 4) if quick else (3, 10)
    batches = _batches(quick, warmup + steps)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    with ray_cluster():
        result.tables.append(_ep_vs_replicated(result, quick, batches, optimizer, warmup, steps))
        result.tables.append(_dualpipev_lanes(ctx, result, quick, batches, optimizer, warmup, steps))
    return result


def _ep_vs_replicated(result, quick, batches, optimizer, warmup, steps) -> Table:
    table = Table("(a) experts divided vs replicated, dp=2 (jobs alternate step by step)",
                  ["strategy", "step ms (median)", "params MiB / device", "expert MiB / device", "ratio"])
    model = _model(quick, 1)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if n.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and p.dim() == 3)
    timings, memory = divided_and_replicated(model, batches, optimizer, warmup, steps)
    base = timings.median("dp")
    for name in EP_AGAINST_DP:
        med = timings.median(name)
        held = expert_bytes / 2 if "expert" in name else expert_bytes
        table.add(name, ms(med), mib(memory[name]), mib(held), (med / base) if med and base else None)
        key = "ep" if "expert" in name else "dp"
        result.metrics[f"{key}.step_ms"] = ms(med)
        result.metrics[f"{key}.params_bytes"] = float(memory[name])
    result.metrics["ep_vs_dp.params_ratio"] = memory["dp + expert_parallel"] / memory["dp"]
    gap = timings.max_loss_gap("dp", "dp + expert_parallel")
    table.notes.append(f"ratio: step time over plain dp's. Largest loss difference between the two jobs over "
                       f"{warmup + steps} steps: {gap:.2e} (float32; the same model either way).")
    table.notes.append("Each device of the EP job holds half the expert weights (and their gradients and AdamW "
                       "moments); every MoE layer pays a counts exchange and two uneven all-to-alls forward and "
                       "two backward. At this size on 2 shared CPU cores the halved expert compute does not make up for "
                       "those exchanges; EP's gain here is the memory.")
    return table


def _dualpipev_lanes(ctx, result, quick, batches, optimizer, warmup, steps) -> Table:
    table = Table("(b) pp=2 x dp=2 with expert_parallel (one job at a time)",
                  ["schedule", "step ms (median)", "process CPU s / step (sum of 4)", "idle ms / step (mean)",
                   "exchanges ms / step (mean)", "ratio"])
    m = 4 if quick else 8
    cases = [("1F1B x EP", f"use one_f_one_b(microbatches={m}) on pp", 2, True),
             ("DualPipeV x EP, slots in turn switching at exchanges", f"use dualpipev(microbatches={m}) on pp", 4,
              False),
             ("DualPipeV x EP, slots in lanes", f"use dualpipev(microbatches={m}) on pp", 4, True)]
    medians = {}
    for name, schedule, regions, overlap in cases:
        text = f"mesh dp=2, pp=2\n{schedule}\nuse dp() on dp\nuse expert_parallel() on dp\n"
        try:
            with piper.compile(_model(quick, regions), batches[0], strategy=load_strategy(text),
                               mesh={"dp": 2, "pp": 2}, optimizer=optimizer, overlap=overlap) as job:
                times, cpu, idle, exchanged = [], [], [], []
                for i, b in enumerate(batches):
                    t0 = time.perf_counter()
                    job.step(*b)
                    dt = time.perf_counter() - t0
                    if i >= warmup:
                        times.append(dt)
                        cpu.append(sum(t["step"] for t in job.timings(cpu=True).values()))
                        walls = job.timings()
                        idle.append(statistics.mean(
                            dt - sum(v for k, v in w.items() if "&" not in k and "ALL_TO_ALL" not in k)
                            for w in walls.values()))
                        exchanged.append(statistics.mean(
                            sum(v for k, v in w.items() if "ALL_TO_ALL" in k) for w in walls.values()))
        except Exception as exc:       # one failing schedule still leaves the others' rows
            table.add(name, None, None, None, None, None)
            table.notes.append(f"{name} failed: {short_error(exc)}")
            continue
        medians[name] = statistics.median(times)
        table.add(name, ms(medians[name]), statistics.median(cpu), ms(statistics.median(idle)),
                  ms(statistics.median(exchanged)),
                  medians[name] / medians["1F1B x EP"] if "1F1B x EP" in medians else None)
        key = name.split(",")[-1].strip().split(" switching")[0].replace(" ", "_").replace("x_EP", "ep").lower()
        result.metrics[f"{key}.step_ms"] = ms(medians[name])
        result.metrics[f"{key}.cpu_s"] = statistics.median(cpu)
    table.notes.append("ratio: step time over 1F1B x EP's. Idle: wall time of the step minus the computes' wall "
                       "time on each device (with lanes the two items' times overlap, so it can go below the "
                       "true idle time). Process CPU counts every thread of each worker, Gloo's included.")
    table.notes.append("Exchanges: each dispatch/combine action's time from issue to arrival (forward and "
                       "backward), on each device; in lanes and in the switching thread the other item computes "
                       "during part of it, so it is not all idle time.")
    table.notes.append("On CPU each device is one process on 2 shared cores: lanes pay off only where one item "
                       "waits for a message (a pipeline receive, an all-to-all peer) while the other computes; "
                       "DualPipeV's V also sends twice the pipeline messages of 1F1B.")
    return table
