"""Host time of DTensor's dispatch against Piper's local tensors, on one device (tp=1).

    .venv/bin/python -m benchmarks.tp_dispatch                   # cuda where there is a GPU, else cpu
    .venv/bin/python -m benchmarks.tp_dispatch --device cuda --json out.json

torch's tensor parallelism (`parallelize_module`) makes every parameter a DTensor, so every op of
the step goes through DTensor's dispatch (sharding propagation, its cache, wrapping); Piper's
workers run plain local tensors with the collectives as plan actions. At tp=1 neither side moves a
byte, so against eager torch on the same model, weights and batches what is left is host time:
DTensor's per-op dispatch on torch's side, Ray's call and the plan's bookkeeping on Piper's. Two
sizes: a small model whose GPU step is bound by the host, and a larger one bound by its kernels.

The three run in the same process tree, alternated round by round (each round `--steps` steps
of each, after one warm-up round); a step is timed to its loss on the host (`.item()`, which
waits for the device; Piper's `job.step` returns the loss the same way). Every system starts
from the same weights and sees the same batches: their first losses must agree.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist

import piper
from examples import llama_tp

from .baselines.tensor_parallel import plan as torch_plan
from .suites.tensor_parallel import plan_text

SIZES = {       # (model sizes, batch, sequence)
    "tiny": (dict(vocab=64, dim=32, heads=4, kv_heads=2, hidden=64, layers=2), 2, 8),     # the test's
    "small": (dict(vocab=1024, dim=256, heads=8, kv_heads=4, hidden=768, layers=4), 8, 64),
    "large": (dict(vocab=32000, dim=1024, heads=16, kv_heads=8, hidden=2816, layers=8), 8, 1024),
}
ADAMW = dict(lr=1e-4)


def _trainer(model, device, context=contextlib.nullcontext):
    """(one step of AdamW on `model`, nothing to close); forward and backward run in `context()`."""
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(idx, tgt):
        opt.zero_grad(set_to_none=True)
        with context():
            loss = model(idx.to(device), tgt.to(device))
            loss.backward()
        opt.step()
        return loss.item()
    return step, lambda: None


def eager(model, device):
    return _trainer(model.to(device), device)


def dtensor(model, device):
    """`parallelize_module` with suite 16's plan (torchtitan's, with SP) on a mesh of one device,
    the loss under `loss_parallel()`: every op dispatched through DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    return _trainer(parallelize_module(model.to(device), mesh, torch_plan(model, sequence=True)), device,
                    loss_parallel)


def with_piper(model, device, example):
    from piper.dsl import load_strategy

    job = piper.compile(model, example, strategy=load_strategy(plan_text({"tp": 1})), mesh={"tp": 1},
                        device=device.type, progress=False,
                        optimizer=lambda params: torch.optim.AdamW(params, **ADAMW))
    return job.step, job.close


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """The default process group of this one process (torch's TP needs one to build its mesh)."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(size: str, device: torch.device, steps: int, rounds: int) -> dict:
    """The three systems' median step on model `size`, in `one_rank_group` with Ray started."""
    sizes, batch, seq = SIZES[size]
    model = llama_tp.make_model(torch.float32, stages=1, **sizes)
    data = llama_tp.batches(count=4, batch=batch, seq=seq, vocab=sizes["vocab"])
    systems = {"eager": eager(copy.deepcopy(model), device),
               "torch TP (DTensor)": dtensor(copy.deepcopy(model), device),
               "Piper TP": with_piper(copy.deepcopy(model), device, data[0])}
    times = {name: [] for name in systems}
    first = {}
    try:
        for r in range(rounds + 1):
            for name, (step, _) in systems.items():
                for k in range(steps):
                    idx, tgt = data[k % len(data)]
                    begin = time.perf_counter()
                    loss = step(idx, tgt)
                    if r:
                        times[name].append(time.perf_counter() - begin)
                    elif k == 0:
                        first[name] = loss
    finally:
        for _, close in systems.values():
            close()
    base = first["eager"]
    if any(abs(v - base) > 1e-3 * abs(base) for v in first.values()):
        raise SystemExit(f"first losses differ: {first}")
    median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {"size": size, "model": f"{sizes}, batch {batch} x seq {seq}, float32", "median_ms": median,
            "first_loss": first, "eager_over": {n: median["eager"] / m for n, m in median.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--sizes", default="small,large", help=f"of {', '.join(SIZES)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda:0" if kind == "cuda" else "cpu")
    if kind == "cpu":
        torch.set_num_threads(1)          # what a Piper CPU device (one process, one core) runs with
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    results = []
    try:
        with one_rank_group(device):
            for size in args.sizes.split(","):
                results.append(measure(size, device, args.steps, args.rounds))
                row = results[-1]
                print(f"{size}: {row['model']}")
                for name, ms_ in row["median_ms"].items():
                    print(f"  {name:20s} {ms_:9.2f} ms/step   eager/this {row['eager_over'][name]:.3f}x")
    finally:
        ray.shutdown()
    name = torch.cuda.get_device_name(0) if kind == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "steps": args.steps, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
