"""Which replicated parameters of a program divided over tp get their gradients summed over tp.

A replicated parameter (a norm's weight, a router) is the same on every device along tp, but
its gradient is only the same where every device computed the same thing with it. Where it
meets data that differ along tp (sequence shards under SP, a device's heads: Qwen3's q/k
norms), each device's gradient is a part of the whole, and the parts are summed over tp at
the end of the step (Megatron-LM's all-reduce of sequence-parallel layer-norm gradients).

Two walks over the region graphs, in program order and back:

- forward, which values are *divided* (differ along tp): a divided parameter's, and any op's
  output that reads one; `tp_reduce`, `tp_gather`, `tp_collect`, `tp_max` and `tp_copy` give
  the same value on every device; `tp_reduce_scatter`, `tp_split` and `tp_offset` divided ones;
- backward, what gradient each same-on-every-device value receives: *whole* through ops every
  device runs alike and through `tp_copy`/`tp_gather` (whose backward reduces over tp) and
  `tp_split` (whose backward gathers the parts),
  *partial* through an op on divided data. A parameter that receives partial gradients is
  summed; one that receives both kinds cannot be made whole by a sum (`tp-mixed-use`).
"""
from __future__ import annotations

from ..diagnostics import error
from .captured import op_schema

_SAME = {"piper::tp_reduce", "piper::tp_gather", "piper::tp_collect", "piper::tp_max", "piper::tp_copy"}
_DIVIDING = {"piper::tp_reduce_scatter", "piper::tp_offset", "piper::tp_split"}
_REDUCING_BACKWARD = {"piper::tp_copy", "piper::tp_gather", "piper::tp_split"}   # their input's gradient: whole
WHOLE, PARTIAL, MIXED = "whole", "partial", "mixed"


def _merge(a, b):
    if a is None or a == b:
        return b
    return MIXED


def summed(program, dims: dict) -> frozenset:
    """The replicated parameters of `program` (a `TensorLayout.dims` beside it) whose gradients
    are summed over tp; raises `tp-mixed-use` for one that cannot be."""
    from .captured import PARAM, VALUE

    divided_value: dict[int, bool] = {}
    per_region = []
    for region in program.regions:
        if region.graph is None:
            continue
        nodes = list(region.graph.graph.nodes)
        holders = [n for n in nodes if n.op == "placeholder"]
        divided: dict = {}
        for p, inp in zip(holders, region.inputs):
            divided[p] = (inp.kind == PARAM and inp.ref in dims) or (inp.kind == VALUE and divided_value.get(inp.ref, False))
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            name = op_schema(n)
            if name in _SAME:
                divided[n] = False
            elif name in _DIVIDING:
                divided[n] = True
            else:
                divided[n] = any(divided.get(i, False) for i in n.all_input_nodes)
        out = next(n for n in nodes if n.op == "output")
        outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        for value, o in zip(region.outputs, outs):
            divided_value[value] = bool(divided.get(o, False))
        per_region.append((region, nodes, holders, divided, outs))
    value_grad: dict[int, str] = {}
    found: dict[str, str] = {}
    for region, nodes, holders, divided, outs in reversed(per_region):
        grad: dict = {}
        for i, o in enumerate(outs):
            if hasattr(o, "op"):
                is_loss = region.loss and i == len(outs) - 1
                kind = WHOLE if is_loss else value_grad.get(region.outputs[i]) if i < len(region.outputs) else None
                if kind is not None:
                    grad[o] = _merge(grad.get(o), kind)
        for n in reversed(nodes):
            if n.op in ("placeholder", "output") or n not in grad and not divided.get(n, False):
                continue
            name = op_schema(n)
            for i in n.all_input_nodes:
                if divided.get(i, False):
                    continue                 # a divided value's gradient is its own device's
                if name in _REDUCING_BACKWARD:
                    kind = WHOLE
                elif divided.get(n, False):
                    kind = PARTIAL
                else:                        # an op every device runs alike
                    kind = grad.get(n)
                if kind is not None:
                    grad[i] = _merge(grad.get(i), kind)
        for p, inp in zip(holders, region.inputs):
            kind = grad.get(p)
            if kind is None:
                continue
            if inp.kind == PARAM and inp.ref not in dims:
                found[inp.ref] = _merge(found.get(inp.ref), kind)
            elif inp.kind == VALUE:
                value_grad[inp.ref] = _merge(value_grad.get(inp.ref), kind)
    mixed = sorted(n for n, k in found.items() if k == MIXED)
    if mixed:
        raise error("tp-mixed-use", f"parameter `{mixed[0]}` is used both on values every device along tp holds "
                    "alike and on values divided over tp, so no sum over tp makes its gradient whole",
                    hint="shard the modules around it so it meets one kind of value (e.g. add `shard sequence`), "
                         "or leave that part of the model undivided")
    return frozenset(n for n, k in found.items() if k == PARTIAL)
