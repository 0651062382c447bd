"""Experts divided against replicated: one model on dp=2 with plain `dp` and with `dp` +
`expert_parallel`, the two jobs alternating step by step (suites 10 and 15).
"""
from __future__ import annotations

import piper
from piper.dsl import load_strategy

from .timing import alternate

EP_AGAINST_DP = {"dp": "use dp() on dp\n", "dp + expert_parallel": "use dp() on dp\nuse expert_parallel() on dp\n"}


def divided_and_replicated(model, batches, optimizer, warmup: int, steps: int, **compile_kw):
    """`model` on dp=2 with its experts replicated and divided (EP_AGAINST_DP), the two jobs
    alternating step by step: (their `Timings`, rank 0's parameter bytes in each)."""
    jobs = {}
    try:
        for name, text in EP_AGAINST_DP.items():
            jobs[name] = piper.compile(model, batches[0], strategy=load_strategy(text), mesh={"dp": 2},
                                       optimizer=optimizer, **compile_kw)
        timings = alternate({n: j.step for n, j in jobs.items()}, batches, warmup=warmup, steps=steps)
        return timings, {n: j.memory()[0]["params"] for n, j in jobs.items()}
    finally:
        for j in jobs.values():
            j.close()
