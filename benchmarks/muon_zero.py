"""Muon + AdamW under ZeRO against every rank stepping every matrix, and Muon's price against AdamW's.

    .venv/bin/python -m benchmarks.muon_zero                      # dp=2 and 4, the small GPT, CPU
    .venv/bin/python -m benchmarks.muon_zero --dp 2 --steps 5 --json out.json

The recipe: `torch.optim.Muon` on the matrices, AdamW on the rest (`piper.per_group`). Its
baseline is the same recipe under plain data parallelism, where every rank all-reduces the
gradients and orthogonalises every matrix itself: what DDP with `torch.optim.Muon` does (Piper's
plain dp is that schedule: an all-reduce per unit, then each rank's whole update). Under ZeRO-1
and ZeRO-3 each matrix is updated by its one owner (docs/optimizers.md), so each rank runs
Newton-Schulz for about 1/dp of the matrices and holds 1/dp of Muon's momentum.

Per row: the median step seconds over `--steps` steps after one warm-up step, its ratio to the
baseline's at that dp, and the optimizer-state bytes of the fullest and the emptiest rank
(`job.memory()`, measured). The last rows run AdamW alone under the same strategies: Muon's
price in Piper. Every run starts from the same weights and batches; their first losses agree.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time

import torch

import piper
from examples.gpt import _corpus_tokens, batches, make_model

MUON = functools.partial(torch.optim.Muon, lr=0.02)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
ZERO = {"ddp": (), "zero1": ("optimizer",), "zero3": ("optimizer", "grads", "params")}


def strategy(level: str):
    @piper.strategy
    def plan(s):
        s.shard("batch", over="dp")
        if ZERO[level]:
            s.shard(*ZERO[level], over="dp")
    return plan


def run(model, data, level: str, dp: int, optimizer) -> dict:
    """One job: its first loss, median step seconds and optimizer-state bytes per rank."""
    with piper.compile(copy.deepcopy(model), data[0], strategy=strategy(level), mesh={"dp": dp},
                       optimizer=optimizer, progress=False) as job:
        first = job.step(*data[0])             # warm-up: the optimizer's state appears here
        seconds = []
        for batch in data[1:]:
            start = time.perf_counter()
            job.step(*batch)
            seconds.append(time.perf_counter() - start)
        held = [m["optimizer"] for m in job.memory().values()]
    return {"first_loss": first, "step_s": statistics.median(seconds), "state_max": max(held),
            "state_min": min(held)}


def measure(dps=(2, 4), steps: int = 5, n_layer: int = 4, n_embd: int = 64) -> list[dict]:
    model, _ = make_model(n_layer=n_layer, n_regions=n_layer, n_embd=n_embd, n_head=2, block_size=32)
    stream = batches(_corpus_tokens()[1], 16, 32, seed=1)
    data = [next(stream) for _ in range(steps + 1)]
    recipe = piper.per_group({"**.weight@2d": MUON, "*": ADAMW})
    rows = []
    for dp in dps:
        for name, optimizer in (("muon+adamw", recipe), ("adamw", ADAMW)):
            base = None
            for level in ZERO:
                row = {"dp": dp, "optimizer": name, "strategy": level, **run(model, data, level, dp, optimizer)}
                base = base or row
                row["vs_ddp"] = base["step_s"] / row["step_s"]          # > 1: faster than every rank stepping all
                row["state_vs_ddp"] = row["state_max"] / base["state_max"]
                rows.append(row)
                print(f"dp={dp} {name:11s} {level:6s} step {row['step_s'] * 1e3:8.1f} ms  "
                      f"x{row['vs_ddp']:.2f} of ddp's speed  state {row['state_max']:>9,} B max "
                      f"{row['state_min']:>9,} B min ({row['state_vs_ddp']:.2f} of ddp's)", flush=True)
    first = {r["first_loss"] for r in rows}
    assert max(first) - min(first) < 1e-4, f"the runs did not start alike: {sorted(first)}"
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = measure(tuple(args.dp), args.steps, args.layers, args.embd)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
