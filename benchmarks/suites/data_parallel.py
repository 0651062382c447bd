"""Suite 2, `data-parallel`: Piper `dp` vs DistributedDataParallel, Piper `zero3` vs FSDP2 `fully_shard`.

Same GPT, same global batch split evenly over the devices, one microbatch
per device per step (no gradient accumulation on either side), AdamW, on 2
and 4 devices. Ratio = PyTorch step time / Piper step time.

    python -m benchmarks --suite data-parallel
"""
from __future__ import annotations

import functools

import torch

import piper

from ..baselines.torch_group import set_up_group
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, compile_or_failure
from ..harness.timing import head_to_head
from ..harness.workloads import GPTWorkload, gpt_batches, make_gpt, zero_strategy

PAIRS = (("dp", "ddp", "DistributedDataParallel"), ("zero3", "fsdp2", "FSDP2 fully_shard"))


def workload(quick: bool) -> tuple[GPTWorkload, int]:
    """The model and its region count (one flat unit per region in Piper, one FSDP2 group per region)."""
    if quick:
        return GPTWorkload(n_layer=2, n_embd=32, n_head=2, block_size=16, batch=8), 2
    return GPTWorkload(n_layer=4, n_embd=128, n_head=4, block_size=64, batch=32), 4


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    wl, regions = workload(quick)
    devices = (2,) if quick else (2, 4)
    warmup, steps = (1, 2) if quick else (2, 10)
    timeout = 120.0
    batches = gpt_batches(wl, warmup + steps)
    kw = wl.model_kw(regions)
    result = SuiteResult("data-parallel", 2, "Data parallel and ZeRO-3 vs DDP and FSDP2", ctx.command("data-parallel"))
    table = Table(f"Steady-state step time (median of {steps} steps after {warmup} warm-up, A/B alternated); "
                  f"{wl.describe(regions)}, split evenly over the devices",
                  ["devices", "Piper", "torch", "torch ms", "Piper ms", "ratio torch/Piper",
                   "paired ratios, middle half", "spread torch", "spread Piper", "max |Δloss|"])
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    sources = {}
    with ray_cluster():
        for n in devices:
            group = None
            unhosted = ctx.cannot_host(n)
            for level, baseline, label in PAIRS:
                if unhosted:
                    table.add(n, level, label, unhosted, unhosted, *[None] * 5)
                    continue
                ctx.log(f"data-parallel: Piper {level} vs {label} on {n} devices")
                group, torch_error = set_up_group(ctx, group, n, timeout, baseline, model_kw=kw)
                strategy, source, _ = zero_strategy(level, dp=n)
                sources[level] = source
                job, piper_error = compile_or_failure(ctx, lambda: piper.compile(
                    make_gpt(kw)[0], batches[0], strategy=strategy, mesh={"dp": n}, optimizer=optimizer,
                    timeout=timeout, device=ctx.device))
                race = head_to_head(group, job, batches, warmup=warmup, steps=steps, torch_error=torch_error,
                                    piper_error=piper_error)
                group = race.group
                table.add(n, f"{level} ({source})", label, *race.cells)
                for name, value in race.metrics():
                    result.metrics[f"{level}.dp{n}.{name}"] = value
            if group is not None:
                group.close()
    table.notes += [
        "ratio > 1 means Piper's step is faster; 'max |Δloss|' compares the two systems' losses step by step. "
        "Paired ratios: torch's step over Piper's for each pair of steps run back to back, 25th to 75th "
        "percentile.",
        "DDP: DistributedDataParallel(model) with default buckets; FSDP2: fully_shard on each region's modules "
        "(the same parameter groups as Piper's flat units: embeddings + first blocks, ..., last blocks + head), "
        "then on the root; reshard_after_forward=True (ZeRO-3). Both call optimizer.zero_grad() (set_to_none).",
        "Piper dp keeps one flat gradient buffer per region and all-reduces it after the region's last backward; "
        "zero3 all-gathers each region's parameters one compute ahead and reduce-scatters its gradients.",
    ]
    result.tables.append(table)
    return result
