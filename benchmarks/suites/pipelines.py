"""Suite 1, `pipelines`: torch.distributed.pipelining schedules vs Piper's equivalent strategies.

The example GPT is cut into the same regions for both (one region per stage;
two per device for interleaved and V schedules), on 2 and 4 devices with 8
microbatches. Ratio = PyTorch step time / Piper step time (> 1: Piper faster).

    python -m benchmarks --suite pipelines
"""
from __future__ import annotations

import functools

import torch

import piper

from ..baselines.torch_group import set_up_group
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, compile_or_failure
from ..harness.timing import head_to_head
from ..harness.workloads import PIPELINE_SCHEDULES, GPTWorkload, gpt_batches, make_gpt, schedule_strategy

MICROBATCHES = 8


def workload(quick: bool) -> GPTWorkload:
    if quick:
        return GPTWorkload(n_layer=4, n_embd=32, n_head=2, block_size=16, batch=16)
    return GPTWorkload(n_layer=8, n_embd=128, n_head=4, block_size=64, batch=32)


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    wl = workload(quick)
    devices = (2,) if quick else (2, 4)
    kinds = tuple(PIPELINE_SCHEDULES)
    warmup, steps = (1, 2) if quick else (2, 10)
    timeout = 120.0
    batches = gpt_batches(wl, warmup + steps)
    result = SuiteResult("pipelines", 1, "Pipeline schedules: torch.distributed.pipelining vs Piper", ctx.command("pipelines"))
    table = Table(f"Steady-state step time (median of {steps} steps after {warmup} warm-up, A/B alternated); "
                  f"{wl.describe()}, {MICROBATCHES} microbatches",
                  ["devices", "torch schedule", "Piper strategy", "torch ms", "Piper ms", "ratio torch/Piper",
                   "paired ratios, middle half", "spread torch", "spread Piper", "max |Δloss|"])
    stdlib_notes: dict[str, str] = {}
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)

    with ray_cluster():
        for p in devices:
            group = None
            unhosted = ctx.cannot_host(p)
            for kind in kinds:
                torch_name, per_rank = PIPELINE_SCHEDULES[kind]
                if unhosted:
                    table.add(p, torch_name.removeprefix("Schedule"), "—", unhosted, unhosted, *[None] * 5)
                    continue
                regions = p * per_rank
                kw = wl.model_kw(regions)
                ctx.log(f"pipelines: {torch_name} vs Piper on {p} devices ({regions} regions)")
                # -- torch ----------------------------------------------------------------------
                group, torch_error = set_up_group(ctx, group, p, timeout, "pipeline", schedule=torch_name,
                                                  model_kw=kw, microbatches=MICROBATCHES)
                # -- Piper ----------------------------------------------------------------------
                strategy, source, note = schedule_strategy(kind, pp=p, microbatches=MICROBATCHES)
                if note:
                    stdlib_notes[kind] = note
                if strategy is None:
                    job, piper_error = None, "not yet available"
                else:
                    job, piper_error = compile_or_failure(ctx, lambda: piper.compile(
                        make_gpt(kw)[0], batches[0], strategy=strategy, mesh={"pp": p}, optimizer=optimizer,
                        timeout=timeout, device=ctx.device))
                # -- alternate --------------------------------------------------------------------
                race = head_to_head(group, job, batches, warmup=warmup, steps=steps, torch_error=torch_error,
                                    piper_error=piper_error)
                group = race.group
                table.add(p, torch_name.removeprefix("Schedule"), source, *race.cells)
                for name, value in race.metrics():
                    result.metrics[f"{kind}.pp{p}.{name}"] = value
            if group is not None:
                group.close()

    table.notes += [
        "ratio > 1 means Piper's step is faster. Both systems start from the same weights and see the same "
        "batches in the same order; 'max |Δloss|' compares their losses step by step (a fairness check).",
        "paired ratios, middle half: torch's step over Piper's step for each pair of steps (run back to back "
        "on the same batch), 25th to 75th percentile. Where it spans 1.0 the two are level within this "
        "machine's noise.",
        "spread = (max - min) / median of the timed steps.",
        "torch: PipelineStage per stage module (GPTStage: the GPT's own embeddings/blocks/head), loss_fn = the "
        "GPT's cross-entropy, scale_grads=True; Piper: the GPT captured with piper.annotate regions.",
        "Piper strategy: the stdlib script named in the row. Should one fail to load, the table notes why, "
        "and GPipe, 1F1B and Interleaved1F1B fall back to equivalent Python strategies (interleaved: the exact "
        "per-rank order torch's ScheduleInterleaved1F1B computes, from "
        "torch.distributed.pipelining._schedule_visualizer.get_schedule_ops).",
        "'step failed' in a Piper cell is the runtime's own error, reported as is; the torch side still runs.",
    ]
    for kind, note in stdlib_notes.items():
        table.notes.append(f"stdlib for {kind}: {note}")
    result.tables.append(table)
    return result
