"""Suite 16, `tensor-parallel`: tensor, sequence and vocab parallelism against torch's own, the 4D
composition against torchtitan's order, and `piper check` of a 4D plan at 8,192 devices.

(a) examples/llama_tp.py's model (float32) at TP=2 and TP=4, with the vocab-parallel embedding and
    loss, without and with sequence parallelism: Piper (`examples.llama_tp.tensor_parallel`) against
    `parallelize_module` with ColwiseParallel/RowwiseParallel (SequenceParallel, PrepareModuleInput)
    and `loss_parallel` on the same weights and batches (benchmarks/baselines/tensor_parallel.py).
    Step time (A/B alternated), peak bytes per rank (the same probe on both sides), and in a further
    untimed step what each side communicates (benchmarks/harness/tp_probes.py).
(b) Gloo's costs at the activation's size: an all-reduce + chunk (Piper's reduce-scatter on Gloo)
    against `reduce_scatter_tensor`, a broadcast per member (Piper's all-gather on Gloo) against
    `all_gather`, a clone (Piper's `tp_copy`).
(c) DP x PP x TP (dp=2, pp=2, tp=2; 8 processes): ZeRO-3 x 1F1B x TP + SP + vocab against
    torchtitan's order (TP, FSDP2 per block, PipelineStage + Schedule1F1B).
(d) `piper check` of dp=64 x pp=16 x tp=8 with 64 microbatches and `--regions PP=16`: the CLI as a
    whole process (wall time, peak RSS) and the compile call in-process (time, Python heap peak),
    and where the in-process compile spends its time (cProfile).

    python -m benchmarks --suite tensor-parallel [--quick]
"""
from __future__ import annotations

import cProfile
import functools
import gc
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import traceback
from collections import Counter
from pathlib import Path

import torch

import piper
from examples import llama_tp
from piper.dsl import load_strategy

from ..baselines.torch_group import set_up_group
from ..harness import probes, tp_probes
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, compile_or_failure, mib, ms, short_error
from ..harness.timing import alternate
from ..harness.workloads import REPO

VARIANTS = (("TP + vocab", False), ("TP + SP + vocab", True))
CHECK_MESH = {"dp": 64, "pp": 16, "tp": 8}
CHECK_MICROBATCHES = 64
REPEATS = 3                   # (d): the least of 3 runs, each process fresh


def workload(quick: bool) -> tuple[dict, int, int]:
    """(model sizes, batch, sequence) for (a) and (b); kv_heads divisible by 4 for TP=4."""
    if quick:
        return dict(vocab=128, dim=64, heads=4, kv_heads=4, hidden=128, layers=2), 4, 16
    return dict(vocab=1024, dim=256, heads=8, kv_heads=4, hidden=768, layers=4), 8, 64


def composed_workload(quick: bool) -> tuple[dict, int, int, int]:
    """(model sizes with 2 stages, global batch, sequence, microbatches) for (c)."""
    if quick:
        return dict(vocab=64, dim=32, heads=4, kv_heads=2, hidden=64, layers=2, stages=2), 8, 8, 2
    return dict(vocab=1024, dim=256, heads=8, kv_heads=4, hidden=768, layers=4, stages=2), 16, 64, 4


def describe(sizes: dict, batch: int, seq: int) -> str:
    return (f"examples/llama_tp.py dim={sizes['dim']} heads={sizes['heads']} kv_heads={sizes['kv_heads']} "
            f"hidden={sizes['hidden']} layers={sizes['layers']} vocab={sizes['vocab']}, batch {batch} x seq {seq}, "
            "float32, AdamW lr=1e-3")


def plan_text(mesh: dict, microbatches: int | None = None, zero: bool = False, sequence: bool = True) -> str:
    """The strategy as a script: the mesh, 1F1B and ZeRO-3 where asked, and llama_tp's TP plan."""
    def quoted(names):
        return ", ".join(f'"{n}"' for n in names)

    lines = ["mesh " + ", ".join(f"{k}={v}" for k, v in mesh.items())]
    if microbatches:
        lines.append(f"use one_f_one_b(microbatches={microbatches}) on pp")
    if zero:
        lines.append("use zero3() on dp")
    lines += [f"shard columns of {quoted(llama_tp.COLUMNS)} over tp", f"shard rows of {quoted(llama_tp.ROWS)} over tp",
              f"shard vocab of {quoted(llama_tp.VOCAB)} over tp"]
    if sequence:
        lines.append("shard sequence over tp")
    return "\n".join(lines) + "\n"


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    result = SuiteResult("tensor-parallel", 16, "Tensor parallelism vs torch's own; DP x PP x TP vs torchtitan's "
                         "order; piper check at 8,192 devices", ctx.command("tensor-parallel"))
    steps = (1, 3) if quick else (2, 8)
    with ray_cluster():
        tp_table, costs_table, comm_table = _tp_tables(ctx, result, *steps)
        result.tables += [tp_table, comm_table, costs_table]
        result.tables.append(_composed_table(ctx, result, *steps))
    result.tables += _check_tables(ctx, result)
    return result


# -- (a), (b): TP=2 and TP=4 against parallelize_module --------------------------------------------

def _tp_tables(ctx, result, warmup: int, steps: int):
    sizes, batch, seq = workload(ctx.quick)
    batches = llama_tp.batches(warmup + steps + 2, batch=batch, seq=seq, vocab=sizes["vocab"])
    table = Table(f"(a) Step time (median of {steps} steps after {warmup} warm-up, A/B alternated) and peak "
                  f"bytes per rank; {describe(sizes, batch, seq)}, the whole batch on every rank",
                  ["tp", "plan", "torch ms", "Piper ms", "ratio torch/Piper", "paired ratios, middle half",
                   "max |Δloss|", "torch peak MiB", "Piper peak MiB", "Piper job.memory step_peak MiB",
                   "torch tensor peak MiB", "Piper tensor peak MiB"])
    comm = Table("(a) Collectives per step (one further untimed step; per rank, alike on every rank): calls, "
                 "MiB sent in, ms until each returned", ["tp", "plan", "torch collectives", "torch DTensor ops",
                                                        "Piper collectives", "Piper TP ops per forward",
                                                        "ms in collectives torch / Piper",
                                                        "torch's other extra time per DTensor op"])
    costs = Table(f"(b) Gloo at the activation's size (batch x seq x dim = {batch} x {seq} x {sizes['dim']} "
                  "float32, split along seq): median ms of 30, the ways taken in turn after a barrier each, "
                  "the slowest rank of the torch group",
                  ["tp", "all-reduce", "all-reduce + chunk (Piper's reduce-scatter)", "reduce_scatter_tensor",
                   "all-gather", "a broadcast per member + cat (Piper's all-gather)", "clone (tp_copy)",
                   "Piper's reduce-scatters per step", "their extra ms per step"])
    for n in (2, 4):
        group, rs_calls = None, 0
        for label, sequence in VARIANTS:
            ctx.log(f"tensor-parallel: {label} at tp={n}")
            group, torch_error = set_up_group(ctx, group, n, 180.0, "tp", model="llama_tp",
                                              model_kw=dict(sizes, stages=1), sequence=sequence)
            strategy = load_strategy(plan_text({"tp": n}, sequence=sequence))
            # a region per block, as the README advises for ZeRO: each block's gradient buffer then
            # appears when the backward reaches it (the same weights as torch's model: regions are
            # annotations)
            job, piper_error = compile_or_failure(ctx, lambda: piper.compile(
                llama_tp.make_model(torch.float32, **sizes, stages=sizes["layers"]), batches[0], strategy=strategy,
                mesh={"tp": n}, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), timeout=180))
            race = _race(ctx, group, job, batches, warmup, steps, torch_error, piper_error)
            group = race.pop("group")
            table.add(n, label, *race.pop("cells"))
            comm.add(n, label, *race.pop("comm"))
            if sequence:
                rs_calls = race.get("piper_reduce_scatters", 0)
            for name, value in race.items():
                result.metrics[f"tp{n}.{'sp' if sequence else 'tp'}.{name}"] = value
        costs.add(n, *_gloo_costs(ctx, group, (batch, seq, sizes["dim"]), rs_calls, result, n))
        if group is not None:
            group.close()
    table.notes += _tp_notes()
    comm.notes += _comm_notes()
    return table, costs, comm


def _race(ctx, group, job, batches, warmup, steps, torch_error, piper_error) -> dict:
    """Alternate the two, then one step each with the peak probe and one with the collective counters;
    the table cells and the metrics. The job is closed here."""
    systems = {}
    if group is not None and torch_error is None:
        systems["torch"] = group.step
    if job is not None:
        systems["piper"] = job.step
    extra = {"torch": [None, None, None], "piper": [None, None, None, None, None]}
    try:
        timings = alternate(systems, batches[:warmup + steps], warmup=warmup, steps=steps)
        if "torch" in systems and "torch" not in timings.errors:
            extra["torch"] = [_torch_probe(group, batches[-2], probes.install_step_peak_torch, probes.read_step_peak),
                              _torch_probe(group, batches[-1], tp_probes.install_comm_counter_torch,
                                           tp_probes.read_comm_counter_torch),
                              _torch_probe(group, batches[-1], tp_probes.install_tensor_peak,
                                           probes.read_step_peak)]
        if "piper" in systems and "piper" not in timings.errors:
            extra["piper"] = _piper_probes(job, batches)
    finally:
        if job is not None:
            job.close()
    if "torch" in timings.errors:
        torch_error = f"step failed: {short_error(timings.errors['torch'])}"
        ctx.log(f"torch: {torch_error}")
        group.close()
        group = None
    if "piper" in timings.errors:
        piper_error = f"step failed: {short_error(timings.errors['piper'])}"
    return _race_cells(group, timings, torch_error, piper_error, extra)


def _race_cells(group, timings, torch_error, piper_error, extra) -> dict:
    t_ms, p_ms = ms(timings.median("torch")), ms(timings.median("piper"))
    ratio = t_ms / p_ms if t_ms and p_ms else None
    paired = timings.paired_ratios("torch", "piper")
    quartiles = statistics.quantiles(paired, n=4)[::2] if len(paired) >= 2 else None
    gap = timings.max_loss_gap("torch", "piper")
    torch_peak, torch_comm, torch_tensors = extra["torch"]
    piper_peak, own, piper_comm, graph_ops, piper_tensors = extra["piper"]
    torch_found = torch_comm.get("collectives", {}) if isinstance(torch_comm, dict) else {}
    cells = [t_ms if torch_error is None else torch_error, p_ms if piper_error is None else piper_error,
             None if ratio is None else f"{ratio:.2f}x",
             None if quartiles is None else f"{quartiles[0]:.2f} – {quartiles[1]:.2f}",
             None if gap is None else f"{gap:.1e}", _mib_cell(torch_peak), _mib_cell(piper_peak), mib(own),
             _mib_cell(torch_tensors), _mib_cell(piper_tensors)]
    comm = [_calls_cell({k: v for k, v in torch_found.items() if k != "wait"}),
            torch_comm.get("dtensor_ops") if isinstance(torch_comm, dict) else _error_cell(torch_comm),
            _calls_cell(piper_comm) if isinstance(piper_comm, dict) else _error_cell(piper_comm),
            ", ".join(f"{k} {v}" for k, v in sorted(graph_ops.items())) if graph_ops else None,
            f"{_seconds_ms(torch_found):.1f} / {_seconds_ms(piper_comm):.1f}"
            if torch_found and isinstance(piper_comm, dict) else None, None]
    if t_ms and p_ms and torch_found and isinstance(piper_comm, dict) and torch_comm.get("dtensor_ops"):
        other = (t_ms - _seconds_ms(torch_found)) - (p_ms - _seconds_ms(piper_comm))
        comm[-1] = f"{other * 1e3 / torch_comm['dtensor_ops']:.0f} µs"
    out = {"group": group, "cells": cells, "comm": comm}
    for name, value in (("torch_ms", t_ms), ("piper_ms", p_ms), ("ratio", ratio),
                        ("torch_peak", torch_peak), ("piper_peak", piper_peak),
                        ("torch_tensor_peak", torch_tensors), ("piper_tensor_peak", piper_tensors)):
        if isinstance(value, (int, float)):
            out[name] = value
    if torch_found:
        out["torch_collectives"] = sum(v[0] for k, v in torch_found.items() if k != "wait")
    if isinstance(piper_comm, dict):
        out["piper_collectives"] = sum(v[0] for v in piper_comm.values())
        out["piper_reduce_scatters"] = piper_comm.get("reduce_scatter", [0])[0]
    return out


def _torch_probe(group, batch, install, read):
    """One torch step with `install`ed in every actor: rank 0's reading (the largest, for a peak)."""
    import ray

    try:
        ray.get([a.__ray_call__.remote(install) for a in group.actors], timeout=group.timeout)
        group.step(*batch)
        found = ray.get([a.__ray_call__.remote(read) for a in group.actors], timeout=group.timeout)
    except Exception as exc:
        return exc
    return max(found) if all(isinstance(f, int) for f in found) else found[0]


def _piper_probes(job, batches) -> list:
    """[peak bytes (the probe), job.memory's step_peak, rank 0's TP collectives, TP ops in the graphs]."""
    try:
        probes.in_workers(job, probes.install_step_peak)
        job.step(*batches[-2])
        peak = max(p for p in probes.in_workers(job, probes.read_step_peak) if p is not None)
        own = max(m["step_peak"] for m in job.memory().values())
    except Exception as exc:
        peak = own = exc
    try:
        probes.in_workers(job, tp_probes.install_tp_counter)
        job.step(*batches[-1])
        counted = probes.in_workers(job, tp_probes.read_tp_counter)[0]
    except Exception as exc:
        counted = exc
    ops = Counter(str(node.target).split(".")[-2] if str(node.target).count(".") >= 2 else str(node.target)
                  for region in job.program.regions if region.graph is not None
                  for node in region.graph.graph.nodes if "piper" in str(node.target) and "tp_" in str(node.target))
    try:
        probes.in_workers(job, tp_probes.install_tensor_peak)
        job.step(*batches[-1])
        tensors = max(p for p in probes.in_workers(job, probes.read_step_peak) if p is not None)
    except Exception as exc:
        tensors = exc
    return [peak, own if not isinstance(own, Exception) else None, counted, dict(ops), tensors]


def _gloo_costs(ctx, group, shape, rs_calls, result, n) -> list:
    import ray

    if group is None:
        return ["no torch group"] + [None] * 7
    try:
        found = ray.get([a.__ray_call__.remote(tp_probes.gloo_costs, shape) for a in group.actors],
                        timeout=group.timeout)
    except Exception as exc:
        ctx.log(traceback.format_exc())
        return [f"failed: {short_error(exc)}"] + [None] * 7
    worst = {k: max(f[k] for f in found) for k in found[0]}
    for k, v in worst.items():
        result.metrics[f"gloo.tp{n}.{k}_ms"] = v * 1e3
    extra = (worst["all_reduce_chunk"] - worst["reduce_scatter_tensor"]) * rs_calls
    return [ms(worst["all_reduce"]), ms(worst["all_reduce_chunk"]), ms(worst["reduce_scatter_tensor"]),
            ms(worst["all_gather"]), ms(worst["broadcasts"]), ms(worst["clone"]), rs_calls, ms(extra)]


def _mib_cell(value):
    return mib(value) if isinstance(value, (int, float)) else _error_cell(value)


def _error_cell(value):
    return None if value is None else f"failed: {short_error(value)}" if isinstance(value, Exception) else str(value)


def _calls_cell(found: dict | None) -> str | None:
    if not found:
        return None
    return ", ".join(f"{k} {v[0]} ({v[1] / 2**20:.2f} MiB)" for k, v in sorted(found.items()))


def _seconds_ms(found) -> float:
    return sum(v[2] for k, v in found.items() if isinstance(v, list)) * 1e3


def _tp_notes() -> list[str]:
    return [
        "ratio > 1 means Piper's step is faster; paired ratios: torch's step over Piper's for each pair of "
        "steps run back to back, 25th to 75th percentile; 'max |Δloss|' compares the two systems' losses step "
        "by step (same weights, same batches).",
        "torch: parallelize_module over a 1-D DeviceMesh of the tp ranks with torchtitan's Llama plan "
        "(benchmarks/baselines/tensor_parallel.py), forward and backward under loss_parallel(); "
        "Piper: the same plan as statements (examples.llama_tp: shard columns/rows/vocab over tp, and "
        "shard sequence over tp for SP).",
        "peak: the bytes held between steps (parameters, gradients, optimizer state) plus the rise of the "
        "resident high-water mark during one step, after gc and malloc_trim (benchmarks/harness/probes.py), "
        "the largest over the ranks; job.memory's step_peak is Piper's own count of the same step. "
        "tensor peak: the same bytes held between steps plus the largest rise of live tensor bytes during one "
        "further step, summed from every allocation and free of the CPU allocator that torch's profiler "
        "records, the same on both sides: what the tensors hold, without what the allocator, Gloo or Python "
        "keep beside them; the peak's excess over it is theirs.",
    ]


def _comm_notes() -> list[str]:
    return [
        "torch: every c10d / functional collective the step dispatches after DTensor desugars its ops (a "
        "TorchDispatchMode, as CommDebugMode), and how many ops went through DTensor's dispatch (its per-op "
        "host cost: sharding propagation, redistribution); ms is the time until each collective and its wait "
        "returned. Piper: the worker's TensorGroup calls (the TP exchanges between the pieces of each cut region, "
        "and the tp-summed gradients), ms from each one's issue until its wait returned (what the plan runs in "
        "between overlaps it); on Gloo Piper's reduce-scatter is an all-reduce + chunk and its all-gather a broadcast "
        "per member, all_reduce (max) the vocab loss's max.",
        "Piper TP ops: the piper::tp_* nodes of the captured region graphs (one forward); each but tp_offset is "
        "one TP exchange of the plan, forward and backward (tp_copy's forward moves nothing and its backward is an "
        "all-reduce, tp_gather's a reduce-scatter, tp_reduce_scatter's an all-gather).",
        "torch's other extra time per DTensor op: (torch's median step - its ms in collectives) - (Piper's median "
        "step - its ms in collectives), over torch's DTensor ops per step: the host time each DTensor op costs "
        "beyond the same local computation, if that is where the rest of the gap lies (an estimate: the "
        "collective times come from the counted step, which runs under the counting mode).",
    ]


# -- (c): DP x PP x TP against torchtitan's order ---------------------------------------------------

def _composed_table(ctx, result, warmup: int, steps: int) -> Table:
    sizes, batch, seq, microbatches = composed_workload(ctx.quick)
    mesh = {"dp": 2, "pp": 2, "tp": 2}
    batches = llama_tp.batches(warmup + steps + 2, batch=batch, seq=seq, vocab=sizes["vocab"])
    table = Table(f"(c) DP x PP x TP, dp=2 x pp=2 x tp=2 (8 processes), 1F1B over {microbatches} microbatches, "
                  f"ZeRO-3 / FSDP2 over dp, TP + SP + vocab; {describe(sizes, batch, seq)} (global batch); "
                  f"median of {steps} steps after {warmup} warm-up",
                  ["torch", "Piper", "torch ms", "Piper ms", "ratio torch/Piper", "paired ratios, middle half",
                   "max |Δloss|", "torch peak MiB", "Piper peak MiB", "Piper job.memory step_peak MiB",
                   "torch tensor peak MiB", "Piper tensor peak MiB"])
    group, torch_error = set_up_group(ctx, None, 8, 300.0, "tp_fsdp2_pipeline", model="llama_tp", model_kw=sizes,
                                      schedule="Schedule1F1B", microbatches=microbatches, pp=2, tp=2, sequence=True)
    strategy = load_strategy(plan_text(mesh, microbatches, zero=True))
    job, piper_error = compile_or_failure(ctx, lambda: piper.compile(
        llama_tp.make_model(torch.float32, **sizes, block_regions=True), batches[0], strategy=strategy, mesh=mesh,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), timeout=300))
    race = _race(ctx, group, job, batches, warmup, steps, torch_error, piper_error)
    if race["group"] is not None:
        race["group"].close()
    table.add("TP -> fully_shard per block -> PipelineStage + Schedule1F1B",
              "one_f_one_b + zero3 + TP/SP/vocab statements", *race["cells"])
    for name, value in race.items():
        if isinstance(value, (int, float)) and "collectives" not in name and "reduce_scatters" not in name:
            result.metrics[f"composed.{name}"] = value
    table.notes += [
        "torch, in torchtitan's order on init_device_mesh((pp, dp, tp)): each rank's stage module (its blocks; "
        "the embedding on the first, norm and head on the last) parallelize_module'd over tp with the SP plan, "
        "fully_shard per block and on the stage over dp (reshard_after_forward=False, torchtitan's default "
        "under PP), PipelineStage over pp, Schedule1F1B with the model's loss; the step under loss_parallel().",
        "Piper: the script `" + plan_text(mesh, microbatches, zero=True).replace("\n", "; ").strip("; ") + "`, "
        "on the same model with an `L` region per block nested in each `PP` stage (`block_regions=True`): "
        "ZeRO-3 gathers and frees each block on its own, as fully_shard per block does.",
    ]
    return table


# -- (d): piper check at 8,192 devices -------------------------------------------------------------

def _check_tables(ctx, result) -> list[Table]:
    text = plan_text(CHECK_MESH, CHECK_MICROBATCHES, zero=True)
    devices = CHECK_MESH["dp"] * CHECK_MESH["pp"] * CHECK_MESH["tp"]
    table = Table(f"(d) piper check of dp=64 x pp=16 x tp=8 ({devices:,} devices), 1F1B over {CHECK_MICROBATCHES} "
                  "microbatches, ZeRO-3 over dp, TP + SP + vocab, --regions PP=16",
                  ["what", "seconds", "peak MiB", "result"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan_4d.pps"
        path.write_text(text)
        cached = {"PYTHONPYCACHEPREFIX": str(Path(tmp) / "pycache"), "PYTHONDONTWRITEBYTECODE": None}
        runs = (("interpreter + `import piper.cli` (the CLI's floor)", [sys.executable, "-c", "import piper.cli"],
                 {}, "floor"),
                ("`piper check` (whole process), as this environment runs it", _cli_command(path), {}, "cli"),
                ("`piper check` (whole process), bytecode cached (2nd run, PYTHONPYCACHEPREFIX)",
                 _cli_command(path), cached, "cli_cached"))
        for label, argv, env, key in runs:
            if key == "cli_cached":
                _timed_process(argv, env)                     # writes the cache
            seconds, peak, code, tail = min(_timed_process(argv, env) for _ in range(REPEATS))
            table.add(label, seconds, None if peak is None else peak / 2**10,
                      f"exit {code}" + (f": {tail}" if tail else ""))
            result.metrics[f"check.{key}_s"] = seconds
        profile = _cli_profile(path)
    seconds, heap, summary = _compile_in_process(text)
    table.add("compile call in-process (compile_script), time", seconds, None, summary)
    table.add("compile call in-process, Python heap peak (tracemalloc, a second run)", None, mib(heap), None)
    result.metrics.update({"check.compile_s": seconds, "check.compile_heap_peak": heap})
    no_bytecode = (" This environment sets PYTHONDONTWRITEBYTECODE=1, so each start compiles every imported "
                   "source again; the cached row unsets it and keeps the bytecode in a temporary "
                   "PYTHONPYCACHEPREFIX." if os.environ.get("PYTHONDONTWRITEBYTECODE") else "")
    table.notes += [
        "Each process is timed fresh by a small launcher (wall clock around the child; peak = the child's maximum "
        "resident set, RUSAGE_CHILDREN), the fastest of 3; the in-process compile the fastest of 3 too."
        + no_bytecode,
        "The in-process compile is `piper.compiler.analysis.compile_script` on the loaded script with regions "
        "{'PP': 16}, the call `piper check` makes, in this (warm) process with the cyclic collector paused. "
        "Target: under 1 s.",
        "Script: `" + text.replace("\n", "; ").strip("; ") + "`.",
    ]
    return [table, profile, _profile_table(text)]


LAUNCHER = """import os, resource, subprocess, sys, time
t0 = time.perf_counter()
out = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, out.returncode)
print(out.stdout)
"""


def _cli_command(path: Path, python: list[str] | None = None) -> list[str]:
    return (python or [sys.executable]) + ["-m", "piper.cli", "check", str(path), "--regions", "PP=16",
                                           "--format", "concise"]


def _timed_process(argv: list[str], env: dict | None = None) -> tuple[float, int, int, str]:
    """(wall seconds, max RSS KiB, exit code, last line of output) of `argv` as a fresh process, started by
    a launcher (a fork of this big process would report this one's resident set as the child's)."""
    environ = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], cwd=REPO, env=environ, capture_output=True,
                         text=True, timeout=600)
    head, *rest = out.stdout.splitlines()
    seconds, rss, code = head.split()
    lines = [line for line in rest if line.strip()]
    return float(seconds), int(rss), int(code), (lines[-1][:160] if lines else "")


# The CLI's phases, as (label, file suffix or "", function name), read from its cumulative times.
CLI_PHASES = (("the whole command (piper.cli main)", "piper/cli.py", "main"),
              ("imports (all, outermost)", "", "_find_and_load"),
              ("  of which: compiling .py sources to bytecode", "", "<built-in method builtins.compile>"),
              ("  of which: importing lark", "lark/__init__.py", "<module>"),
              ("parsing the script (dsl.syntax.parse_recovering)", "dsl/syntax.py", "parse_recovering"),
              ("the script's own checks (dsl.script.check_and_build)", "dsl/script.py", "check_and_build"),
              ("compile_script (lower, schedule, plans, verify)", "piper/compiler/analysis.py", "compile_script"))


def _cli_profile(path: Path) -> Table:
    """cProfile of `piper check` as a process: its phases' cumulative seconds."""
    table = Table("(d) Where the `piper check` process spends its time (python -m cProfile, this environment; "
                  "cumulative seconds under the profiler, which inflates them; phases overlap where a phase "
                  "imports)", ["phase", "function", "calls", "cumulative s", "share"])
    prof = path.with_suffix(".prof")
    argv = _cli_command(path, [sys.executable, "-m", "cProfile", "-o", str(prof)])
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not prof.exists():
        table.add("failed", (done.stderr or done.stdout).strip()[-160:], None, None, None)
        return table
    stats = pstats.Stats(str(prof)).stats
    total = next((v[3] for (f, _, n), v in stats.items() if f.endswith("piper/cli.py") and n == "main"), None)
    for label, suffix, name in CLI_PHASES:
        found = [(f, line, v[3], v[1]) for (f, line, n), v in stats.items() if n == name and f.endswith(suffix)]
        if not found:
            table.add(label, name, None, None, None)
            continue
        f, line, seconds, calls = max(found, key=lambda x: x[2])
        where = f"{Path(f).name}:{line}" if f != "~" else "builtin"
        table.add(label, f"{name} ({where})", calls, seconds, f"{seconds / total:.0%}" if total else None)
    return table


def _compile(text: str):
    from piper.compiler.analysis import compile_script

    collecting = gc.isenabled()
    gc.disable()
    try:
        return compile_script(load_strategy(text), regions={"PP": CHECK_MESH["pp"]})
    finally:
        if collecting:
            gc.enable()


def _compile_in_process(text: str) -> tuple[float | str, int | None, str]:
    try:
        _compile(text)                            # warm: imports and the stdlib's scripts
        seconds = None
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            compiled = _compile(text)
            took = time.perf_counter() - t0
            seconds = took if seconds is None else min(seconds, took)
        actions = sum(len(plan) for plan in compiled.plans.values())
        summary = f"{len(compiled.ir.nodes):,} IR nodes, {len(compiled.plans):,} plans, {actions:,} actions"
        del compiled
        tracemalloc.start()
        _compile(text)
        heap = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return seconds, heap, summary
    except Exception as exc:
        return f"failed: {short_error(exc)}", None, ""


def _profile_table(text: str, top: int = 12) -> Table:
    """cProfile of one in-process compile: the functions with the most own time."""
    table = Table(f"(d) Where the in-process compile spends its time (cProfile, one compile; top {top} by own time)",
                  ["function", "where", "calls", "own s", "cumulative s"])
    profiler = cProfile.Profile()
    try:
        profiler.enable()
        _compile(text)
        profiler.disable()
    except Exception as exc:
        profiler.disable()
        table.add("failed", short_error(exc), None, None, None)
        return table
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    for (file, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(file).relative_to(REPO)}:{line}" if file.startswith(str(REPO)) else f"{Path(file).name}:{line}"
        table.add(name, where, calls, own, cumulative)
    table.notes.append("cProfile roughly doubles the time of small Python calls; read the shares, not the sums.")
    return table
