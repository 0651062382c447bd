"""What the training options do to a step's costs, for the simulator (`piper.compiler.simulate`).

- `recompute` regions run their forward again in their first backward pass
  (B, or BI under a split backward): `recompute_costs` makes that pass dearer
  by the region's forward.
- `precision="bf16"`/`"fp16"`: ZeRO-3 gathers its parameters in 16 bits and
  activations (and their gradients) travel between stages in 16 bits; gradient
  reductions and ZeRO-1/2's gathers of updated shards stay in float32
  (`piper/runtime/state/precision.py`). `comm_bytes` gives the bytes each
  communication moves; `comm_cost` prices them over a throughput.

    costs = recompute_costs(compiled, {"F": 1.0, "B": 2.0})   # 0B3 of a recomputed region: 3.0
    sim = simulate(plans, costs=costs, comm_cost=comm_cost(compiled, program, bandwidth=1e9,
                                                           precision="bf16"))
"""
from __future__ import annotations

import torch

from .simulate import UNIT_COSTS

RERUN_PASSES = ("B", "BI")        # where the runtime reruns a recomputed forward (runtime/autograd/recompute.py)


def recompute_costs(compiled, costs: dict | None = None, *, measured=None) -> dict:
    """`costs` (pass or action key -> seconds) with each recomputed region's B or BI made dearer
    by its forward, as per-key entries.

    A key `costs` already names (a measured action, `job.timings()`: its time holds the rerun)
    is kept as it is; `measured` names those keys instead, when `costs` holds estimates per
    key (`piper tune`: pass `measured=()`). Without `recompute`, `costs` comes back unchanged.

        recompute PP=1, costs F=1 B=2:  1B0 -> 3, 0B0 -> 2 (from the pass), 1BI0 -> 1 + 1
    """
    costs = dict(costs or {})
    chosen = set(compiled.ir.recompute)
    if not chosen:
        return costs
    base = {**UNIT_COSTS, **costs}
    measured = set(costs) if measured is None else set(measured)
    for node in compiled.ir.nodes:
        if node.op not in RERUN_PASSES or node.region not in chosen or node.key in measured:
            continue
        forward = node.but(op="F").key
        own = base.get(node.key, base.get(node.op, 1.0))
        costs[node.key] = own + base.get(forward, base.get("F", 1.0))
    return costs


def comm_bytes(node, *, unit_bytes: int, value_bytes: int = 0, unit_dtype=torch.float32,
               value_dtype=None, precision=None) -> float:
    """Bytes one device sends for `node` (a SEND, RECV or collective).

    `unit_bytes`: the node's unit in its master dtype `unit_dtype` (collectives);
    `value_bytes`: the activation or gradient sent, in `value_dtype` (SEND/RECV).
    Under a 16-bit `precision` a ZeRO-3 gather (ALL_GATHER of a pass) and floating-point
    activations move 16-bit elements; reductions and ZeRO-1/2's gather of updated shards
    move the float32 masters. Ring collectives over n devices: an all-reduce moves
    2(n-1)/n of the unit, a reduce-scatter or all-gather (n-1)/n.
    """
    from .memory_model import compute_dtype, element_size, torch_dtype

    dtype = compute_dtype(precision)
    unit_dtype, value_dtype = torch_dtype(unit_dtype), torch_dtype(value_dtype)
    if node.op in ("SEND", "RECV"):
        if dtype is not None and value_dtype is not None and value_dtype.is_floating_point:
            return value_bytes * element_size(dtype) / element_size(value_dtype)
        return float(value_bytes)
    if node.op == "ALL_TO_ALL":      # tokens of a MoE layer: not priced here (measured by job.timings())
        return 0.0
    n = len(node.devices or ()) or 1
    size = float(unit_bytes)
    if node.op == "ALL_GATHER" and node.phase and dtype is not None and unit_dtype.is_floating_point:
        size = size * element_size(dtype) / element_size(unit_dtype)
    return size * (2 * (n - 1) / n if node.op == "ALL_REDUCE" else (n - 1) / n)


def comm_cost(compiled, program, *, bandwidth: float, precision=None, value_scale: float = 1.0):
    """`simulate`'s `comm_cost(node)`: `comm_bytes` over `bandwidth` bytes per second.

    `value_scale` scales the program's activation sizes (a program captured at another
    microbatch size)."""
    owned = {r.index: (sum(program.params[p].nbytes for p in r.owned),
                       next((program.params[p].dtype for p in r.owned), torch.float32))
             for r in compiled.ir.regions}
    values = {(v.producer, v.index): (v.spec.nbytes * value_scale, v.spec.dtype) for v in program.values}
    from ..frontend.tensor_traffic import exchange_bytes, traffic

    tensor = traffic(program)      # (region, F | B) -> (bytes, collectives) of its TP collectives
    per_op = exchange_bytes(program)
    tp_index = _tp_ordinals(compiled.order) if per_op else {}

    def cost(node) -> float:
        if node.op == "TP":
            phase = 0 if node.phase == "F" else 1
            if node.value is not None:        # one exchange of a pass cut at its TP collectives
                moves = per_op.get(node.region, ())
                i = tp_index.get((node.region, node.value))
                size = moves[i][phase] if i is not None and i < len(moves) else None
                return (size or 0.0) * value_scale / bandwidth
            size, _ = tensor.get((node.region, "FB"[phase]), (0.0, 0))
            return size * value_scale / bandwidth
        if node.op in ("SEND", "RECV"):
            producer = node.region if (node.op == "SEND") == (node.phase == "F") else node.peer
            size, dtype = values.get((producer, node.value), (0.0, None))
            return comm_bytes(node, unit_bytes=0, value_bytes=size, value_dtype=dtype,
                              precision=precision) / bandwidth
        size, dtype = owned.get(node.region, (0, torch.float32))
        return comm_bytes(node, unit_bytes=size, unit_dtype=dtype, precision=precision) / bandwidth

    return cost


def _tp_ordinals(order) -> dict[tuple[int, int], int]:
    """(region, exchange k) -> which of the region's TP ops exchange k is (a pass cut at its
    all-to-alls and its TP collectives numbers both)."""
    ops: dict[int, dict[int, str]] = {}
    for n in order:
        if n.value is not None and n.op in ("TP", "ALL_TO_ALL") and n.phase == "F":
            ops.setdefault(n.region, {})[n.value] = n.op
    out = {}
    for region, by_k in ops.items():
        i = 0
        for k in sorted(by_k):
            if by_k[k] == "TP":
                out[(region, k)] = i
                i += 1
    return out
