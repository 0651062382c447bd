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

from . import probes
from .baselines import TorchGroup
from .harness import SuiteResult, Table, mib, ray_cluster, short_error
from .workloads import GPTWorkload, gpt_batches, make_gpt, n_params, schedule_strategy, zero_strategy

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
        "Piper's runtime does not report activation memory; the harness measures it: a "
        "torch.autograd.graph.saved_tensors_hooks pair around each region's forward counts the bytes of every "
        "storage autograd saves for backward (parameter storages excluded) from pack until autograd frees it; "
        "the peak over the step is reported. It is installed in Piper's workers through Ray's "
        "actor.__ray_call__ (benchmarks/probes.py), and around each torch stage module's forward.",
        "A runtime hook would make this first-class: the executor could wrap each F in the same "
        "saved_tensors_hooks (or read torch.cuda.max_memory_allocated on GPU) and return per-rank peaks "
        "from job.memory().",
        "The expected ratio is the number of microbatches each stage keeps in flight: 1F1B holds p - rank, "
        "GPipe all m. Activation tensors differ slightly between the two systems (Piper runs the exported "
        "ATen graph, torch the eager modules).",
    ]
    return table
