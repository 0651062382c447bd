"""transformers' own expert parallelism, the baseline of suite 15: the same Qwen3-MoE, saved and loaded
with `from_pretrained(..., distributed_config=DistributedConfig(ep_size=N, fsdp_size=N))` (its experts
divided over N ranks, the rest sharded by FSDP2), trained with AdamW on N Gloo processes, each taking its
1/N of every global batch, as Piper's dp=N does.

    python -m benchmarks.baselines.hf_own_ep        # a self-check on a tiny model: prints step times

Needs `accelerate` (transformers asks for it to place a distributed model): the `bench` extra.
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, path: str, batches, warmup: int, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)           # as Piper's workers (Ray sets OMP_NUM_THREADS=1)
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        import transformers
        from transformers.distributed import DistributedConfig

        model = transformers.Qwen3MoeForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(ep_size=world, fsdp_size=world))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        experts = 0
        for name, p in model.named_parameters():
            if ".experts." in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                experts += local.numel() * local.element_size()
        times, losses = [], []
        for i, (x, y) in enumerate(batches):
            per = x.shape[0] // world
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            start = time.perf_counter()
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - start)
            mean = loss.detach().clone()          # over the global batch, as Piper's job.step reports it
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        if rank == 0:
            out.put({"step_s": statistics.median(times), "expert_bytes": experts, "losses": losses})
    except Exception as exc:           # the suite reports it as the row's failure
        if rank == 0:
            out.put({"error": f"{type(exc).__name__}: {exc}"[:300]})
        raise
    finally:
        dist.destroy_process_group()


def measure(model, batches, *, world: int = 2, warmup: int = 2) -> dict:
    """Median step seconds, rank 0's expert bytes and its losses of transformers' own EP on `model`
    (a Qwen3MoeForCausalLM, its weights saved and loaded again), or {"error": why}."""
    import torch.multiprocessing as mp

    try:
        import accelerate  # noqa: F401
    except ImportError:
        return {"error": "needs `accelerate` (pip install -e '.[bench]')"}
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        try:
            mp.start_processes(_rank, args=(world, _free_port(), path, batches, warmup, out), nprocs=world,
                               start_method="spawn")
        except Exception as exc:       # a rank's own error was put on the queue first
            return out.get(timeout=5) if not out.empty() else {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return out.get(timeout=60)


if __name__ == "__main__":
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2)
    t = torch.randint(0, 64, (4, 9))
    print(measure(transformers.Qwen3MoeForCausalLM(cfg), [(t[:, :-1].contiguous(), t[:, 1:].contiguous())] * 5))
