"""Ship region graphs to workers.

A GraphModule pickles by re-tracing its generated code, which turns factory
ops such as `arange(..., device=meta)` into baked constants; and ATen op
overloads do not pickle at all. So graphs travel as a plain list of nodes
with ops named by their qualified name, and are rebuilt on the worker.

A custom op (`torch.library.custom_op`: Piper's `piper::expert_mm`, a library's
`transformers::grouped_mm_fallback`, a user's own) exists in a process only
once the module defining it is imported, which a worker has no reason to do:
each op travels with the name of that module, imported on the worker first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Op:
    qualname: str               # "aten.arange.default"
    module: str | None = None   # what defines it, for a custom op ("piper.nn")

    def resolve(self):
        namespace, name, overload = self.qualname.split(".")
        if self.module is not None:
            _import_defining(self.module, f"{namespace}::{name}")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _defining_module(op: torch._ops.OpOverload) -> str | None:
    """The module whose import registers `op`: a `torch.library.custom_op`'s function's module."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(op._schema.name)
    return getattr(getattr(opdef, "_init_fn", None), "__module__", None) if opdef is not None else None


def _import_defining(module: str, op: str) -> None:
    import importlib

    from ...diagnostics import error

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise error("missing-op", f"the model's graph calls the custom op `{op}`, defined in `{module}`, which "
                    f"this worker cannot import ({exc})",
                    hint=f"install `{module.split('.')[0]}` where the workers run, or make `{module}` importable "
                         "there (the same PYTHONPATH as the driver's)") from None


@dataclass(frozen=True)
class PackedGraph:
    nodes: tuple   # (op, name, target, args, kwargs)


def _pack_arg(a):
    if isinstance(a, fx.Node):
        return _Ref(a.name)
    if isinstance(a, (list, tuple)):
        return type(a)(_pack_arg(x) for x in a)
    if isinstance(a, dict):
        return {k: _pack_arg(v) for k, v in a.items()}
    return a


def _unpack_arg(a, env):
    if isinstance(a, _Ref):
        return env[a.name]
    if isinstance(a, (list, tuple)):
        return type(a)(_unpack_arg(x, env) for x in a)
    if isinstance(a, dict):
        return {k: _unpack_arg(v, env) for k, v in a.items()}
    return a


def pack(gm: fx.GraphModule) -> PackedGraph:
    nodes = []
    for n in gm.graph.nodes:
        target = n.target
        if isinstance(target, torch._ops.OpOverload):
            target = _Op(f"{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}",
                         _defining_module(target))
        elif n.op == "call_function" and not callable(target):
            raise TypeError(f"cannot ship graph node {n.format_node()}")
        nodes.append((n.op, n.name, target, _pack_arg(n.args), _pack_arg(n.kwargs)))
    return PackedGraph(tuple(nodes))


def unpack(packed: PackedGraph, device: torch.device | None = None) -> fx.GraphModule:
    """Rebuild the GraphModule; tensor factories are pointed at `device`."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in packed.nodes:
        args, kwargs = _unpack_arg(args, env), _unpack_arg(kwargs, env)
        if isinstance(target, _Op):
            target = target.resolve()
        if device is not None and isinstance(kwargs.get("device"), torch.device):
            kwargs = {**kwargs, "device": device}   # capture ran on meta
        if device is not None and any(isinstance(a, torch.device) for a in args):
            args = tuple(device if isinstance(a, torch.device) else a for a in args)   # `x.to(device)`
        if op == "placeholder":
            node = graph.placeholder(name)
        elif op == "output":
            node = graph.output(args[0])
        else:
            node = graph.create_node(op, target, args, kwargs, name=name)
        env[name] = node
    return fx.GraphModule(torch.nn.Module(), graph)
