"""What one collective call costs inside a worker, apart from its bytes: `piper tune`'s calibration
times a few small all-reduces, reduce-scatters and all-gathers on each of a job's groups, between steps.

On the CPU runtime a Gloo collective of a few kilobytes costs far more than its bytes over the
loopback throughput: every call is a rendezvous of its group's processes and work on Gloo's
threads (0.2-1.5 ms of CPU and 0.5-10 ms of wall time per call on a loaded 2-core machine with
2-4 processes, against microseconds for its bytes). ZeRO-3 issues several per region and step.

    costs = [a.__ray_call__.remote(time_collectives) for a in job.actors]   # every rank at once
    # per rank: {("ALL_GATHER", 2): (wall s, CPU s), ("REDUCE_SCATTER", 2): ..., ...}
"""
from __future__ import annotations

import statistics
import time

import torch

from . import collectives

OPS = ("ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER")
ELEMENTS = 256          # per member: a call's fixed cost, not its bytes
REPEATS, WARMUP = 6, 2


def _issue(op: str, group, n: int):
    if op == "ALL_REDUCE":
        return collectives.all_reduce(torch.zeros(ELEMENTS * n), group)
    if op == "REDUCE_SCATTER":
        return collectives.reduce_scatter_into(torch.zeros(ELEMENTS), torch.zeros(ELEMENTS * n), group)
    return collectives.all_gather_into(torch.zeros(ELEMENTS * n), torch.zeros(ELEMENTS), group)


def time_collectives(worker, repeats: int = REPEATS) -> dict[tuple[str, int], tuple[float, float]]:
    """Inside a worker (`actor.__ray_call__`, on every rank at once, between steps): per (op, group
    size), the median wall seconds of one small call and the process's CPU seconds for it (every
    thread: Gloo's work included), over each of its groups of two or more. Every rank walks its
    groups in one sorted order, so two ranks that share groups meet in each in the same order."""
    groups = worker.executor.groups
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for ranks in sorted(groups):
        n = len(ranks)
        if n < 2:
            continue
        for op in OPS:
            for i in range(WARMUP + repeats):
                cpu, wall = time.process_time(), time.perf_counter()
                _issue(op, groups[ranks], n).wait()
                if i >= WARMUP:
                    samples.setdefault((op, n), []).append((time.perf_counter() - wall, time.process_time() - cpu))
    return {key: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for key, v in samples.items()}
