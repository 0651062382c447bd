"""Model FLOPs utilisation: the model's own arithmetic per second against what the devices can do.

    per_token = flops_per_item(job.program)          # forward + backward matmul FLOPs per token (or sample)
    peak = peak_flops(job.device, override=None)     # one device's, FLOP/s
    mfu = per_token * tokens_per_s / (peak * job.mesh.world_size)

The model's FLOPs are counted from the captured graph, as PaLM's MFU counts them: the matrix products
only (linear, mm, bmm, matmul, addmm, baddbmm, scaled-dot-product attention at full length), 2 FLOPs
per multiply-add, and the backward twice the forward. What a strategy adds (recomputation, ZeRO's
gathers) is not the model's and does not count, so MFU compares strategies fairly.

A device's peak comes from `--peak-flops`, else a table of known accelerators (dense bf16, as vendors
state it), else, on CPU, a short float32 GEMM measured here on one thread (Ray gives each worker one).
"""
from __future__ import annotations

import math
import time

# Dense bf16 tensor-core peaks in FLOP/s, by a piece of torch.cuda.get_device_name (first match wins).
PEAKS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
         ("A100", 312e12), ("A10G", 70e12), ("A10", 125e12), ("L40S", 362e12), ("L4", 121e12),
         ("V100", 125e12), ("MI300X", 1307e12), ("MI250X", 383e12))

_MATMULS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "scaled_dot_product_attention"}


def _shape(node) -> tuple[int, ...] | None:
    value = getattr(node, "meta", {}).get("val") if hasattr(node, "meta") else None
    return tuple(int(d) for d in value.shape) if hasattr(value, "shape") else None


def node_flops(node) -> int:
    """Forward FLOPs of one fx node (0 for anything but a matrix product)."""
    name = str(getattr(node.target, "__name__", node.target)).split(".")[0]
    if node.op != "call_function" or name not in _MATMULS:
        return 0
    shapes = [_shape(a) for a in node.args[:3]]
    if any(s is None for s in shapes[:2]) or not shapes[0] or not shapes[1]:
        return 0
    a, b = shapes[0], shapes[1]
    if name == "linear":                         # x (..., K) @ W (N, K)^T
        return 2 * math.prod(a) * b[0]
    if name in ("addmm", "baddbmm"):             # bias + a @ b
        a, b = shapes[1], shapes[2] if len(shapes) > 2 and shapes[2] else None
        if b is None:
            return 0
    if name == "scaled_dot_product_attention":   # q (..., L, E), k (..., S, E), v (..., S, Ev)
        v = shapes[2] if len(shapes) > 2 and shapes[2] else b
        lead = math.prod(a[:-2])
        return 2 * lead * a[-2] * b[-2] * (a[-1] + v[-1])
    if len(a) < 2 or len(b) < 1:
        return 0
    out = _shape(node)                           # a (..., M, K) @ b (..., K, N): 2 * output * K
    return 2 * (math.prod(out) if out else 0) * a[-1]


def flops_per_item(program) -> float:
    """Training FLOPs (forward and backward: 3x the forward's matrix products) per token of the captured
    batch when its first input holds token ids, else per sample; 0.0 when nothing was captured."""
    forward = sum(node_flops(n) for region in program.regions if region.graph is not None
                  for n in region.graph.graph.nodes)
    first = program.batch[0] if program.batch else None
    shape = tuple(getattr(first, "shape", ()) or ())
    dtype = str(getattr(first, "dtype", ""))
    tokens = math.prod(shape) if len(shape) >= 2 and "int" in dtype else (shape[0] if shape else 1)
    return 3.0 * forward / max(tokens, 1)


def peak_flops(device: str, override: float | None = None) -> tuple[float, str]:
    """One device's peak FLOP/s and where it comes from ("--peak-flops", the accelerator's name, or
    "a float32 GEMM on one CPU thread")."""
    if override:
        return float(override), "--peak-flops"
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            for piece, peak in PEAKS:
                if piece in name:
                    return peak, name
    return measured_cpu_peak(), "a float32 GEMM on one CPU thread"


_measured: float | None = None


def measured_cpu_peak(size: int = 256, seconds: float = 0.2) -> float:
    """FLOP/s of a float32 matrix product on one thread (a Gloo worker's share), measured once."""
    global _measured
    if _measured is None:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            a, b = torch.randn(size, size), torch.randn(size, size)
            torch.mm(a, b)                       # warm up
            done, began = 0, time.perf_counter()
            while time.perf_counter() - began < seconds:
                torch.mm(a, b)
                done += 1
            _measured = 2 * size ** 3 * done / (time.perf_counter() - began)
        finally:
            torch.set_num_threads(threads)
    return _measured
