"""Suite 5, `overlap`: does communication hide behind computation?

(a) ZeRO-3 against plain data parallelism on the same model and devices
    (dp=2 and dp=4), alternating steps A B A B. ZeRO-3 moves about 1.5x the
    bytes of dp (an all-gather of each region's parameters before its forward
    and again before its backward, a reduce-scatter of its gradients, against
    one all-reduce), issued asynchronously one compute ahead; if that traffic
    overlaps compute, zero3's step is barely slower. Target: zero3 / dp <= 1.15.

(b) DualPipeV against 1F1B on pp=2 at the same number of microbatches, the same
    model and total layers (DualPipeV: 4 regions, two per device in a V; 1F1B:
    2 regions). DualPipeV's slots pair one region's forward with another's
    backward so that each one's communication hides behind the other's compute,
    and its split backwards fill the drain. Target: 1F1B / DualPipeV > 1.

The CPU runtime runs the two items of an overlapped slot at once, in two
lanes (threads) of the worker; the table also runs DualPipeV with
`overlap=False` (items in turn) and shows what the simulator predicts from
the measured per-action costs, and for slots whose halves would run fully
concurrently (max of the two).

    python -m benchmarks --suite overlap
"""
from __future__ import annotations

import functools
import statistics
import traceback

import torch

import piper
from piper.frontend.interop import overlapped_slots
from piper.compiler.simulate import STEP

from ..harness.machine import ray_cluster
from ..harness.measured_steps import Recorder, predict, run_steps
from ..harness.results import SuiteResult, Table, ms, short_error
from ..harness.workloads import GPTWorkload, gpt_batches, make_gpt, schedule_strategy, zero_strategy

TARGET_ZERO3 = 1.15


def workloads(quick: bool) -> tuple[GPTWorkload, int, GPTWorkload]:
    """(data-parallel model as suite 2, its regions, pipeline model as suite 1)."""
    if quick:
        return (GPTWorkload(n_layer=2, n_embd=32, n_head=2, block_size=16, batch=8), 2,
                GPTWorkload(n_layer=4, n_embd=32, n_head=2, block_size=16, batch=16))
    return (GPTWorkload(n_layer=4, n_embd=128, n_head=4, block_size=64, batch=32), 4,
            GPTWorkload(n_layer=8, n_embd=128, n_head=4, block_size=64, batch=32))


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    dp_wl, dp_regions, pp_wl = workloads(quick)
    warmup, steps = (1, 3) if quick else (2, 10)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    result = SuiteResult("overlap", 5, "Communication/computation overlap: zero3 vs dp, DualPipeV vs 1F1B",
                         ctx.command("overlap"))
    with ray_cluster():
        result.tables.append(_zero3_vs_dp(ctx, result, dp_wl, dp_regions, (2,) if quick else (2, 4),
                                          warmup, steps, optimizer))
        result.tables.append(_dualpipev_vs_1f1b(ctx, result, pp_wl, (4,) if quick else (4, 8),
                                                warmup, steps, optimizer))
    return result


def _start(ctx, kw, batch, strategy, mesh, optimizer):
    return piper.compile(make_gpt(kw)[0], batch, strategy=strategy, mesh=mesh, optimizer=optimizer, timeout=120,
                         device=ctx.device)


def _close(*jobs) -> None:
    for job in jobs:
        if job is not None:
            job.close()


def _zero3_vs_dp(ctx, result, wl, regions, devices, warmup, steps, optimizer) -> Table:
    batches = gpt_batches(wl, warmup + steps)
    kw = wl.model_kw(regions)
    table = Table(f"(a) zero3 vs dp, same model and devices: median of {steps} steps after {warmup} warm-up, "
                  f"A/B alternated; {wl.describe(regions)}, split evenly over the devices",
                  ["devices", "dp ms", "zero3 ms", "zero3 / dp", "dp compute ms", "zero3 compute ms",
                   "dp not compute ms", "zero3 not compute ms", "spread dp", "spread zero3", "max |Δloss|"])
    for n in devices:
        if unhosted := ctx.cannot_host(n):
            table.add(n, unhosted, *[None] * 9)
            continue
        ctx.log(f"overlap: zero3 vs dp on {n} devices")
        jobs = {}
        try:
            for level in ("dp", "zero3"):
                strategy, _, _ = zero_strategy(level, dp=n)
                jobs[level] = _start(ctx, kw, batches[0], strategy, {"dp": n}, optimizer)
            recs = {level: Recorder(job) for level, job in jobs.items()}
            errors = run_steps(recs, batches, warmup=warmup, steps=steps)
            if errors:
                raise next(iter(errors.values()))
        except Exception as exc:
            table.add(n, f"failed: {short_error(exc)}", *[None] * 9)
            ctx.log(traceback.format_exc())
            continue
        finally:
            _close(*jobs.values())
        d, z = recs["dp"].data, recs["zero3"].data
        ratio = z.step / d.step
        gap = max(abs(a - b) for a, b in zip(d.losses, z.losses))
        table.add(n, ms(d.step), ms(z.step), f"{ratio:.3f}", ms(d.compute()), ms(z.compute()),
                  ms(d.step - d.compute()), ms(z.step - z.compute()), d.spread, z.spread, f"{gap:.1e}")
        result.metrics.update({f"zero3_vs_dp.dp{n}.dp_ms": ms(d.step), f"zero3_vs_dp.dp{n}.zero3_ms": ms(z.step),
                               f"zero3_vs_dp.dp{n}.ratio": ratio})
        result.notes.append(f"(a) {n} devices: zero3 / dp = {ratio:.3f} (target <= {TARGET_ZERO3})")
    table.notes += [
        "compute: the busiest rank's sum of job.timings() (forwards, backwards, optimizer steps) per step, "
        "median over the timed steps; 'not compute' = step - compute: communication the device waited for, "
        "the runtime's per-action work, and the driver's Ray call. zero3's extra 'not compute' over dp is "
        "the communication it failed to hide.",
        "dp: one all-reduce of each region's flat gradients after its backward; zero3: each region's "
        "parameters all-gathered one compute ahead of its forward and again of its backward, gradients "
        "reduce-scattered, all asynchronous (" + ("NCCL" if ctx.device == "cuda" else "Gloo on loopback") + ").",
    ]
    if ctx.device == "cuda":
        table.notes.append("compute on CUDA: each compute timed on the GPU by CUDA events around it.")
    return table


def _slot_costs(job, costs: dict[str, float]) -> dict[str, float]:
    """Costs for simulate(overlap=...): each overlapped slot's name (`F&B`) -> the median over slots of
    max(forward half, backward half): what the slot would take if its halves ran fully concurrently."""
    from piper.compiler.simulate import _unit_name

    actions = {a.key: a for plan in job.compiled.plans.representatives().values() for a in plan}
    by_name: dict[str, list[float]] = {}
    for slot in overlapped_slots(job.compiled):
        members = tuple(actions[k] for k in slot if k in actions)
        if len(members) != len(slot):
            continue
        fwd = sum(costs.get(a.key, 0.0) for a in members if a.node.op == "F")
        bwd = sum(costs.get(a.key, 0.0) for a in members if a.node.op != "F")
        by_name.setdefault(_unit_name(members), []).append(max(fwd, bwd))
    return {name: statistics.median(v) for name, v in by_name.items()}


def _passes(data) -> str:
    p = data.by_pass()
    return (f"{ms(data.compute()):.0f} ({ms(p.get('F', 0)):.0f} / {ms(p.get('backward', 0)):.0f} / "
            f"{ms(p.get('UPD', 0)):.1f})")


def _cpu(data) -> tuple[float, float]:
    """The busiest device's CPU seconds per step (median over steps): in its computes, and in the whole
    worker process (every thread: the runtime, Gloo's transfers)."""
    process = statistics.median(max(r.get(STEP, 0.0) for r in step.values()) for step in data.cpu_timings)
    return data.compute(cpu=True), process


DUALPIPEV_NOTES = [
    "lanes: the runtime's default — the two items of an overlapped slot [F, B] run at once in two threads "
    "of the worker, each with the sends of its results; in turn: piper.compile(..., overlap=False), one "
    "after the other. In both, a B item under 'split B' is one whole backward; DualPipeV still splits "
    "the drain's backwards (BI now, BW later), which costs more than one B on this CPU runtime.",
    "Each device is one single-threaded process and the machine has two cores, so two lanes of one "
    "device compete for the core the other device is not using: lanes win where one item waits for a "
    "message while the other can compute, not by doubling compute.",
    "compute: the busiest device's sum of job.timings() per step (median over the timed steps), split into "
    "forwards, backwards (B, or BI + BW where split) and optimizer steps. predicted: simulate(plans, "
    "costs=the median per-action times of the timed steps), comm cost 0 (see suite 8); with lanes each "
    "overlapped slot is one unit costing the span the runtime timed it at. 'halves concurrent, ideal': "
    "each [F, B] slot costing max(F, B) of the in-turn run — an upper bound on what two streams could give.",
    "max |Δloss|: the schedules train the same model (same weights and batches), so their losses "
    "agree step by step up to float rounding.",
    "CPU per step (in the notes below): job.timings(cpu=True), the busiest device's whole worker process "
    "and its computes; idle = step - process CPU. DualPipeV's V crosses between the devices twice per "
    "microbatch each way (regions 0->1 and 2->3), 1F1B's once, and every Gloo message costs CPU at both "
    "ends; its split backwards cost more than whole ones too. The idle time DualPipeV saves must exceed "
    "that extra CPU: on two shared cores it does at 4 microbatches, and barely if at all at 8, where "
    "1F1B's own bubble is down to 1/(m+1).",
]


def _dualpipev_vs_1f1b(ctx, result, wl, microbatch_counts, warmup, steps, optimizer) -> Table:
    batches = gpt_batches(wl, warmup + steps)
    p = 2
    table = Table(f"(b) DualPipeV (4 regions) vs 1F1B (2 regions) on pp=2, same microbatches: median of {steps} "
                  f"steps after {warmup} warm-up, the three jobs alternated; {wl.describe()}",
                  ["microbatches", "1F1B ms", "DualPipeV ms (lanes)", "DualPipeV ms (in turn)",
                   "1F1B / DualPipeV (lanes)", "1F1B / DualPipeV (in turn)",
                   "1F1B compute ms (F / bwd / upd)", "DualPipeV compute ms (F / bwd / upd)", "predicted 1F1B ms",
                   "predicted DualPipeV ms (lanes)", "predicted DualPipeV ms (in turn)",
                   "predicted DualPipeV ms (halves concurrent, ideal)", "predicted bubble 1F1B",
                   "predicted bubble DualPipeV", "max |Δloss|"])
    for m in microbatch_counts:
        if unhosted := ctx.cannot_host(p):
            table.add(m, unhosted, *[None] * 14)
            continue
        ctx.log(f"overlap: DualPipeV vs 1F1B on pp={p}, {m} microbatches")
        try:
            data, sims = _three_schedules(ctx, wl, batches, p, m, warmup, steps, optimizer)
        except Exception as exc:
            table.add(m, f"failed: {short_error(exc)}", *[None] * 14)
            ctx.log(traceback.format_exc())
            continue
        _schedules_row(ctx, table, result, m, data, sims)
    table.notes += DUALPIPEV_NOTES
    if ctx.device == "cuda":
        table.notes.append("On CUDA the runtime runs a slot's items in turn (NCCL matches messages by issue "
                           "order), so 'lanes' and 'in turn' are the same runtime there.")
    return table


def _three_schedules(ctx, wl, batches, p: int, m: int, warmup: int, steps: int, optimizer):
    """1F1B, DualPipeV with lanes and DualPipeV in turn on pp=`p` with `m` microbatches, stepped in turn:
    ({name: Measured}, {name: the simulator's prediction}, names 1f1b, lanes, turn and ideal, the last
    the in-turn run with each slot costing max(F, B))."""
    jobs = {}
    try:
        for name, kind, regions, overlap in (("1f1b", "1f1b", p, True), ("lanes", "dualpipev", 2 * p, True),
                                             ("turn", "dualpipev", 2 * p, False)):
            strategy, source, note = schedule_strategy(kind, pp=p, microbatches=m)
            if strategy is None:
                raise RuntimeError(f"{kind} is not available: {note}")
            jobs[name] = piper.compile(make_gpt(wl.model_kw(regions))[0], batches[0], strategy=strategy,
                                       mesh={"pp": p}, optimizer=optimizer, timeout=120, overlap=overlap,
                                       device=ctx.device)
        recs = {name: Recorder(job) for name, job in jobs.items()}
        errors = run_steps(recs, batches, warmup=warmup, steps=steps)
        if errors:
            raise next(iter(errors.values()))
        data = {name: rec.data for name, rec in recs.items()}
        sims = {name: predict(jobs[name], data[name].costs()) for name in jobs}   # a lanes slot: its measured span
        turn = data["turn"].costs()
        sims["ideal"] = predict(jobs["turn"], {**turn, **_slot_costs(jobs["turn"], turn)},
                                overlap=overlapped_slots(jobs["turn"].compiled))
        return data, sims
    finally:
        _close(*jobs.values())


def _schedules_row(ctx, table: Table, result: SuiteResult, m: int, data: dict, sims: dict) -> None:
    """The row, metrics and notes of one microbatch count of (b)."""
    one, lanes, turn = (data[k] for k in ("1f1b", "lanes", "turn"))
    sim_one, sim_lanes, sim_turn, sim_ideal = (sims[k] for k in ("1f1b", "lanes", "turn", "ideal"))
    ratio, ratio_turn = one.step / lanes.step, one.step / turn.step
    gap = max(abs(a - b) for x in (lanes, turn) for a, b in zip(one.losses, x.losses))
    table.add(m, ms(one.step), ms(lanes.step), ms(turn.step), f"{ratio:.3f}", f"{ratio_turn:.3f}",
              _passes(one), _passes(lanes), ms(sim_one.step_time), ms(sim_lanes.step_time),
              ms(sim_turn.step_time), ms(sim_ideal.step_time),
              f"{sim_one.bubble_fraction:.3f}", f"{sim_lanes.bubble_fraction:.3f}", f"{gap:.1e}")
    key = f"dualpipev_vs_1f1b.m{m}"
    result.metrics.update({f"{key}.1f1b_ms": ms(one.step), f"{key}.dualpipev_ms": ms(lanes.step),
                           f"{key}.dualpipev_in_turn_ms": ms(turn.step), f"{key}.ratio": ratio,
                           f"{key}.ratio_in_turn": ratio_turn,
                           f"{key}.predicted_ratio": sim_one.step_time / sim_lanes.step_time,
                           f"{key}.predicted_ratio_concurrent": sim_one.step_time / sim_ideal.step_time})
    result.notes.append(f"(b) {m} microbatches: 1F1B / DualPipeV = {ratio:.3f} measured with lanes, "
                        f"{ratio_turn:.3f} in turn (target > 1); {sim_one.step_time / sim_lanes.step_time:.3f} "
                        f"predicted from the measured costs, {sim_one.step_time / sim_ideal.step_time:.3f} "
                        "if slot halves ran fully concurrently")
    (one_c, one_p), (turn_c, turn_p) = _cpu(one), _cpu(turn)
    result.metrics.update({f"{key}.1f1b_cpu_ms": ms(one_p), f"{key}.dualpipev_in_turn_cpu_ms": ms(turn_p)})
    if ctx.device == "cpu":
        result.notes.append(
            f"(b) {m} microbatches, CPU per step on the busiest device: 1F1B {ms(one_p):.0f} ms "
            f"({ms(one_c):.0f} in computes), DualPipeV in turn {ms(turn_p):.0f} ms ({ms(turn_c):.0f}); "
            f"idle: 1F1B {ms(one.step - one_p):.0f} ms, DualPipeV {ms(turn.step - turn_p):.0f} ms")
