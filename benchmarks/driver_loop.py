"""The driver off the step's path: Piper's `job.train` (the workers loop on their own data) against
`job.step` (a driver call per step), DDP as users run it (one process per rank, each looping over
its own shard of the same global batches), and, on one device, a plain eager loop.

    .venv/bin/python -m benchmarks.driver_loop                        # dp 2 and 4, and one device
    .venv/bin/python -m benchmarks.driver_loop --size tiny --rounds 1 --steps 2 --json out.json

Same GPT (`examples.gpt`, the same weights), the same global batches (the same token stream, in
order), AdamW; one microbatch per device. The systems alternate round by round (`--rounds`, each
`--steps` timed steps after one warm-up round); a system's step time is its round's wall-clock time
over its steps, the median over the rounds. Ratios are the other system's step time over Piper's
`job.train`'s: > 1 is Piper faster.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import socket
import statistics
import tempfile
import time

import numpy as np
import torch

import piper
import piper.data

SIZES = {     # model sizes, global batch (sequences), block
    "tiny": (dict(n_layer=2, n_embd=32, n_head=2), 8, 16),
    "small": (dict(n_layer=2, n_embd=64, n_head=2), 8, 32),
    "medium": (dict(n_layer=4, n_embd=128, n_head=4), 32, 64),
}
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)


def _model(size: str):
    from examples.gpt import make_model

    sizes, _, block = SIZES[size]
    return make_model(seed=0, n_regions=1, block_size=block, **sizes)[0]


def _token_file(folder: str, block: int) -> str:
    from examples.gpt import _corpus_tokens

    path = os.path.join(folder, "train.bin")
    _corpus_tokens()[1].numpy().astype(np.uint16).tofile(path)
    return path


# -- DDP, one process per rank ------------------------------------------------------------------

def _ddp_rank(rank: int, world: int, port: int, state: dict, size: str, path: str, rounds: list, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = _model(size)
    model.load_state_dict(state)
    ddp = DistributedDataParallel(model)
    opt = OPTIMIZER(model.parameters())
    _, batch, block = SIZES[size]
    data = piper.data.TokenFile(path, block)
    per = batch // world
    k = 0
    times, first = [], None
    for steps in rounds:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            rows = piper.data.positions(k, batch, len(data), False, 0)[rank * per:(rank + 1) * per]
            x, y = piper.data.collate(data, rows)
            opt.zero_grad(set_to_none=True)
            loss = ddp(x, y)
            loss.backward()
            opt.step()
            if first is None:                 # the global batch's mean loss, outside the timed rounds' use
                first = loss.detach().clone()
            k += 1
        dist.barrier()
        times.append(time.perf_counter() - start)
    dist.all_reduce(first)
    if rank == 0:
        out.put((times, float(first) / world))
    dist.destroy_process_group()


def ddp_rounds(world: int, state: dict, size: str, path: str, rounds: list) -> tuple[list[float], float]:
    """(each round's wall-clock seconds, the first step's loss), in one spawned process group."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_ddp_rank, args=(r, world, port, state, size, path, rounds, out)) for r in range(world)]
    for p in procs:
        p.start()
    times = out.get()
    for p in procs:
        p.join(timeout=60)
    return times


# -- one device, eager -------------------------------------------------------------------------

def eager_round(model, opt, data, size: str, first: int, steps: int, losses: list) -> float:
    _, batch, _ = SIZES[size]
    start = time.perf_counter()
    for k in range(first, first + steps):
        x, y = piper.data.collate(data, piper.data.positions(k, batch, len(data), False, 0))
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return time.perf_counter() - start


# -- the comparison ----------------------------------------------------------------------------

def compare(world: int, size: str, path: str, steps: int, rounds: int) -> dict:
    """Median seconds per step of Piper's train and step, and of DDP (or eager at world 1)."""
    model = _model(size)
    state = copy.deepcopy(model.state_dict())
    _, batch, block = SIZES[size]
    data = piper.data.TokenFile(path, block)
    strategy = "use dp() on dp\n" if world > 1 else None
    mesh = {"dp": world} if world > 1 else None
    plan = [steps] * (rounds + 1)            # the first round warms up
    times, first = {"train": [], "step": []}, {}
    with piper.compile(copy.deepcopy(model), None, strategy=strategy, mesh=mesh, optimizer=OPTIMIZER,
                       data=data, batch_size=batch, progress=False) as job:
        for n in plan:
            start = time.perf_counter()
            metrics = job.train(n)
            times["train"].append(time.perf_counter() - start)
            first.setdefault("piper", metrics[0]["loss"])
            start = time.perf_counter()
            for _ in range(n):
                job.step()
            times["step"].append(time.perf_counter() - start)
    if world > 1:
        times["torch"], first["torch"] = ddp_rounds(world, state, size, path, plan)
    else:
        torch.set_num_threads(1)
        opt, losses = OPTIMIZER(model.parameters()), []
        times["torch"] = [eager_round(model, opt, data, size, i * steps, n, losses) for i, n in enumerate(plan)]
        first["torch"] = float(losses[0])
    # The same weights and batches on both sides, or the times compare different work.
    if abs(first["piper"] - first["torch"]) > 1e-5 * abs(first["torch"]):
        raise RuntimeError(f"the first losses differ: Piper {first['piper']}, torch {first['torch']}")
    per = {name: statistics.median(t[1:]) / steps for name, t in times.items()}
    return {"devices": world, "size": size, "torch": "DDP (spawned ranks)" if world > 1 else "eager loop",
            "torch_ms": per["torch"] * 1e3, "piper_train_ms": per["train"] * 1e3, "piper_step_ms": per["step"] * 1e3,
            "ratio_torch_over_train": per["torch"] / per["train"], "ratio_step_over_train": per["step"] / per["train"],
            "first_loss": first}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model size (default: medium for dp, small for one device)")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = _token_file(folder, max(b for _, _, b in SIZES.values()))
        owns = not ray.is_initialized()
        if owns:
            ray.init(num_cpus=max(args.devices) + 1, include_dashboard=False, log_to_driver=False)
        try:
            for world in args.devices:
                size = args.size or ("medium" if world > 1 else "small")
                rows.append(compare(world, size, path, args.steps, args.rounds))
                r = rows[-1]
                print(f"{world} device(s), {size}: {r['torch']} {r['torch_ms']:.1f} ms, Piper train "
                      f"{r['piper_train_ms']:.1f} ms, step {r['piper_step_ms']:.1f} ms; torch/train "
                      f"{r['ratio_torch_over_train']:.2f}x, step/train {r['ratio_step_over_train']:.2f}x", flush=True)
        finally:
            if owns:
                ray.shutdown()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
