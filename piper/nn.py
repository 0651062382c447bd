"""Layers Piper knows how to divide: `MoE`, a dropless mixture of experts, and
the three primitives it is built on, which a user can call to write their own.

    routed, counts, handle = piper.nn.dispatch(x, experts, num_experts)   # tokens grouped by expert
    y = piper.nn.expert_mm(routed, counts, w)                              # each group times its expert
    out = piper.nn.combine(y, gates, handle)                               # back to token order, weighted

Each primitive is one `torch.library` custom op (`piper::moe_dispatch`,
`piper::expert_mm`, `piper::moe_combine`), so capture (strict `torch.export`
on the meta device) records it as a single node with a static shape. What the
node means is decided when it runs:

- on one device (plain PyTorch, or the experts replicated under `dp`/ZeRO) it
  is a local permutation: dispatch sorts the token copies by expert, combine
  puts them back and sums them with their gates;
- under `shard experts over AXIS` the runtime installs an expert group
  (`piper.runtime.moe.expert_groups`) and the same nodes move tokens: dispatch exchanges
  the per-expert counts, then sends each token copy to the device holding its
  expert with an uneven `all_to_all_single`; combine sends the results back
  the same way. Their backwards run the reverse all-to-alls.

All routing state of one call lives in its `DispatchHandle` (plain tensors),
never on a module, so two microbatches can be in flight at once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .diagnostics import error

__all__ = ["MoE", "SwiGLU", "DispatchHandle", "dispatch", "combine", "expert_mm", "expert_bias"]


def _context():
    """The expert group of the calling thread's lane, or None (local meaning)."""
    from .expert_context import current

    return current()


# -- dispatch ------------------------------------------------------------------------------------------

@torch.library.custom_op("piper::moe_dispatch", mutates_args=())
def _dispatch(x: Tensor, experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    flat = experts.reshape(-1)
    top_k = experts.shape[-1]
    order = torch.argsort(flat, stable=True)
    sorted_tokens = x.index_select(0, order // top_k)
    counts = torch.bincount(flat, minlength=num_experts)
    group = _context()
    if group is None or group.size == 1:
        n = flat.numel()
        whole = torch.tensor([n], dtype=torch.int64, device=x.device)
        return sorted_tokens, counts, order, torch.arange(n, device=x.device), whole, whole.clone()
    size = group.size
    assert num_experts % size == 0, "the compiler checks that experts divide over the axis"
    local = num_experts // size
    # Counts first: each device learns how many rows every other one sends it, per local expert.
    recv_counts = group.exchange_counts(counts)                   # [size * local]: (source, local expert)
    send_splits = counts.view(size, local).sum(1)
    recv_splits = recv_counts.view(size, local).sum(1)
    received = group.all_to_all(sorted_tokens, recv_splits, send_splits)
    # Rows arrive grouped by source, then expert; group them by expert (stable: by source within).
    expert_of_row = torch.arange(local, device=x.device).repeat(size).repeat_interleave(recv_counts)
    regroup = torch.argsort(expert_of_row, stable=True)
    return (received.index_select(0, regroup), recv_counts.view(size, local).sum(0), order, regroup,
            send_splits, recv_splits)


@_dispatch.register_fake
def _(x, experts, num_experts):
    n = experts.numel()
    index = experts.new_empty(n, dtype=torch.int64)
    return (x.new_empty(n, x.shape[-1]), experts.new_empty(num_experts, dtype=torch.int64), index,
            index.clone(), experts.new_empty(1, dtype=torch.int64), experts.new_empty(1, dtype=torch.int64))


def _return_home(rows: Tensor, regroup: Tensor, send_splits: Tensor, recv_splits: Tensor) -> Tensor:
    """Rows in expert order on this device -> rows in the senders' sorted order on theirs."""
    if send_splits.numel() == 1:
        return rows
    back = torch.empty_like(rows)
    back[regroup] = rows
    return _context().all_to_all(back, send_splits, recv_splits)


def _go_out(rows: Tensor, regroup: Tensor, send_splits: Tensor, recv_splits: Tensor) -> Tensor:
    """The forward direction of `_return_home`: sorted rows here -> expert order on the experts' devices."""
    if send_splits.numel() == 1:
        return rows
    return _context().all_to_all(rows, recv_splits, send_splits).index_select(0, regroup)


def _dispatch_setup(ctx, inputs, output):
    x, experts, _ = inputs
    _, _, order, regroup, send_splits, recv_splits = output
    ctx.tokens, ctx.top_k = x.shape[0], experts.shape[-1]
    ctx.save_for_backward(order, regroup, send_splits, recv_splits)


def _dispatch_backward(ctx, grad_routed, *_):
    order, regroup, send_splits, recv_splits = ctx.saved_tensors
    back = _return_home(grad_routed.contiguous(), regroup, send_splits, recv_splits)
    flat = back.new_zeros(ctx.tokens * ctx.top_k, back.shape[-1])
    flat[order] = back
    return flat.view(ctx.tokens, ctx.top_k, -1).sum(1), None, None


_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# -- combine -------------------------------------------------------------------------------------------

@torch.library.custom_op("piper::moe_combine", mutates_args=())
def _combine(y: Tensor, gates: Tensor, order: Tensor, regroup: Tensor, send_splits: Tensor,
             recv_splits: Tensor) -> tuple[Tensor, Tensor]:
    back = _return_home(y.contiguous(), regroup, send_splits, recv_splits)
    tokens, top_k = gates.shape
    flat = back.new_empty(tokens * top_k, back.shape[-1])
    flat[order] = back
    out = (flat.view(tokens, top_k, -1) * gates.to(flat.dtype).unsqueeze(-1)).sum(1)
    return out, flat


@_combine.register_fake
def _(y, gates, order, regroup, send_splits, recv_splits):
    tokens, top_k = gates.shape
    return y.new_empty(tokens, y.shape[-1]), y.new_empty(tokens * top_k, y.shape[-1])


def _combine_setup(ctx, inputs, output):
    _, gates, order, regroup, send_splits, recv_splits = inputs
    ctx.save_for_backward(gates, order, regroup, send_splits, recv_splits, output[1])


def _combine_backward(ctx, grad_out, _grad_flat):
    gates, order, regroup, send_splits, recv_splits, flat = ctx.saved_tensors
    tokens, top_k = gates.shape
    rows = flat.view(tokens, top_k, -1)
    grad_gates = (rows * grad_out.unsqueeze(1)).sum(-1).to(gates.dtype)
    grad_flat = (gates.to(grad_out.dtype).unsqueeze(-1) * grad_out.unsqueeze(1)).reshape(tokens * top_k, -1)
    grad_y = _go_out(grad_flat.index_select(0, order), regroup, send_splits, recv_splits)
    return grad_y, grad_gates, None, None, None, None


_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# -- grouped matmul ------------------------------------------------------------------------------------

def _local_weight(w: Tensor, groups: int) -> Tensor:
    """This device's experts of `w`: all of it, or its slice when the experts are replicated under EP."""
    if w.shape[0] == groups:
        return w
    group = _context()
    assert group is not None and w.shape[0] == groups * group.size, (w.shape, groups)
    return w[group.index * groups:(group.index + 1) * groups]


def _grouped(x: Tensor, sizes: list[int], w: Tensor) -> Tensor:
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, n in enumerate(sizes):
        if n:
            torch.mm(x[start:start + n], w[e], out=out[start:start + n])
        start += n
    return out


def _in_out(w: Tensor, transposed: bool) -> Tensor:
    """`w` as `[experts, in, out]`: a view of an `[experts, out, in]` weight when `transposed`."""
    return w.transpose(1, 2) if transposed else w


def _scatter_home(grad_local: Tensor, w: Tensor, groups: int) -> Tensor:
    """The gradient of the whole of `w` from this device's experts' part of it."""
    grad_local = grad_local.to(w.dtype)
    if grad_local.shape[0] == w.shape[0]:
        return grad_local
    grad_w = torch.zeros_like(w)        # replicated experts: the other devices' slices get theirs there
    group = _context()
    grad_w[group.index * groups:(group.index + 1) * groups] = grad_local
    return grad_w


@torch.library.custom_op("piper::expert_mm", mutates_args=())
def _expert_mm(x: Tensor, counts: Tensor, w: Tensor, transposed: bool = False) -> Tensor:
    # In the rows' dtype: under 16-bit compute the expert rows a device holds stay float32 masters.
    local = _in_out(_local_weight(w, counts.numel()), transposed)
    return _grouped(x, counts.tolist(), local.to(x.dtype))


@_expert_mm.register_fake
def _(x, counts, w, transposed=False):
    return x.new_empty(x.shape[0], w.shape[-2] if transposed else w.shape[-1])


def _expert_mm_setup(ctx, inputs, output):
    x, counts, w, *rest = inputs
    ctx.transposed = bool(rest[0]) if rest else False
    ctx.save_for_backward(x, counts, w)


def _expert_mm_backward(ctx, grad):
    x, counts, w = ctx.saved_tensors
    sizes = counts.tolist()
    local = _in_out(_local_weight(w, len(sizes)), ctx.transposed)        # [experts, in, out]
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = _grouped(grad, sizes, local.to(grad.dtype).transpose(1, 2))
    if ctx.needs_input_grad[2]:
        grad_local = local.new_zeros(local.shape, dtype=grad.dtype)
        start = 0
        for e, n in enumerate(sizes):
            if n:
                torch.mm(x[start:start + n].t(), grad[start:start + n], out=grad_local[e])
            start += n
        grad_w = _scatter_home(_in_out(grad_local, ctx.transposed), w, len(sizes))
    return grad_x, None, grad_w, None


_expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)


# -- per-expert bias -----------------------------------------------------------------------------------

@torch.library.custom_op("piper::expert_bias", mutates_args=())
def _expert_bias(x: Tensor, counts: Tensor, b: Tensor) -> Tensor:
    local = _local_weight(b, counts.numel()).to(x.dtype)
    return x + local.repeat_interleave(counts, dim=0, output_size=x.shape[0])


@_expert_bias.register_fake
def _(x, counts, b):
    return torch.empty_like(x)


def _expert_bias_setup(ctx, inputs, output):
    _, counts, b = inputs
    ctx.save_for_backward(counts, b)


def _expert_bias_backward(ctx, grad):
    counts, b = ctx.saved_tensors
    grad_b = None
    if ctx.needs_input_grad[2]:
        rows_expert = torch.arange(counts.numel(), device=grad.device).repeat_interleave(counts)
        grad_local = grad.new_zeros(counts.numel(), grad.shape[-1]).index_add_(0, rows_expert, grad)
        grad_b = _scatter_home(grad_local, b, counts.numel())
    return grad, None, grad_b


_expert_bias.register_autograd(_expert_bias_backward, setup_context=_expert_bias_setup)


# -- the public primitives -----------------------------------------------------------------------------

class DispatchHandle(NamedTuple):
    """What `combine` needs to bring one call's token copies home (all tensors)."""

    order: Tensor          # [tokens * top_k]: the token copies sorted by expert
    regroup: Tensor        # rows received, grouped by this device's experts
    send_splits: Tensor    # rows sent to each device of the expert group (one entry: local)
    recv_splits: Tensor    # rows received from each


def dispatch(x: Tensor, experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, DispatchHandle]:
    """Group token copies by expert: `(routed, counts, handle)`.

    `x` is `[tokens, dim]`, `experts` `[tokens, top_k]` expert indices. `routed`
    holds one row per (token, k) for the experts this device holds, grouped by
    expert in ascending order; `counts[e]` is how many rows expert `e` got. On
    one device that is every expert and `tokens * top_k` rows; under `shard
    experts over dp` it is this device's `num_experts / size(dp)` experts and
    the rows every device sent them (the count depends on the routing).
    """
    routed, counts, *handle = torch.ops.piper.moe_dispatch(x, experts, num_experts)
    return routed, counts, DispatchHandle(*handle)


def expert_mm(routed: Tensor, counts: Tensor, weight: Tensor, *, transposed: bool = False) -> Tensor:
    """`routed` rows of expert `e` times `weight[e]`: `[rows, in] x [experts, in, out] -> [rows, out]`.

    `weight` is the layer's full `[num_experts, in, out]` parameter; under
    `shard experts` each device holds (and passes) only its own experts.
    `transposed=True` takes `weight` as `[num_experts, out, in]`, the layout of
    `nn.Linear` and of most Hugging Face experts (`F.linear(rows, weight[e])`).
    """
    return torch.ops.piper.expert_mm(routed, counts, weight, transposed)


def expert_bias(routed: Tensor, counts: Tensor, bias: Tensor) -> Tensor:
    """`routed` rows of expert `e` plus `bias[e]`: `[rows, out] + [experts, out] -> [rows, out]`.

    `bias` is the layer's full `[num_experts, out]` parameter, divided like the
    expert weights under `shard experts`.
    """
    return torch.ops.piper.expert_bias(routed, counts, bias)


def combine(y: Tensor, gates: Tensor, handle: DispatchHandle) -> Tensor:
    """Bring `y` (rows in `routed`'s order) home: `out[t] = sum_k gates[t, k] * y[row of (t, k)]`."""
    return torch.ops.piper.moe_combine(y, gates, *handle)[0]


# -- layers --------------------------------------------------------------------------------------------

class SwiGLU(torch.nn.Module):
    """`w2(silu(w1 x) * w3 x)`: the shared expert (and a dense feed-forward)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


_HALF = (torch.float16, torch.bfloat16)


class MoE(torch.nn.Module):
    """A dropless mixture of SwiGLU experts with top-k routing (torchtitan's conventions).

        moe = piper.nn.MoE(dim=64, hidden=128, num_experts=8, top_k=2)
        y = moe(x)        # x: (..., 64) -> y: (..., 64)

    `probs = softmax(x @ router.weight.T)` (in float32 for 16-bit inputs),
    `gates, experts = topk(probs, top_k)` (gates not renormalised), and
    `y = sum_k gates_k * (silu(x @ w1[e_k]) * (x @ w3[e_k])) @ w2[e_k]`, plus
    the shared expert when `shared_hidden > 0`. Every routed token is computed:
    no capacity, no dropping. Under `shard experts over dp` each device holds
    `num_experts / size(dp)` of `w1`, `w2`, `w3`.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, shared_hidden: int = 0):
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise error("bad-moe", f"MoE {name} must be a positive integer, not {value!r}",
                            hint=f"pass {name}= a whole number above 0")
        if not isinstance(shared_hidden, int) or shared_hidden < 0:
            raise error("bad-moe", f"MoE shared_hidden must be a non-negative integer, not {shared_hidden!r}",
                        hint="pass shared_hidden=0 for no shared expert")
        if top_k > num_experts:
            raise error("bad-moe", f"MoE top_k={top_k} is more than its num_experts={num_experts}",
                        hint=f"route each token to at most {num_experts} experts (top_k <= num_experts)")
        self.dim, self.hidden, self.num_experts, self.top_k = dim, hidden, num_experts, top_k
        self.router = torch.nn.Linear(dim, num_experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = torch.nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = torch.nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.shared = SwiGLU(dim, shared_hidden) if shared_hidden else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for w in (self.w1, self.w2, self.w3):
            torch.nn.init.trunc_normal_(w, std=std)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`(gates, experts)`, each `[tokens, top_k]`, for `x` of shape `[tokens, dim]`."""
        if x.dtype in _HALF:
            scores = F.linear(x.float(), self.router.weight.float())
        else:
            scores = self.router(x)
        return torch.topk(torch.softmax(scores, dim=-1), self.top_k, dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.dim)
        gates, experts = self.route(tokens)
        routed, counts, handle = dispatch(tokens, experts, self.num_experts)
        h = F.silu(expert_mm(routed, counts, self.w1)) * expert_mm(routed, counts, self.w3)
        out = combine(expert_mm(h, counts, self.w2), gates, handle)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)
