"""Suite 11, `memory-model`: predicted peak bytes per device (piper/memory_model.py, from the
compiled plans before anything runs) against the runtime's measured `step_peak`
(job.memory()), for every composition of a stdlib pipeline schedule with a stdlib
data-parallel strategy on the example GPT (dp=2 x pp=2, or one of the two axes).

    python -m benchmarks --suite memory-model          # every composition
    python -m benchmarks --suite memory-model --quick  # a representative subset
"""
from __future__ import annotations

import functools

import torch

import piper
from piper.dsl import load_strategy
from piper.memory_model import predict_memory

from .harness import SuiteResult, Table, mib, ray_cluster, short_error
from .workloads import GPTWorkload, gpt_batches, make_gpt

PIPELINES = {"gpipe": 1, "one_f_one_b": 1, "zero_bubble": 1, "interleaved_1f1b": 2,
             "interleaved_zero_bubble": 2, "zbv": 2, "dualpipev": 2}
DATA = (None, "dp", "zero1", "zero2", "zero3")
QUICK = [(None, "zero3"), ("one_f_one_b", "zero3"), ("zero_bubble", "zero2"), ("dualpipev", "zero2")]


def script(pipeline, data, microbatches: int) -> str:
    mesh = [a for a, on in (("dp=2", data), ("pp=2", pipeline)) if on]
    lines = [f"mesh {', '.join(mesh)}"]
    if pipeline:
        lines.append(f"use {pipeline}(microbatches={microbatches}) on pp")
    if data:
        lines.append(f"use {data}() on dp")
    return "\n".join(lines) + "\n"


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    result = SuiteResult("memory-model", 11, "Predicted vs measured peak memory per device",
                         ctx.command("memory-model"))
    wl = GPTWorkload(n_layer=4, n_embd=64, n_head=2, block_size=32, batch=16)
    compositions = QUICK if quick else [(p, d) for p in (None, *PIPELINES) for d in DATA if p or d]
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    batches = gpt_batches(wl, 2)
    table = Table(f"Peak bytes in a step, predicted before running vs measured (job.memory() step_peak, "
                  f"second step); {wl.describe()}, 4 microbatches",
                  ["composition", "rank", "predicted MiB", "measured MiB", "error", "at", "activations MiB",
                   "gathered MiB", "in flight MiB"])
    errors = []
    with ray_cluster():
        for pipeline, data in compositions:
            name = " + ".join(x for x in (pipeline, data) if x)
            regions = 2 * PIPELINES[pipeline] if pipeline else 2
            ctx.log(f"memory-model: {name}")
            try:
                with piper.compile(make_gpt(wl.model_kw(regions))[0], batches[0], strategy=load_strategy(
                        script(pipeline, data, 4)), optimizer=optimizer, timeout=300) as job:
                    predicted = predict_memory(job.compiled, job.program, optimizer=optimizer)
                    for b in batches:
                        job.step(*b)
                    measured = job.memory()
            except Exception as exc:
                table.add(name, "—", None, None, f"failed: {short_error(exc)}", None, None, None, None)
                continue
            seen = set()
            for rank, m in sorted(measured.items()):
                p = predicted[rank]
                if (p.peak, m["step_peak"]) in seen:     # data-parallel replicas repeat their stage's row
                    continue
                seen.add((p.peak, m["step_peak"]))
                err = (p.peak - m["step_peak"]) / m["step_peak"]
                errors.append(abs(err))
                table.add(name, rank, mib(p.peak), mib(m["step_peak"]), f"{err:+.1%}", p.at, mib(p.activations),
                          mib(p.gathered), mib(p.in_flight))
                result.metrics[f"{name}.rank{rank}.error"] = err
    if errors:
        within = sum(e <= 0.10 for e in errors)
        result.metrics["within_10pct"] = within
        result.metrics["rows"] = len(errors)
        result.metrics["max_abs_error"] = max(errors)
        table.notes.append(f"{within} of {len(errors)} rows within 10%; largest error {max(errors):.2%}. "
                           "Ranks of one pipeline stage with the same numbers are shown once.")
    table.notes.append("The prediction replays each device's plan with the executor's allocation rules; "
                       "saved activations per region come from one forward of each region on this machine's "
                       "CPU at the microbatch's shapes. Point-to-point buffers are in neither number.")
    result.tables.append(table)
    return result
