"""Suite 3, `memory`: bytes per device between steps for dp / ZeRO-1 / ZeRO-2 / ZeRO-3
against the ZeRO paper's formulas, and the peak of saved activations for GPipe vs 1F1B.

ZeRO (Rajbhandari et al., SC 2020), fp32 with AdamW, Ψ parameters, N devices:

    stage      params   grads    optimizer (two moments)
    dp         4Ψ       4Ψ       8Ψ
    zero1      4Ψ       4Ψ       8Ψ/N
    zero2      4Ψ       4Ψ/N     8Ψ/N
    zero3      4Ψ/N     4Ψ/N     8Ψ/N

(The paper's 12Ψ optimizer term also counts an fp32 master copy for mixed
precision; in plain fp32 the parameters are the master copy, so AdamW's
state is the two moments, 8Ψ.)

    python -m benchmarks --suite memory
"""
from __future__ import annotations

import functools

import torch

import piper

from ..baselines.torch_group import TorchGroup
from ..harness import probes
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, mib, short_error
from ..harness.workloads import GPTWorkload, gpt_batches, make_gpt, n_params, schedule_strategy, zero_strategy

LEVELS = ("dp", "zero1", "zero2", "zero3")


def expected(level: str, psi: int, n: int) -> dict[str, float]:
    """The ZeRO formulas in bytes per device (fp32, AdamW)."""
    shard = {"dp": (), "zero1": ("optimizer",), "zero2": ("optimizer", "grads"),
             "zero3": ("optimizer", "grads", "params")}[level]
    full = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    return {k: v / n if k in shard else float(v) for k, v in full.items()}


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    result = SuiteResult("memory", 3, "Memory per device: ZeRO formulas and saved activations", ctx.command("memory"))
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    with ray_cluster():
        result.tables.append(_zero_table(ctx, result, quick, optimizer))
        result.tables.append(_process_table(ctx, result, quick, optimizer))
        result.tables.append(_activation_table(ctx, result, quick, optimizer))
    return result


def _zero_table(ctx, result, quick, optimizer) -> Table:
    wl = GPTWorkload(n_layer=2, n_embd=32, n_head=2, block_size=16, batch=8) if quick else \
        GPTWorkload(n_layer=4, n_embd=128, n_head=4, block_size=64, batch=32)
    regions = 2 if quick else 4
    kw = wl.model_kw(regions)
    model, _ = make_gpt(kw)
    psi = n_params(model)
    batch = gpt_batches(wl, 1)[0]
    table = Table(f"Bytes per device after one step (job.memory()); {wl.describe(regions)}; Ψ = {psi:,} parameters",
                  ["devices", "strategy", "ranks", "params MiB", "(formula)", "grads MiB", "(formula)",
                   "optimizer MiB", "(formula)", "total / formula"])
    for n in ((2,) if quick else (2, 4)):
        for level in LEVELS:
            ctx.log(f"memory: {level} on {n} devices")
            strategy, source, _ = zero_strategy(level, dp=n)
            want = expected(level, psi, n)
            try:
                with piper.compile(make_gpt(kw)[0], batch, strategy=strategy, mesh={"dp": n},
                                   optimizer=optimizer, timeout=120) as job:
                    job.step(*batch)
                    memory = job.memory()
            except Exception as exc:
                table.add(n, level, "—", f"failed: {short_error(exc)}", *[None] * 6)
                continue
            # Collapse ranks that hold the same bytes (every rank, for these strategies).
            groups: dict[tuple, list[int]] = {}
            for rank, m in sorted(memory.items()):
                groups.setdefault((m["params"], m["grads"], m["optimizer"]), []).append(rank)
            for (params, grads, opt), ranks in groups.items():
                ratio = (params + grads + opt) / sum(want.values())
                table.add(n, f"{level} ({source})", _ranks(ranks, n), mib(params), mib(want["params"]), mib(grads),
                          mib(want["grads"]), mib(opt), mib(want["optimizer"]), f"{ratio:.3f}")
                result.metrics[f"{level}.dp{n}.ranks{ranks[0]}.total_over_formula"] = ratio
    table.notes += [
        "formula: the ZeRO paper's per-device bytes for fp32 + AdamW (params 4Ψ, grads 4Ψ, Adam moments 8Ψ; "
        "divided by N where sharded). Piper pads each region's flat buffer to a multiple of N, so sharded "
        "numbers can exceed Ψ/N by a few elements.",
        "job.memory() counts storages held between steps (parameters, gradients, optimizer state), each "
        "storage once; activations and communication buffers are not in it.",
    ]
    return table


# glibc's default grows its mmap threshold after large frees, and then serves big
# tensors from a heap that rarely shrinks; a fixed threshold maps each big tensor
# on its own and unmaps it when freed.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": 131072}


def _process_table(ctx, result, quick, optimizer) -> Table:
    """The runtime's byte counts against what the worker processes hold.

    Two checks per strategy: every live CPU tensor storage in the worker
    (walked through the garbage collector) against job.memory(); and resident
    memory. A worker's resident memory also holds Python, torch and the region
    graphs, the same for every strategy on one model, so that check compares
    differences from dp: what zero1/2/3 save by the runtime's count against
    what the processes really give back, with glibc's default allocator
    settings and with a fixed mmap threshold (FIXED_MMAP, through worker_env).
    """
    wl = GPTWorkload(n_layer=2, n_embd=64, n_head=2, block_size=8, batch=8) if quick else \
        GPTWorkload(n_layer=2, n_embd=512, n_head=8, block_size=8, batch=8)
    regions, n = 2, 2
    kw = wl.model_kw(regions)
    psi = n_params(make_gpt(kw)[0])
    batch = gpt_batches(wl, 1)[0]
    table = Table(f"Checked against process memory: each worker after two steps, {n} devices; "
                  f"{wl.describe(regions)}; Ψ = {psi:,} parameters",
                  ["strategy", "counted MiB (job.memory)", "live tensors MiB", "live / counted",
                   "resident MiB", "resident saving / counted saving",
                   "resident MiB (fixed mmap threshold)", "resident saving / counted saving (fixed)"])
    rows = {}
    for level in LEVELS:
        strategy, source, _ = zero_strategy(level, dp=n)
        row = [source]
        for env in ({}, FIXED_MMAP):
            ctx.log(f"memory: process bytes, {level} on {n} devices{' ' + str(env) if env else ''}")
            try:
                with piper.compile(make_gpt(kw)[0], batch, strategy=strategy, mesh={"dp": n},
                                   optimizer=optimizer, timeout=120, worker_env=env) as job:
                    for _ in range(2):
                        job.step(*batch)
                    counted = max(sum(m[k] for k in ("params", "grads", "optimizer")) for m in job.memory().values())
                    live = max(probes.in_workers(job, probes.live_tensor_bytes))
                    resident = max(probes.in_workers(job, probes.resident_bytes))
            except Exception as exc:
                table.notes.append(f"{level}{' ' + str(env) if env else ''} failed: {short_error(exc)}")
                row = None
                break
            row += [counted, live, resident] if not env else [resident]
        if row is not None:
            rows[level] = row
    if "dp" not in rows:
        return table
    _, dp_counted, _, dp_resident, dp_fixed = rows["dp"]
    for level, (source, counted, live, resident, fixed) in rows.items():
        saving = dp_counted - counted
        ratio = (dp_resident - resident) / saving if saving else None
        ratio_fixed = (dp_fixed - fixed) / saving if saving else None
        table.add(f"{level} ({source})", mib(counted), mib(live), f"{live / counted:.3f}", mib(resident),
                  None if ratio is None else f"{ratio:.3f}", mib(fixed),
                  None if ratio_fixed is None else f"{ratio_fixed:.3f}")
        result.metrics[f"process.{level}.live_over_counted"] = live / counted
        if ratio is not None:
            result.metrics[f"process.{level}.resident_over_counted_saving"] = ratio
            result.metrics[f"process.{level}.resident_fixed_mmap_over_counted_saving"] = ratio_fixed
    table.notes += [
        "counted: job.memory()'s params + grads + optimizer; live tensors: every CPU tensor storage the worker "
        "still references after gc.collect(), each once (benchmarks/harness/probes.py); resident: /proc/self/statm "
        "after gc.collect() and malloc_trim(0). Each the largest over the ranks.",
        "live / counted = 1 means the runtime's count is every tensor byte the worker holds between steps. "
        "Resident memory also holds the interpreter, torch and the region graphs (alike for every strategy), so "
        "it is compared as savings against dp: 1 means the bytes ZeRO saves by the count leave the process.",
        "With glibc's defaults they mostly do not: after large frees glibc raises its mmap threshold and keeps "
        "big tensors in a heap it cannot shrink past live blocks, so the transient buffers of a step (ZeRO-1's "
        "gathered copy, ZeRO-2's full gradient before its reduce-scatter) leave the freed memory resident. "
        f"With {FIXED_MMAP} in the workers (piper.compile(..., worker_env=...)) each big tensor is mapped on "
        "its own and unmapped when freed.",
    ]
    return table


def _ranks(ranks: list[int], n: int) -> str:
    if len(ranks) == n:
        return f"all {n}"
    return ", ".join(map(str, ranks))


def _activation_table(ctx, result, quick, optimizer) -> Table:
    wl = GPTWorkload(n_layer=4, n_embd=32, n_head=2, block_size=16, batch=16) if quick else \
        GPTWorkload(n_layer=8, n_embd=128, n_head=4, block_size=64, batch=32)
    p, m = (2, 8) if quick else (4, 8)
    kw = wl.model_kw(p)
    batch = gpt_batches(wl, 1)[0]
    table = Table(f"Peak saved activations per device within one step, {p} devices, {m} microbatches; "
                  f"{wl.describe(p)}",
                  ["system", "schedule", "rank", "peak MiB", "1F1B / GPipe", "expected (p - rank) / m"])
    peaks: dict[tuple[str, str], list[int | None]] = {}
    for kind in ("gpipe", "1f1b"):
        ctx.log(f"memory: saved activations, Piper {kind} on {p} devices")
        strategy, source, _ = schedule_strategy(kind, pp=p, microbatches=m)
        try:
            with piper.compile(make_gpt(kw)[0], batch, strategy=strategy, mesh={"pp": p}, optimizer=optimizer,
                               timeout=120) as job:
                probes.install(job, track_activations=True)
                job.step(*batch)
                peaks[("Piper", kind)] = [r["peak_activations"] for r in probes.read(job)]
        except Exception as exc:
            peaks[("Piper", kind)] = [None] * p
            table.notes.append(f"Piper {kind} failed: {short_error(exc)}")
    try:
        with TorchGroup(p, timeout=120) as group:
            for kind, schedule in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")):
                ctx.log(f"memory: saved activations, torch {schedule} on {p} devices")
                group.setup("pipeline", schedule=schedule, model_kw=kw, microbatches=m, track_activations=True)
                group.step(*batch)
                peaks[("torch", kind)] = group.peak_activations()
    except Exception as exc:
        table.notes.append(f"torch baseline failed: {short_error(exc)}")
    for system in ("Piper", "torch"):
        for kind in ("gpipe", "1f1b"):
            values = peaks.get((system, kind))
            if values is None:
                continue
            for rank, peak in enumerate(values):
                gpipe = peaks.get((system, "gpipe"), [None] * p)[rank]
                ratio = peak / gpipe if kind == "1f1b" and peak and gpipe else None
                table.add(system, kind, rank, mib(peak), None if ratio is None else f"{ratio:.3f}",
                          f"{min(p - rank, m) / m:.3f}" if kind == "1f1b" else None)
                if peak is not None:
                    result.metrics[f"activations.{system.lower()}.{kind}.rank{rank}.peak_bytes"] = peak
    table.notes += [
        "The same measurement for both systems: a torch.autograd.graph.saved_tensors_hooks pair around each "
        "region's forward counts the bytes of every storage autograd saves for backward (parameter storages "
        "excluded) from pack until autograd frees it; the peak over the step is reported. It is installed in "
        "Piper's workers through Ray's actor.__ray_call__ (benchmarks/harness/probes.py), and around each torch stage "
        "module's forward. (Piper's runtime counts the same way on its own: job.memory()['activations_peak'].)",
        "The expected ratio is the number of microbatches each stage keeps in flight: 1F1B holds p - rank, "
        "GPipe all m. Activation tensors differ slightly between the two systems (Piper runs the exported "
        "ATen graph, torch the eager modules).",
    ]
    return table
