"""Before any worker starts: the memory the workers will hold (the memory model's prediction,
`piper/compiler/memory_model.py`) against what the Ray cluster's nodes have.

    check_memory(job, optimizer, ray.nodes())     # raises not-enough-memory, or returns the prediction

On CPU devices every worker is a process on some node, so the workers' sum must fit in the nodes'
memory, and the largest worker in the largest node. A node's memory is what Ray gives it (its
`memory` resource plus its object store), or this machine's MemTotal when the node is this one and
that is more (Ray counts only what was free when it started). The prediction counts parameters,
gradients, optimizer state and ZeRO gathers (`predict_memory` without activations, so nothing runs
here): a lower bound, so the error is never a false alarm; activations come on top.
GPU memory is not checked here (Ray does not report it).
"""
from __future__ import annotations

import os

from ..diagnostics import error


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (/proc/meminfo's MemTotal; psutil where installed), or None."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def node_memory(nodes, local_ip: str | None = None) -> list[int]:
    """The bytes each alive Ray node has for workers (see the module's docstring)."""
    here = machine_memory()
    out = []
    for node in nodes:
        if not node.get("Alive", True):
            continue
        res = node.get("Resources", {})
        have = int(res.get("memory", 0) + res.get("object_store_memory", 0))
        if here and local_ip and node.get("NodeManagerAddress") == local_ip:
            have = max(have, here)
        out.append(have)
    return out


def predicted_bytes(job, optimizer) -> dict[int, int]:
    """Per rank, the bytes of parameters, gradients and optimizer state at the step's peak (no activations)."""
    from ..compiler.memory_model import predict_memory

    saved = {r.index: 0 for r in job.program.regions}
    predicted = predict_memory(job.compiled, job.program, optimizer=optimizer, saved=saved,
                               precision=job.training.dtype, lanes=False)
    return {rank: p.peak for rank, p in predicted.items()}


def check_memory(job, optimizer, nodes, local_ip: str | None = None) -> dict[int, int]:
    """Raise `not-enough-memory` when the workers' predicted memory cannot fit in the cluster's nodes
    (CPU devices); return the per-rank prediction ({} when nothing was checked: CUDA devices, or a
    plan the memory model cannot replay)."""
    from ..compiler.memory_model import format_bytes

    if job.device != "cpu":
        return {}
    try:
        wanted = predicted_bytes(job, optimizer)
    except Exception:        # noqa: BLE001 - the check advises; a model it cannot predict still trains
        return {}
    have = [m for m in node_memory(nodes, local_ip) if m > 0]
    if not have:
        return wanted
    total, biggest = sum(wanted.values()), max(wanted.values())
    rank = max(wanted, key=wanted.get)
    fix = ("shard more (ZeRO-3: `use zero3() on dp`, or a longer pipeline), use a smaller model or an optimizer "
           "with less state (SGD keeps none, AdamW two values per parameter), or add nodes to the Ray cluster")
    if total > sum(have):
        raise error("not-enough-memory", f"the {len(wanted)} workers need at least {format_bytes(total)} "
                    f"(parameters, gradients and optimizer state; the largest, rank {rank}, "
                    f"{format_bytes(biggest)}), and the cluster's {len(have)} node(s) have "
                    f"{format_bytes(sum(have))}", notes=(
                        "the memory model's prediction without activations (piper.compiler.memory_model), "
                        "so the workers would need more still",), hint=fix)
    if biggest > max(have):
        raise error("not-enough-memory", f"rank {rank} needs at least {format_bytes(biggest)} (parameters, "
                    f"gradients and optimizer state), more than the largest node has ({format_bytes(max(have))})",
                    notes=("the memory model's prediction without activations (piper.compiler.memory_model)",),
                    hint=fix)
    return wanted


def local_address() -> str | None:
    """This machine's address as Ray names its node, when Ray is up."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:      # noqa: BLE001 - no Ray, or not connected: the node is not known
        return os.environ.get("RAY_NODE_IP_ADDRESS")
