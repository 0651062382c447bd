"""Tensor, sequence and vocab parallelism at capture: the matched modules of capture's meta
copy compute on one device's shards and call `piper.tensor_ops`' collectives.

    shard columns of "blocks.*.attn.q", "blocks.*.mlp.up" over tp     weight rows (out features) / tp
    shard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp      weight columns (in features) / tp
    shard vocab of "tok_emb", "head" over tp                          vocabulary rows / tp
    shard sequence over tp                                            SP between rows and columns

What each matched module runs instead of its forward (Megatron-LM's plan; torchtitan's
ColwiseParallel / RowwiseParallel / SequenceParallel with local outputs):

    columns:  linear(tp_copy(x), W_i, b_i)                  SP: linear(tp_gather(x, seq), W_i, b_i)
    rows:     tp_reduce(linear(x, W_i)) + b                 SP: tp_reduce_scatter(linear(x, W_i), seq) + b
    vocab, an nn.Embedding: this device's rows looked up, other tokens give zeros, summed over tp
              (SP: reduce-scattered along the sequence, where the sequence shards begin; or,
              where the model reads the sequence's length before its first block, summed
              whole, the block cutting its input with tp_split: `apply(..., from_block=True)`)
    vocab, an nn.Linear (the output layer): its vocabulary columns of the logits; where they go
              straight into cross_entropy the loss is computed on the shards (`vocab_loss`),
              elsewhere they are gathered.

So the model's own code runs on local shapes between them: attention reshaping a columns
module's output with `view(B, T, -1, head_dim)` runs on heads / tp heads per device (key and
value heads too), and head-count attributes of the module holding the projections
(`n_head`, `num_heads`, `num_key_value_heads`, ...) are divided on the copy. The model is
not changed; its parameters keep their names, with each device's shapes in the program.

Why not DTensor: Piper's workers run autograd eagerly over forward graphs, and DTensor's
placements live in its autograd (its redistributes are autograd functions), which a forward
graph does not keep; per-op DTensor dispatch would also cost host time on every op. The
placements at module boundaries, which is all a Megatron plan fixes, are these ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..diagnostics import Label, did_you_mean, error
from .captured import op_schema
from .modules import forward_of, match_names, set_forward

KINDS = ("columns", "rows", "vocab")
HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_head", "n_kv_heads",
                   "num_kv_heads", "num_key_value_heads")
SEQUENCE_DIM = 1            # activations are [batch, sequence, ...]


@dataclass(frozen=True)
class TensorPlan:
    """The tensor-parallel statements of a strategy, resolved against its mesh."""

    axis: str
    size: int
    patterns: tuple[tuple[str, str, object], ...]     # (kind, pattern, span)
    sequence: bool = False
    sequence_span: object = None

    def of(self, kind: str) -> list[tuple[str, object]]:
        return [(p, s) for k, p, s in self.patterns if k == kind]


@dataclass(frozen=True)
class TensorLayout:
    """What a program divided over tp holds: each sharded parameter's dimension, the global shapes,
    and the replicated parameters whose gradients are summed over tp (those used on divided data)."""

    axis: str
    size: int
    dims: dict = field(default_factory=dict)          # param name -> the dimension divided over tp
    shapes: dict = field(default_factory=dict)        # param name -> its whole shape
    summed: frozenset = frozenset()                   # replicated params with gradients summed over tp
    sequence: bool = False
    modules: dict = field(default_factory=dict)       # module name -> its kind
    traffic: dict = field(default_factory=dict)       # (region, F | B) -> (bytes, collectives): `tensor_traffic`
    exchanges: dict = field(default_factory=dict)     # region -> (F bytes, B bytes) per TP op, in graph order
    sequence_from: str | None = ""                    # SP: "" from the embedding, else the block it begins at


def plan_of(directives, mesh) -> TensorPlan | None:
    """The tensor-parallel plan of `directives` (None without `shard columns/rows/vocab/sequence`)."""
    from .directives import Shard

    patterns, axis, sequence, sequence_span = [], None, False, None
    for d in directives:
        if not isinstance(d, Shard):
            continue
        for what in d.what:
            if what in KINDS:
                spans = tuple(getattr(d, "of_spans", ())) or (d.span,) * len(d.of)
                patterns += [(what, p, s or d.span) for p, s in zip(d.of, spans)]
                axis = d.over
            elif what == "sequence":
                sequence, sequence_span, axis = True, d.span, d.over
    if axis is None or mesh.size(axis) == 1 and not patterns:
        return None
    return TensorPlan(axis, mesh.size(axis), tuple(patterns), sequence, sequence_span)


# -- the modules' forwards on one device's shards -----------------------------------------------------------

def _columns_forward(self, x):
    from .. import tensor_ops

    # Under SP the module holding the projections gathered the sequence at its input
    # (`_gathering_forward`); else each projection's input enters tp here (capture merges the
    # copies of one input: `merge_copies`).
    if not self._piper_tp.sequence:
        x = tensor_ops.tp_copy(x)
    return F.linear(x, self.weight, self.bias)


def _on_first_tensor(fn, args, kwargs):
    """`args`, `kwargs` with `fn` applied to the first tensor among them."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return (*args[:i], fn(a), *args[i + 1:]), kwargs
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return args, {**kwargs, k: fn(v)}
    return args, kwargs


def _gathering_forward(self, *args, **kwargs):
    """SP: the module holding columns projections (attention, an MLP) gathers the sequence of
    its first tensor argument once, so its code sees whole sequences (torchtitan's
    PrepareModuleInput), and its projections compute on them."""
    from .. import tensor_ops

    plan = self._piper_tp_parent
    args, kwargs = _on_first_tensor(lambda x: tensor_ops.tp_gather(x, SEQUENCE_DIM, plan.size), args, kwargs)
    return self._piper_tp_inner(*args, **kwargs)


def _splitting_forward(self, *args, **kwargs):
    """SP beginning at the first block: its first tensor argument (the residual stream, whole
    until here) is cut to this device's part of the sequence."""
    from .. import tensor_ops

    plan = self._piper_tp_split
    args, kwargs = _on_first_tensor(lambda x: tensor_ops.tp_split(x, SEQUENCE_DIM, plan.size), args, kwargs)
    return self._piper_tp_split_inner(*args, **kwargs)


def _rows_forward(self, x):
    from .. import tensor_ops

    plan = self._piper_tp
    y = F.linear(x, self.weight)
    y = tensor_ops.tp_reduce_scatter(y, SEQUENCE_DIM, plan.size) if plan.sequence else tensor_ops.tp_reduce(y)
    return y if self.bias is None else y + self.bias


def _vocab_embedding_forward(self, ids):
    from .. import tensor_ops

    plan = self._piper_tp
    per = self.weight.shape[0]
    # An id outside the whole vocabulary would find its row on no device (zeros, trained silently):
    # counted, and raised on by `vocab_check` (ids are the same on every device along tp).
    vocab = per * plan.size
    outside = ((ids < 0) | (ids >= vocab)).sum()
    local = ids - tensor_ops.tp_offset(ids, per) + tensor_ops.vocab_check(outside, vocab, "token id")
    mine = (local >= 0) & (local < per)
    out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
    if self.padding_idx is not None:     # nn.Embedding's padding row is looked up but gets no gradient
        out = torch.where((ids == self._piper_padding).unsqueeze(-1), out.detach(), out)
    out = torch.where(mine.unsqueeze(-1), out, torch.zeros_like(out))      # another device's token: zeros
    if plan.sequence and not getattr(self, "_piper_tp_whole", False):      # the sequence shards begin here
        return tensor_ops.tp_reduce_scatter(out, SEQUENCE_DIM, plan.size)
    return tensor_ops.tp_reduce(out)


def _vocab_linear_forward(self, x):
    from .. import tensor_ops

    plan = self._piper_tp
    x = tensor_ops.tp_gather(x, SEQUENCE_DIM, plan.size) if plan.sequence else tensor_ops.tp_copy(x)
    # The logits' vocabulary columns, gathered: `vocab_loss` removes the gather where they go
    # straight into cross_entropy.
    return tensor_ops.tp_collect(F.linear(x, self.weight, self.bias), -1, plan.size)


def _wrap_parent(module: torch.nn.Module, plan) -> None:
    """SP: `module`'s forward gathers the sequence first (`_gathering_forward`)."""
    if "_piper_tp_parent" in module.__dict__:
        return
    object.__setattr__(module, "_piper_tp_inner", forward_of(module))
    object.__setattr__(module, "_piper_tp_parent", plan)
    set_forward(module, _gathering_forward)


def merge_copies(gm) -> None:
    """One `tp_copy` per value: the projections reading one input (q, k, v) share its copy, so
    its backward all-reduces their gradients once."""
    seen = {}
    for node in list(gm.graph.nodes):
        if op_schema(node) != "piper::tp_copy":
            continue
        first = seen.setdefault(node.args[0], node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


# -- applying a plan to capture's meta copy ----------------------------------------------------------------

def apply(model: torch.nn.Module, plan: TensorPlan, *, from_block: bool = False) -> TensorLayout:
    """Divide the meta copy `model` as `plan` says; returns what the program will hold.

    Under `shard sequence` the sequence shards begin where the vocab-parallel embedding
    reduce-scatters its lookups; with `from_block`, at the input of the first block (the
    module holding the first attention or MLP) instead: the embedding's lookups are summed
    whole and the block cuts the residual stream (`tp_split`). Capture takes that where the
    model's code between the two reads the sequence's length (Hugging Face models make their
    positions and causal mask from the embedding's output). `TensorLayout.sequence_from`
    names the block (None where there is none to begin at)."""
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    kind_of: dict[str, tuple[str, object]] = {}
    # A `shard` line in a loop repeats its patterns (57,351 at 8,193 turns of 7): each is matched once.
    first: dict[tuple[str, str], object] = {}
    for kind, pattern, span in plan.patterns:
        first.setdefault((kind, pattern), span)
    for (kind, pattern), span in first.items():
        found = match_names(pattern, names)
        if not found:
            raise error("unknown-module", f"`shard {kind} of \"{pattern}\"` matches no module of the model "
                        f"({type(model).__name__})", span=span,
                        hint=did_you_mean(pattern, names) or "names are those of model.named_modules(), e.g. "
                        + ", ".join(names[:3]) + "; `*` matches within one dotted part, `**` across")
        for name in found:
            if name in kind_of and kind_of[name][0] != kind:
                raise error("tp-conflict", f"module `{name}` is sharded both by {kind_of[name][0]} and by {kind}",
                            span=span, labels=(Label(kind_of[name][1], f"{kind_of[name][0]} here"),)
                            if kind_of[name][1] else (), hint="shard each module one way")
            kind_of[name] = (kind, span)
    if plan.sequence and not any(k == "vocab" and isinstance(modules[n], torch.nn.Embedding)
                                 for n, (k, _) in kind_of.items()):
        raise error("sequence-needs-vocab", "`shard sequence` but no nn.Embedding is sharded by vocab: the "
                    "sequence shards begin where the vocab-parallel embedding reduce-scatters its lookups",
                    span=plan.sequence_span,
                    hint="add the token embedding (and the output layer) to `shard vocab of ...`, or drop "
                         "`shard sequence`")
    dims: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    replaced: dict[int, torch.nn.Parameter] = {}
    first_name: dict[int, str] = {}            # id of a divided parameter -> the name it was divided under
    divided_as: dict[int, tuple] = {}          # id of a parameter divided -> (it, name, kind, dim, span)
    for name, (kind, span) in kind_of.items():
        module = modules[name]
        fn, divided = _check_module(name, module, kind, plan, span)
        for pname, dim in divided.items():
            old = getattr(module, pname)
            _same_division(divided_as.setdefault(id(old), (old, f"{name}.{pname}", kind, dim, span)),
                           f"{name}.{pname}", kind, dim, span)
            new = replaced.get(id(old))
            if new is None:
                shape = list(old.shape)
                shape[dim] //= plan.size
                new = replaced[id(old)] = torch.nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"),
                                                             requires_grad=old.requires_grad)
            setattr(module, pname, new)
            full = f"{name}.{pname}" if name else pname
            dims[full], shapes[full] = dim, tuple(old.shape)
            first_name.setdefault(id(new), full)
        object.__setattr__(module, "_piper_tp", plan)
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            object.__setattr__(module, "_piper_padding", module.padding_idx)
        set_forward(module, fn)
    _undivided_ties(model, divided_as)
    _tied_names(model, first_name, dims, shapes)
    _divide_heads(modules, kind_of, plan)
    if plan.sequence:
        for name, (kind, span) in kind_of.items():
            if kind == "columns":
                parent = name.rpartition(".")[0]
                if not parent:
                    raise error("tp-module-type", f"`shard sequence` needs columns modules inside a module (an "
                                f"attention, an MLP) whose input it gathers; `{name}` is the model's own child",
                                span=span, hint="shard the projections of a block, or drop `shard sequence`")
                _wrap_parent(modules[parent], plan)
    _check_pairs(kind_of, plan)
    begins = _begin_at_block(modules, names, kind_of, plan) if plan.sequence and from_block else ""
    return TensorLayout(plan.axis, plan.size, dims, shapes, frozenset(), plan.sequence,
                        {n: k for n, (k, _) in kind_of.items()}, sequence_from=begins)


def _begin_at_block(modules, names, kind_of, plan) -> str | None:
    """`from_block`: the first block cuts the sequence, the embeddings stay whole; the block's name
    (None: the first columns module has no block above its parent)."""
    first = min((n for n, (k, _) in kind_of.items() if k == "columns"), key=names.index)
    block = first.rpartition(".")[0].rpartition(".")[0]
    if not block:
        return None
    for name, (kind, _) in kind_of.items():
        if kind == "vocab" and isinstance(modules[name], torch.nn.Embedding):
            object.__setattr__(modules[name], "_piper_tp_whole", True)
    module = modules[block]
    object.__setattr__(module, "_piper_tp_split_inner", forward_of(module))
    object.__setattr__(module, "_piper_tp_split", plan)
    set_forward(module, _splitting_forward)
    return block


def _check_module(name, module, kind, plan, span):
    """(the forward it runs, {parameter: divided dimension}) for one matched module, or its error."""
    if kind in ("columns", "rows") and not isinstance(module, torch.nn.Linear):
        raise error("tp-module-type", f"`shard {kind}` matches `{name}`, a {type(module).__name__}, not an nn.Linear",
                    span=span, hint=f"name the nn.Linear modules inside it (e.g. `{name}.*`), or shard it another way")
    if kind == "vocab" and not isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
        raise error("tp-module-type", f"`shard vocab` matches `{name}`, a {type(module).__name__}, not an "
                    "nn.Embedding or an output nn.Linear", span=span,
                    hint="name the token embedding and the output layer")
    if kind == "columns":
        _divisible(name, "output features", module.out_features, plan, span)
        return _columns_forward, {"weight": 0, **({"bias": 0} if module.bias is not None else {})}
    if kind == "rows":
        _divisible(name, "input features", module.in_features, plan, span)
        return _rows_forward, {"weight": 1}
    if isinstance(module, torch.nn.Embedding):
        _divisible(name, "vocabulary rows", module.num_embeddings, plan, span)
        if module.max_norm is not None or module.sparse:
            raise error("tp-module-type", f"`{name}` is an nn.Embedding with max_norm or sparse gradients, which "
                        "`shard vocab` does not divide", span=span, hint="drop max_norm/sparse, or leave it whole")
        return _vocab_embedding_forward, {"weight": 0}
    _divisible(name, "vocabulary columns (output features)", module.out_features, plan, span)
    return _vocab_linear_forward, {"weight": 0, **({"bias": 0} if module.bias is not None else {})}


def _divisible(name, what, count, plan, span):
    if count % plan.size:
        raise error("tp-indivisible", f"`{name}` has {count} {what}, which do not divide over `{plan.axis}` of size "
                    f"{plan.size}", span=span,
                    hint=f"use a tensor-parallel size that divides {count}, or leave `{name}` whole")


def _same_division(first: tuple, name: str, kind: str, dim: int, span) -> None:
    """A parameter tied between two divided modules is divided once: along one dimension."""
    _, first_name, first_kind, first_dim, first_span = first
    if first_dim != dim:
        raise error("tp-tied-weight", f"`{name}` is tied to `{first_name}`: `shard {kind}` divides it along "
                    f"dimension {dim} and `shard {first_kind}` along dimension {first_dim}", span=span,
                    labels=(Label(first_span, f"{first_kind} here"),) if first_span and first_span != span else (),
                    hint="shard the modules that share a weight the same way, or untie the weights")


def _undivided_ties(model, divided_as: dict) -> None:
    """A parameter tied between a divided module and one no pattern names would be a shard in one
    and whole in the other (the runtime has no whole copy to give the second): refused here, at
    `piper check --model`, rather than after the workers start."""
    for holder, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            found = divided_as.get(id(p)) if p is not None else None
            if found is not None and found[0] is p:
                _, name, kind, _, span = found
                full = f"{holder}.{pname}" if holder else pname
                raise error("tp-tied-weight", f"`{full}` is tied to `{name}`, which `shard {kind}` divides, but no "
                            f"pattern names `{holder or type(model).__name__}`: it would read the whole weight "
                            "while the other holds a shard", span=span,
                            hint=f"add `{holder}` to `shard {kind} of ...` so both divide the weight alike, or "
                                 "untie the weights (give the module a parameter of its own)")


def _tied_names(model, first_name: dict, dims, shapes) -> None:
    """A tied parameter (one tensor under two names) is divided once; both names say so."""
    for name, p in model.named_parameters(remove_duplicate=False):
        first = first_name.get(id(p))
        if first is not None and name not in dims:
            dims[name], shapes[name] = dims[first], shapes[first]


def _divide_heads(modules, kind_of, plan) -> None:
    """Head counts of the modules holding columns projections, divided on the copy."""
    parents = {name.rpartition(".")[0] for name, (kind, _) in kind_of.items() if kind == "columns"}
    for parent in parents:
        module = modules.get(parent)
        if module is None:
            continue
        for attr in HEAD_ATTRIBUTES:
            value = module.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % plan.size:
                    span = next(s for n, (k, s) in kind_of.items() if n.rpartition(".")[0] == parent)
                    raise error("tp-indivisible", f"`{parent}` has {attr}={value}, which does not divide over "
                                f"`{plan.axis}` of size {plan.size}", span=span,
                                hint=f"use a tensor-parallel size that divides {value}")
                object.__setattr__(module, attr, value // plan.size)


def _check_pairs(kind_of, plan) -> None:
    """A rows module needs its input divided by a columns module, and the other way round."""
    kinds = {k for k, _ in kind_of.values()}
    if "rows" in kinds and "columns" not in kinds:
        span = next(s for k, s in kind_of.values() if k == "rows")
        raise error("tp-unpaired", "modules are sharded by rows but none by columns: a rows module's input must "
                    "arrive divided along its features, as a columns module's output is", span=span,
                    hint="shard the projection feeding each rows module by columns (`shard columns of ...`)")
    if "columns" in kinds and "rows" not in kinds:
        span = next(s for k, s in kind_of.values() if k == "columns")
        raise error("tp-unpaired", "modules are sharded by columns but none by rows: a columns module's divided "
                    "output must reach a rows module that sums it", span=span,
                    hint="shard the projection reading each columns module's output by rows (`shard rows of ...`)")
