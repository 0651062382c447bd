"""The pieces of a cut capture: the values one region passes to others, and each
region's ops copied into an fx graph of its own.
"""
from __future__ import annotations

import re

from .captured import BATCH, BUFFER, PARAM, VALUE, Region, RegionInput, TensorSpec, Value, _stack_line
from ..diagnostics import error
from ..lazy import LazyModule

torch = LazyModule("torch")
fx = LazyModule("torch.fx")

# The order a region's graph takes its inputs in: params, buffers, batch, values.
_INPUT_RANK = {PARAM: 0, BUFFER: 1, BATCH: 2, VALUE: 3}


def region_values(compute: list[fx.Node], region_of: dict, tag_of: dict, needs_grad: set, count: int):
    """The values: nodes used by another region. Returns (node -> value id, region -> the
    nodes it outputs, in value order, the values)."""
    value_ids: dict[fx.Node, int] = {}
    consumers: dict[fx.Node, list[int]] = {}
    for n in compute:
        users = sorted({region_of[u] for u in n.users if u in region_of and region_of[u] != region_of[n]})
        if users:
            consumers[n] = users
    region_outputs: dict[int, list[fx.Node]] = {r: [] for r in range(count)}
    values: list[Value] = []
    for n in compute:
        if n in consumers:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise error("unsupported-model", f"region {' '.join(f'{k}={v}' for k, v in tag_of[n])} passes "
                            f"a non-tensor ({type(val).__name__}) to another region",
                            hint="pass only tensors between regions")
            r = region_of[n]
            value_ids[n] = len(values)
            values.append(Value(len(values), r, len(region_outputs[r]), tuple(consumers[n]), TensorSpec.of(val),
                                (val.dtype.is_floating_point or val.dtype.is_complex) and n in needs_grad))
            region_outputs[r].append(n)
    return value_ids, region_outputs, values


def region_graph(r: int, tags: tuple, member: list[fx.Node], *, region_of: dict, kind_of: dict[str, RegionInput],
                 value_ids: dict, outputs: list[fx.Node], joined: dict, loss_node: fx.Node) -> Region:
    """Region `r`: its ops (`member`) copied into a graph whose inputs are what they read from
    outside it, and whose outputs are its values (then the loss, if it computes it)."""
    inputs: list[RegionInput] = []
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    external: list[fx.Node] = []
    for n in member:
        for a in n.all_input_nodes:
            if a not in env and (a.op == "placeholder" or region_of.get(a) != r) and a not in external:
                external.append(a)

    def ref_of(a):
        return kind_of[a.name] if a.op == "placeholder" else RegionInput(VALUE, value_ids[a])

    external.sort(key=lambda a: (_INPUT_RANK[ref_of(a).kind], str(ref_of(a).ref)))
    for a in external:
        ph = sub.placeholder(re.sub(r"\W", "_", a.name))
        ph.meta = dict(a.meta)
        env[a] = ph
        inputs.append(ref_of(a))
    for n in member:
        env[n] = sub.node_copy(n, lambda a: env[a])
        if n in joined:
            env[n].meta["piper_joined"] = joined[n]     # for `piper show --what ir`
    outs = [env[n] for n in outputs]
    is_loss = region_of[loss_node] == r
    if is_loss:
        outs.append(env[loss_node])
    sub.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), sub)
    return Region(r, tags, tuple(inputs), tuple(value_ids[n] for n in outputs), is_loss, gm,
                  _stack_line(member[0]) if member else None,
                  tuple((str(n.target), joined[n], _stack_line(n)) for n in member if n in joined))
