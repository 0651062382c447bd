"""Worker-read data against driver-shipped batches, at growing global batch sizes on dp=4.

The same job (the example GPT, block 64, plain data parallelism over 4 CPU
workers) trains from a token file twice per batch size: once with
`data=TokenFile(...)` and `job.step()` (each worker reads its own rows), once
with the driver slicing each global batch and shipping it (`job.step(x, y)`).
Per step it records the tokens/s, the driver's own CPU seconds (what the
driver spends cutting and sending batches: the part that does not scale with
the devices) and the bytes of batch data the driver sends (`job.sent_bytes`).

    python -m benchmarks.data_reading [--sizes 16,128] [--steps 6] [--out results.json]

On a shared 2-core machine tokens/s is noisy; the driver's seconds and bytes
are the point: they stay flat when the workers read.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch


def measure(sizes, steps: int, block: int = 64) -> list[dict]:
    import piper
    from examples.gpt import _corpus_tokens, make_model
    from piper.data import TokenFile, collate, positions

    tokens = _corpus_tokens()[1].numpy().astype(np.uint16)
    folder = tempfile.mkdtemp(prefix="piper-data-bench-")
    path = os.path.join(folder, "train.bin")
    np.tile(tokens, 8).tofile(path)          # enough blocks for the largest batches without wrapping much
    data = TokenFile(path, block)

    @piper.strategy
    def dp(s):
        s.shard("batch", over="dp")

    rows = []
    for batch_size in sizes:
        for mode in ("worker-read", "driver-shipped"):
            torch.manual_seed(0)
            model, _ = make_model(n_layer=2, n_regions=1, n_embd=64, n_head=4, block_size=block)
            batches = [collate(data, positions(k, batch_size, len(data), False, 0)) for k in range(steps + 1)]
            kw = dict(data=data, batch_size=batch_size) if mode == "worker-read" else {}
            with piper.compile(model, None if kw else batches[0], strategy=dp, mesh={"dp": 4}, **kw) as job:
                job.step() if kw else job.step(*batches[0])          # warm-up: the first step builds state
                wall = cpu = 0.0
                sent = 0
                for k in range(1, steps + 1):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    job.step() if kw else job.step(*batches[k])
                    wall += time.perf_counter() - start
                    cpu += time.process_time() - start_cpu
                    sent += job.sent_bytes
            rows.append({"batch": batch_size, "mode": mode, "tokens_per_s": batch_size * block * steps / wall,
                         "step_s": wall / steps, "driver_cpu_s": cpu / steps, "sent_bytes": sent // steps})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| batch | mode | tokens/s | step s | driver CPU s/step | bytes sent/step |",
           "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['mode']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
                   f"{r['driver_cpu_s']:.4f} | {r['sent_bytes']:,} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,128")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("PIPER_KEEP_WORKERS", "1")      # one set of workers for every job
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        rows = measure([int(s) for s in args.sizes.split(",")], args.steps)
    finally:
        from piper.runtime.launch import pool

        pool.release()
        ray.shutdown()
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
