"""Suite 11, `memory-model`: predicted peak bytes per device (piper/compiler/memory_model.py, from the
compiled plans before anything runs) against the runtime's measured `step_peak`
(job.memory()), for every composition of a stdlib pipeline schedule with a stdlib
data-parallel strategy on the example GPT (dp=2 x pp=2, or one of the two axes),
then for `precision=`, `recompute` and `shard experts` (the example MoE).

    python -m benchmarks --suite memory-model          # every composition
    python -m benchmarks --suite memory-model --quick  # a representative subset
"""
from __future__ import annotations

import functools

import torch

import piper
from piper.dsl import load_strategy
from piper.compiler.memory_model import predict_job

from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, mib, short_error
from ..harness.workloads import GPTWorkload, gpt_batches, make_gpt

PIPELINES = {"gpipe": 1, "one_f_one_b": 1, "zero_bubble": 1, "interleaved_1f1b": 2,
             "interleaved_zero_bubble": 2, "zbv": 2, "dualpipev": 2}
DATA = (None, "dp", "zero1", "zero2", "zero3")
QUICK = [(None, "zero3"), ("one_f_one_b", "zero3"), ("zero_bubble", "zero2"), ("dualpipev", "zero2")]
# name -> (pipeline, its regions per device, data-parallel strategy, statements, precision, model)
FEATURES = {
    "zero3 bf16": (None, 1, "zero3", "", "bf16", "gpt"),
    "zero2 fp16": (None, 1, "zero2", "", "fp16", "gpt"),
    "one_f_one_b + zero3 bf16": ("one_f_one_b", 1, "zero3", "", "bf16", "gpt"),
    "one_f_one_b recompute": ("one_f_one_b", 1, None, "recompute PP=*", "fp32", "gpt"),
    "zero_bubble recompute": ("zero_bubble", 1, None, "recompute PP=*", "fp32", "gpt"),
    "dualpipev recompute": ("dualpipev", 2, None, "recompute PP=*", "fp32", "gpt"),
    "zero3 recompute PP=1": (None, 1, "zero3", "recompute PP=1", "fp32", "gpt"),
    "one_f_one_b + zero3 bf16 recompute": ("one_f_one_b", 1, "zero3", "recompute PP=*", "bf16", "gpt"),
    "expert_parallel + zero1 (MoE)": (None, 1, "zero1", "use expert_parallel() on dp", "fp32", "moe"),
    "one_f_one_b + zero3 + expert_parallel (MoE)": ("one_f_one_b", 1, "zero3", "use expert_parallel() on dp",
                                                    "fp32", "moe"),
}
QUICK_FEATURES = ("zero3 bf16", "zero_bubble recompute", "one_f_one_b + zero3 bf16 recompute",
                  "expert_parallel + zero1 (MoE)")


def script(pipeline, data, microbatches: int, extra: str = "") -> str:
    mesh = [a for a, on in (("dp=2", data), ("pp=2", pipeline)) if on]
    lines = [f"mesh {', '.join(mesh)}"]
    if pipeline:
        lines.append(f"use {pipeline}(microbatches={microbatches}) on pp")
    if data:
        lines.append(f"use {data}() on dp")
    if extra:
        lines.append(extra)
    return "\n".join(lines) + "\n"


COLUMNS = ["composition", "rank", "predicted MiB", "least MiB", "measured MiB", "error", "in range", "at",
           "activations MiB", "gathered MiB", "in flight MiB"]


def _measure(table, result, errors, name, model, batches, text, optimizer, precision="fp32") -> None:
    """Predict, train two steps, add a row per distinct rank to `table`."""
    try:
        with piper.compile(model, batches[0], strategy=load_strategy(text), optimizer=optimizer, timeout=300,
                           precision=precision) as job:
            predicted = predict_job(job, optimizer=optimizer)
            for b in batches:
                job.step(*b)
            measured = job.memory()
    except Exception as exc:
        table.add(name, "—", None, None, None, f"failed: {short_error(exc)}", None, None, None, None, None)
        return
    seen = set()
    for rank, m in sorted(measured.items()):
        p = predicted[rank]
        if (p.peak, m["step_peak"]) in seen:     # data-parallel replicas repeat their stage's row
            continue
        seen.add((p.peak, m["step_peak"]))
        err = (p.peak - m["step_peak"]) / m["step_peak"]
        errors.append(abs(err))
        inside = 0.9 * p.least <= m["step_peak"] <= 1.1 * p.peak
        table.add(name, rank, mib(p.peak), mib(p.least), mib(m["step_peak"]), f"{err:+.1%}",
                  "yes" if inside else "NO", p.at, mib(p.activations), mib(p.gathered), mib(p.in_flight))
        result.metrics[f"{name}.rank{rank}.error"] = err


def _notes(table, errors) -> None:
    if errors:
        within = sum(e <= 0.10 for e in errors)
        table.notes.append(f"{within} of {len(errors)} rows within 10% of the predicted (worst-interleaving) "
                           f"peak; largest error {max(errors):.2%}. Ranks of one pipeline stage with the same "
                           "numbers are shown once.")
    table.notes.append("least: the peak if every overlapped slot's lanes interleave as favourably as they can "
                       "(equal to predicted without lanes); in range: measured within [0.9 x least, "
                       "1.1 x predicted]. Which interleaving a step gets depends on its threads' timing.")


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    result = SuiteResult("memory-model", 11, "Predicted vs measured peak memory per device",
                         ctx.command("memory-model"))
    wl = GPTWorkload(n_layer=4, n_embd=64, n_head=2, block_size=32, batch=16)
    compositions = QUICK if quick else [(p, d) for p in (None, *PIPELINES) for d in DATA if p or d]
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    batches = gpt_batches(wl, 2)
    table = Table(f"Peak bytes in a step, predicted before running vs measured (job.memory() step_peak, "
                  f"second step); {wl.describe()}, 4 microbatches", COLUMNS)
    errors: list[float] = []
    features = Table(f"precision=, recompute and shard experts: predicted vs measured step peak; {wl.describe()} "
                     "(MoE: examples/moe.py, 2 blocks of 4 experts top-2, dim 32, T=32, global batch 16), "
                     "4 microbatches", COLUMNS)
    feature_errors: list[float] = []
    with ray_cluster():
        for pipeline, data in compositions:
            name = " + ".join(x for x in (pipeline, data) if x)
            regions = 2 * PIPELINES[pipeline] if pipeline else 2
            ctx.log(f"memory-model: {name}")
            _measure(table, result, errors, name, make_gpt(wl.model_kw(regions))[0], batches,
                     script(pipeline, data, 4), optimizer)
        for name in (QUICK_FEATURES if quick else FEATURES):
            pipeline, per_device, data, extra, precision, family = FEATURES[name]
            ctx.log(f"memory-model: {name}")
            if family == "moe":
                from examples.moe import make_model, training_batches

                model = make_model(n_layer=2, n_regions=2)
                stream = training_batches(16, seed=1)
                data_batches = [next(stream) for _ in range(2)]
            else:
                model, data_batches = make_gpt(wl.model_kw(2 * per_device))[0], batches
            _measure(features, result, feature_errors, name, model, data_batches,
                     script(pipeline, data, 4 if pipeline else 0, extra) + ("" if pipeline else "split MB into 4\n"),
                     optimizer, precision)
    all_errors = errors + feature_errors
    if all_errors:
        result.metrics["within_10pct"] = sum(e <= 0.10 for e in all_errors)
        result.metrics["rows"] = len(all_errors)
        result.metrics["max_abs_error"] = max(all_errors)
    _notes(table, errors)
    table.notes.append("The prediction replays each device's plan with the executor's allocation rules; "
                       "saved activations per region come from one forward of each region on this machine's "
                       "CPU at the microbatch's shapes. Point-to-point buffers are in neither number.")
    _notes(features, feature_errors)
    features.notes.append("bf16/fp16: float32 masters, gradients and AdamW state plus a 16-bit copy (ZeRO-3: "
                          "16-bit gathers only); recompute: a region keeps its inputs and reruns in B/BI; "
                          "expert_parallel: each device holds half of every expert weight. MoE activations "
                          "depend on the routing (the prediction assumes each device receives its share of the "
                          "token copies).")
    result.tables += [table, features]
    return result
