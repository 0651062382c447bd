"""The collectives of tensor and sequence parallelism, as ops a captured graph holds.

Under `shard columns/rows/vocab ... over tp` capture rewrites the matched
modules of its meta copy (`piper.frontend.tensor_parallel`) to call these, so
each region graph computes on each device's shards and names every
collective it needs as one node (Megatron-LM's f and g, and their sequence-
parallel forms):

    tp_copy(x)                  forward: identity        backward: all-reduce (f: a columns module's input)
    tp_reduce(x)                forward: all-reduce      backward: identity   (g: a rows module's output)
    tp_gather(x, dim, n)        forward: all-gather      backward: reduce-scatter  (SP: a columns module's input)
    tp_reduce_scatter(x, dim, n) forward: reduce-scatter backward: all-gather      (SP: a rows module's output)
    tp_collect(x, dim, n)       forward: all-gather      backward: this device's slice (logits used whole)
    tp_split(x, dim, n)         forward: this device's slice  backward: all-gather (SP beginning at a block)
    tp_max(x)                   forward: all-reduce max, no gradient (the vocab-parallel loss's shift)
    tp_offset(x, per)           this device's index along tp times `per` (where its vocabulary rows start)
    vocab_terms(logits, shift, local)  no collective: the vocab-parallel loss's local sums, with its own backward
    vocab_check(count, vocab, what)    no collective: a zero that raises `token-out-of-range` where `count` > 0

Each is a `torch.library` custom op, so strict `torch.export` records it as one
node with a static shape (`n` is the axis size, known at capture). What it does
is decided when it runs: the runtime installs the calling thread's group
(`piper.tensor_context`); with none (one device) every op is the identity.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .diagnostics import PiperError, error
from .tensor_context import current


def _group():
    return current()


def _resized(x: Tensor, dim: int, times: int = 1, over: int = 1) -> Tensor:
    """An empty `x` with dimension `dim` times `times` over `over` (what a gather or a reduce-scatter gives)."""
    shape = list(x.shape)
    shape[dim] = shape[dim] * times // over
    return x.new_empty(shape)


# -- f: identity forward, all-reduce backward -------------------------------------------------------------

@torch.library.custom_op("piper::tp_copy", mutates_args=())
def tp_copy(x: Tensor) -> Tensor:
    return x.clone()


@tp_copy.register_fake
def _(x):
    return torch.empty_like(x)


def _copy_backward(ctx, grad):
    return _all_reduce(grad)


tp_copy.register_autograd(_copy_backward)


# -- g: all-reduce forward, identity backward -------------------------------------------------------------

@torch.library.custom_op("piper::tp_reduce", mutates_args=())
def tp_reduce(x: Tensor) -> Tensor:
    return _all_reduce(x)


@tp_reduce.register_fake
def _(x):
    return torch.empty_like(x)


def _reduce_backward(ctx, grad):
    return grad


tp_reduce.register_autograd(_reduce_backward)


def _all_reduce(x: Tensor) -> Tensor:
    group = _group()
    out = x.contiguous().clone()
    if group is not None and group.size > 1:
        group.all_reduce(out)
    return out


# -- sequence parallelism: all-gather / reduce-scatter along a dimension ------------------------------------

@torch.library.custom_op("piper::tp_gather", mutates_args=())
def tp_gather(x: Tensor, dim: int, size: int) -> Tensor:
    return _gather(x, dim, size)


@tp_gather.register_fake
def _(x, dim, size):
    return _resized(x, dim, size)


def _gather_backward(ctx, grad):
    return _reduce_scatter(grad, ctx.dim, ctx.size), None, None


def _dim_setup(ctx, inputs, output):
    _, ctx.dim, ctx.size = inputs


tp_gather.register_autograd(_gather_backward, setup_context=_dim_setup)


@torch.library.custom_op("piper::tp_reduce_scatter", mutates_args=())
def tp_reduce_scatter(x: Tensor, dim: int, size: int) -> Tensor:
    return _reduce_scatter(x, dim, size)


def _divided_fake(x, dim, size):
    return _resized(x, dim, over=size)


def _reduce_scatter_backward(ctx, grad):       # tp_split's too: the parts' gradients gathered
    return _gather(grad, ctx.dim, ctx.size), None, None


tp_reduce_scatter.register_fake(_divided_fake)


tp_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_dim_setup)


def _gather(x: Tensor, dim: int, size: int) -> Tensor:
    group = _group()
    if group is None or group.size == 1:
        assert size == 1, "a graph divided over tp runs with its tensor-parallel group installed"
        return x.clone()
    return group.all_gather(x, dim)


def _reduce_scatter(x: Tensor, dim: int, size: int) -> Tensor:
    group = _group()
    if group is None or group.size == 1:
        assert size == 1, "a graph divided over tp runs with its tensor-parallel group installed"
        return x.clone()
    return group.reduce_scatter(x, dim)


# -- the output layer's logits, gathered where nothing divides the loss ------------------------------------

@torch.library.custom_op("piper::tp_collect", mutates_args=())
def tp_collect(x: Tensor, dim: int, size: int) -> Tensor:
    """All-gather for a value every device then uses whole and alike: its gradient is the same
    on every device, so each keeps its own slice (not a reduce-scatter, as `tp_gather`'s)."""
    return _gather(x, dim, size)


@tp_collect.register_fake
def _(x, dim, size):
    return _resized(x, dim, size)


def _collect_backward(ctx, grad):
    group = _group()
    if group is None or group.size == 1:
        return grad.clone(), None, None
    return grad.chunk(ctx.size, ctx.dim)[group.index].contiguous(), None, None


tp_collect.register_autograd(_collect_backward, setup_context=_dim_setup)


# -- SP beginning at a block's input: the whole sequence before it, this device's part after ----------------

@torch.library.custom_op("piper::tp_split", mutates_args=())
def tp_split(x: Tensor, dim: int, size: int) -> Tensor:
    """This device's chunk of `x` along `dim` (a copy: a custom op's output may not alias its input)."""
    group = _group()
    if group is None or group.size == 1:
        return x.clone()
    return x.chunk(group.size, dim)[group.index].clone()


tp_split.register_fake(_divided_fake)
tp_split.register_autograd(_reduce_scatter_backward, setup_context=_dim_setup)


# -- the vocab-parallel loss's helpers ---------------------------------------------------------------------

@torch.library.custom_op("piper::tp_max", mutates_args=())
def tp_max(x: Tensor) -> Tensor:
    group = _group()
    out = x.contiguous().clone()
    if group is not None and group.size > 1:
        group.all_reduce(out, "max")
    return out


@tp_max.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("piper::tp_offset", mutates_args=())
def tp_offset(x: Tensor, per: int) -> Tensor:
    group = _group()
    index = group.index if group is not None else 0
    return torch.tensor(index * per, dtype=torch.int64, device=x.device)


@tp_offset.register_fake
def _(x, per):
    return x.new_empty((), dtype=torch.int64)


# -- the vocab-parallel loss's local half ------------------------------------------------------------------

@torch.library.custom_op("piper::vocab_terms", mutates_args=())
def vocab_terms(logits: Tensor, shift: Tensor, local: Tensor) -> tuple[Tensor, Tensor]:
    """This device's part of a vocab-parallel cross entropy, `logits` `[N, V/tp]`: `[2, N]`, per
    row the sum of `exp(logits - shift)` over its columns and the shifted logit of the target
    where the target (`local`, its index among these columns) is one of them (else 0), both
    summed over tp by one all-reduce; and the exponentials, kept for backward. One op with its
    own backward: autograd through the ops would allocate three `[N, V/tp]` tensors in the
    loss's backward (exp's gradient, indexing's zeros and their sum), where the step peaks; this
    one allocates one."""
    exp = (logits - shift.unsqueeze(-1)).exp()
    per = logits.shape[-1]
    mine = (local >= 0) & (local < per)
    rows = torch.arange(logits.shape[0], device=logits.device)
    picked = logits[rows, local.clamp(0, per - 1)] - shift
    return torch.stack([exp.sum(-1), torch.where(mine, picked, torch.zeros_like(picked))]), exp


@vocab_terms.register_fake
def _(logits, shift, local):
    return logits.new_empty((2, logits.shape[0])), torch.empty_like(logits)


def _terms_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], output[1])
    ctx.set_materialize_grads(False)        # the exponentials' gradient: None, not a zeroed [N, V/tp]


def _terms_backward(ctx, g_terms, g_exp):
    local, exp = ctx.saved_tensors
    grad = exp * g_terms[0].unsqueeze(-1) if g_terms is not None else torch.zeros_like(exp)
    if g_exp is not None:
        grad += g_exp * exp
    if g_terms is not None:
        per = exp.shape[-1]
        mine = (local >= 0) & (local < per)
        rows = torch.arange(exp.shape[0], device=exp.device)
        grad[rows[mine], local[mine]] += g_terms[1][mine]
    return grad, None, None


vocab_terms.register_autograd(_terms_backward, setup_context=_terms_setup)


def vocab_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: int = 1,
                        vocab: int | None = None) -> Tensor:
    """`cross_entropy(full_logits, target)` from this device's vocabulary columns `logits`
    (`[N, V/tp]`, its rows `[offset, offset + V/tp)` of the vocabulary), never gathering the
    full logits: the row maxima, the sums of exponentials and the target logits are reduced
    over tp (Megatron-LM's vocab-parallel cross entropy; torchtitan's loss_parallel).
    `reduction`: 0 none, 1 mean over the targets that are not `ignore_index`, 2 sum (ATen's).
    `vocab`: V (capture passes it: a traced graph keeps it as a constant); None: `V/tp` times the
    calling thread's group size. A target outside `[0, V)` (not `ignore_index`) raises
    `token-out-of-range` (`vocab_check`), as `cross_entropy` raises for one."""
    per = logits.shape[-1]
    offset = tp_offset(logits, per)
    shift = tp_max(logits.detach().amax(-1))          # any shift gives the same loss and gradient
    local = target - offset
    # For backward it keeps the exponentials and the indices only: not `shifted` beside them (as
    # gather's backward would), which would make the loss keep as many bytes at tp=2 as the full
    # logits' log_softmax does.
    terms, _ = vocab_terms(logits, shift, local)
    valid = target != ignore_index
    # Targets no device holds a logit of, counted here and summed by the same all-reduce as the
    # sums (one more column): every device of the group sees the count of all.
    vocab = per * _size() if vocab is None else vocab
    outside = (valid & ((target < 0) | (target >= vocab))).sum().to(terms.dtype)
    flag = torch.stack([outside, torch.zeros_like(outside)]).unsqueeze(1)
    reduced = tp_reduce(torch.cat([terms, flag], 1))
    sum_exp, target_logit = reduced[:, :-1].unbind(0)
    checked = vocab_check(reduced[0, -1].detach(), vocab, "target")
    loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(target_logit)) + checked
    if reduction == 0:
        return loss
    if reduction == 2:
        return loss.sum()
    return loss.sum() / valid.sum().to(loss.dtype)


# -- ids outside the vocabulary ----------------------------------------------------------------------------
# A vocab-parallel lookup or loss finds no row for an id outside [0, V) on any device: the lookup
# gives zeros and the target's logit 0, so it would train silently where one device's
# `nn.Embedding` and `cross_entropy` raise. Each counts such ids into a tensor for `vocab_check`,
# whose zero it adds downstream (so the check stays in the graph). Alone (a direct call, the
# driver's measurements) the count is looked at on the spot; inside a worker's step
# (`deferred_vocab_checks`) it is kept and looked at once the step's losses are read, so no step
# waits on its device for it and every device of a group finishes the step before any raises.

_deferred: list | None = None


def _size() -> int:
    group = _group()
    return group.size if group is not None else 1


def out_of_vocabulary(vocab: int, what: str) -> PiperError:
    """`token-out-of-range` for a `what` ("token id" or "target") outside `[0, vocab)`."""
    where = ("reached the embedding divided by `shard vocab`: no device holds its row, so it would be "
             "looked up as zeros" if what == "token id" else
             "reached the loss computed on `shard vocab`'s shards: no device holds its logit, so it would "
             "train toward nothing")
    return error("token-out-of-range", f"a {what} outside the vocabulary of {vocab:,} (0 to {vocab - 1:,}) {where}",
                 notes=("on one device `nn.Embedding` and `cross_entropy` raise IndexError for it",),
                 hint="check the data: token ids and targets lie in [0, vocabulary size) (a target to skip is "
                      "ignore_index, -100); a token file read with `data=` (piper.data.TokenFile, piper run "
                      "--data) names the position of the first such id")


@torch.library.custom_op("piper::vocab_check", mutates_args=())
def vocab_check(count: Tensor, vocab: int, what: str) -> Tensor:
    """A scalar zero of `count`'s dtype; `token-out-of-range` where `count` (ids outside the
    vocabulary) is above 0: at once, or when the step's losses are read (`deferred_vocab_checks`)."""
    if count.device.type != "meta":      # capture traces the loss on meta tensors
        if _deferred is not None:
            _deferred.append((count, vocab, what))
        elif bool(count > 0):
            raise out_of_vocabulary(vocab, what)
    return count.new_zeros(())


@vocab_check.register_fake
def _(count, vocab, what):
    return count.new_empty(())


class VocabChecks:
    """The counts `vocab_check` kept during a step; `check()` raises for the first above 0."""

    def __init__(self):
        self.found: list = []

    def check(self) -> None:
        found = list(self.found)
        self.found.clear()
        for count, vocab, what in found:
            if bool(count > 0):
                raise out_of_vocabulary(vocab, what)


@contextlib.contextmanager
def deferred_vocab_checks():
    """Within the body `vocab_check` keeps its counts in the `VocabChecks` yielded (every thread:
    a step's lanes run in threads of their own); the caller checks them once it has read the
    step's results (a worker's step, whose losses wait for the device anyway)."""
    global _deferred
    checks = VocabChecks()
    previous, _deferred = _deferred, checks.found
    try:
        yield checks
    finally:
        _deferred = previous
