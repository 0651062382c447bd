"""The MoE cut: a region graph with MoE layers, cut at its all-to-alls into pieces
that a plan schedules one by one, with the exchanges between them as actions.

A captured region holds each MoE layer as `piper::moe_dispatch` ... `piper::expert_mm`
... `piper::moe_combine` nodes. Under `shard experts` those two nodes move tokens
between devices. `cut` rewrites each into its local halves and an exchange:

    dispatch(x, experts)  ->  sort (local)   | exchange "dispatch" |  regroup (local)
    combine(y, gates, h)  ->  unregroup      | exchange "combine"  |  home (weighted sum)

and splits the graph at the exchanges, in graph order: piece 0 runs up to the
first layer's sort, piece 1 from its regroup through the experts to its
unregroup, piece 2 from its home to the next layer's sort, and so on. A region
with L layers has 2L exchanges and 2L + 1 pieces. Every value a piece reads from
an earlier piece or exchange is one of its inputs (a `Source`), so the runtime
can run, and differentiate, each piece on its own, and issue the exchanges
itself (`piper.runtime.moe.pieces`).

`piper.ir.region_cut` walks the graph and calls `cut_dispatch` / `cut_combine` for each
layer (the same walk cuts at TP collectives); the driver cuts too, to count the pieces
the plan must hold (`region_cut.exchange_ops`).
"""
from __future__ import annotations

import torch

from .cut_parts import Source

DISPATCH = "dispatch"        # rows to their experts' devices (counts exchanged first)
COMBINE = "combine"          # the experts' results back home


# -- the local halves (plain differentiable torch: autograd does their backward) -------------------------

def sort_tokens(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Token copies sorted by expert: (rows, counts per global expert, the order they were taken in)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return x.index_select(0, order // experts.shape[-1]), torch.bincount(flat, minlength=num_experts), order


def regroup_rows(received: torch.Tensor, recv_counts: torch.Tensor, size: int):
    """Rows received grouped by source then expert -> grouped by local expert (stable):
    (rows, counts per local expert, the permutation)."""
    local = recv_counts.numel() // size
    expert_of_row = torch.arange(local, device=received.device).repeat(size).repeat_interleave(recv_counts)
    regroup = torch.argsort(expert_of_row, stable=True)
    return received.index_select(0, regroup), recv_counts.view(size, local).sum(0), regroup


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def unregroup_rows(y: torch.Tensor, regroup: torch.Tensor) -> torch.Tensor:
    """The experts' results back in the order the rows arrived (the inverse of `regroup_rows`)."""
    return y.index_select(0, _inverse(regroup))


def home_rows(rows: torch.Tensor, gates: torch.Tensor, order: torch.Tensor):
    """Rows back home in sorted order -> `sum_k gates[t, k] * row(t, k)`: (out, rows in token order)."""
    tokens, top_k = gates.shape
    flat = rows.index_select(0, _inverse(order))
    out = (flat.view(tokens, top_k, -1) * gates.to(flat.dtype).unsqueeze(-1)).sum(1)
    return out, flat


# -- the cut (`piper.ir.region_cut` walks the graph; these make a layer's halves and exchange) ----------

def cut_dispatch(b, env, node, size: int) -> tuple:
    """A dispatch: sort (local) | exchange | regroup (local); what its getitems read."""
    x, experts, num_experts = node.args
    sorted_ = b.call(sort_tokens, (b.use(env[x]), b.use(env[experts]), num_experts))
    rows, counts, order = (b.item(sorted_, i) for i in range(3))
    k = b.exchange(DISPATCH, (rows, counts))
    received, recv_counts = Source("exchange", k, 0), Source("exchange", k, 1)
    grouped = b.call(regroup_rows, (b.use(received), b.use(recv_counts), size))
    routed, local_counts, regroup = (b.item(grouped, i) for i in range(3))
    return (routed, local_counts, order, regroup, Source("exchange", k, 2), Source("exchange", k, 3))


def cut_combine(b, env, node) -> tuple:
    """A combine: unregroup (local) | exchange | home (the weighted sum, local)."""
    y, gates, order, regroup, send_splits, recv_splits = node.args
    back = b.call(unregroup_rows, (b.use(env[y]), b.use(env[regroup])))
    k = b.exchange(COMBINE, (back, env[send_splits], env[recv_splits]))
    home = b.call(home_rows, (b.use(Source("exchange", k, 0)), b.use(env[gates]), b.use(env[order])))
    return (b.item(home, 0), b.item(home, 1))
