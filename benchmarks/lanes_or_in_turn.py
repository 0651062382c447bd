"""A schedule of suite 9 three ways, alternated step by step: torch's, Piper's with its overlapped
slots in lanes (the default), and Piper's with `overlap=False` (each slot's items in turn).

    python -m benchmarks.lanes_or_in_turn FAMILY DEVICES KIND TORCH_SCHEDULE
    python -m benchmarks.lanes_or_in_turn hf-llama 2 dualpipev ScheduleDualPipeV

Prints each system's median step and torch's over Piper's, with the middle half of the
step-by-step paired ratios (RESULTS.md, suite 9).
"""
from __future__ import annotations

import argparse
import functools
import statistics

import torch

import piper

from .baselines.torch_group import TorchGroup
from .harness.families import FAMILIES
from .harness.machine import ray_cluster
from .harness.timing import alternate
from .harness.workloads import PIPELINE_SCHEDULES, schedule_strategy
from .suites.families import MICROBATCHES


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lanes_or_in_turn")
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("devices", type=int)
    parser.add_argument("kind", choices=sorted(PIPELINE_SCHEDULES))
    parser.add_argument("torch_schedule")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    family = FAMILIES[args.family]
    cfg, p = family.full, args.devices
    regions = p * PIPELINE_SCHEDULES[args.kind][1]
    batches = family.batches(cfg, args.steps + 2)
    strategy, _, _ = schedule_strategy(args.kind, pp=p, microbatches=MICROBATCHES)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    with ray_cluster(), TorchGroup(p, timeout=120) as group:
        group.setup("pipeline", schedule=args.torch_schedule, model=f"family:{args.family}",
                    model_kw={"cfg": cfg, "regions": regions}, microbatches=MICROBATCHES)
        jobs = {name: piper.compile(family.make(cfg, regions=regions), batches[0], strategy=strategy,
                                    mesh={"pp": p}, optimizer=optimizer, timeout=120, overlap=overlap)
                for name, overlap in (("lanes", True), ("in turn", False))}
        try:
            timings = alternate({"torch": group.step, **{k: j.step for k, j in jobs.items()}}, batches,
                                warmup=2, steps=args.steps)
        finally:
            for job in jobs.values():
                job.close()
    torch_ms = timings.median("torch") * 1e3
    print(f"torch {torch_ms:.0f} ms")
    for name in jobs:
        ms = timings.median(name) * 1e3
        q1, _, q3 = statistics.quantiles(timings.paired_ratios("torch", name), n=4)
        print(f"Piper, {name}: {ms:.0f} ms, torch/Piper {torch_ms / ms:.2f}x (paired, middle half {q1:.2f}-{q3:.2f})")


if __name__ == "__main__":
    main()
