"""From what `torch.export` gives for a real model to one flat graph that
capture can cut into regions.

Models nobody here wrote (Hugging Face, torchtitan) export with things a
hand-written model does not have; each function below turns one of them into
plain ATen ops, or names it with the module and the workaround:

- `inline_grad_islands`: `with torch.no_grad():` blocks export as
  `wrap_with_set_grad_enabled` calls of sub-graphs; their ops are inlined and
  each result is detached, which gives the same values and no gradient.
- `python_data_on_cpu`: while exporting on the meta device, a tensor made
  from Python data on the input's device (`torch.tensor([...],
  device=x.device)`, `x.new_tensor(...)`) is made on the CPU and moved, so
  export keeps its values: a constant the workers get as a buffer, moved to
  their device by the graph's own `to(device)`.
- `inline_autocast`: `with torch.autocast(...)` blocks export as
  `wrap_with_autocast` calls of sub-graphs; each is traced again under the
  same autocast, so the casts autocast makes become ops of the graph.
- `materialise_constants`: tensors made in forward (`torch.tensor([])` in a
  KV cache) are lifted as constants; empty ones become a factory op.
- `keep_only_loss`: a `ModelOutput` / dict / tuple return keeps its `loss`
  (or first element) as the only output, and ops that fed only the rest go.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..diagnostics import error
from .frames import last_user_frame

_DETACH = torch.ops.aten.detach.default
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)


def _holds_tensor(data) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(data))


class python_data_on_cpu(torch.overrides.TorchFunctionMode):
    """While capture exports on the meta device: make tensors from Python data on the CPU.

    before: w = torch.tensor([1., 2.], device=x.device)     # x on meta: the values are lost
    after:  w = torch.tensor([1., 2.]).to(x.device)         # a CPU constant (values kept), then moved
    Capture sends such constants to the workers as buffers, on their device, where the `to`
    moves nothing. Empty tensors and tensors made from tensors are left as they are.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_DATA and args and not _holds_tensor(args[0]):
            positional = func is torch.as_tensor and len(args) > 2
            device = args[2] if positional else kwargs.get("device")
            if device is not None and torch.device(device).type == "meta":
                args = (*args[:2], "cpu", *args[3:]) if positional else args
                made = func(*args, **{**kwargs, "device": "cpu"} if not positional else kwargs)
                if made.numel():
                    return made.to(device)
        return func(*args, **kwargs)


def _source(node: fx.Node) -> str | None:
    return last_user_frame(node.meta.get("stack_trace") or "")


def _at(node: fx.Node) -> str:
    where = _source(node)
    return f" (at {where})" if where else ""


def inline_autocast(gm: fx.GraphModule) -> None:
    """Inline `torch.autocast` blocks with the casts autocast makes, in place.

    before: out = wrap_with_autocast("cpu", bfloat16, True, None, submod, x, w); y = out[0]
    after:  a = _to_copy(x, dtype=bfloat16); b = _to_copy(w, dtype=bfloat16); y = mm(a, b)
    The block's sub-graph is traced again (make_fx, on fake tensors of the block's device type)
    under the same autocast, so the result is what autocast computes eagerly, with no context
    manager left for the regions to run under. A CUDA autocast captured where torch has no
    CUDA is turned off by torch itself (with its warning), as it would be eagerly there: the
    block is captured without casts.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "__name__", "") != "wrap_with_autocast":
            continue
        device_type, dtype, enabled, cache, sub_node, *args = node.args
        sub = getattr(gm, sub_node.target)

        def run(*xs, sub=sub, device_type=device_type, dtype=dtype, enabled=enabled, cache=cache):
            with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                return fx.Interpreter(sub).run(*xs)
        try:
            with FakeTensorMode():
                ins = [torch.empty_strided(a.meta["val"].shape, a.meta["val"].stride(), dtype=a.meta["val"].dtype,
                                           device=device_type) for a in args]
            with fx_traceback.preserve_node_meta():
                traced = make_fx(run, tracing_mode="fake")(*ins)
        except Exception as exc:   # an op of the block that fake tensors of its device type cannot run
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise error("unsupported-model", f"cannot capture the `torch.autocast({device_type!r}, dtype={dtype})` "
                        f"block{_at(node)}: {why}",
                        hint="compute in 16 bits with precision='bf16' on piper.compile instead of autocast "
                             "in forward") from None

        def adjust(n, copied, node=node):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):    # fake tensors of the block's device: as meta, like the rest
                copied.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
            for key in ("custom", "stack_trace"):
                if not copied.meta.get(key) and node.meta.get(key):
                    copied.meta[key] = node.meta[key]

        outputs = _copy_before(graph, node, traced.graph, args, adjust)
        _replace_call(gm, node, sub_node, pytree.tree_leaves(outputs))
    graph.lint()


def inline_grad_islands(gm: fx.GraphModule) -> None:
    """Inline `torch.no_grad()` / `torch.enable_grad()` blocks, in place.

    before: out = wrap_with_set_grad_enabled(False, submod, x); y = out[0]
    after:  a = mul(x, 2); y = detach(a)
    The runtime runs every region with grad enabled, so a no-grad block's
    results are detached: same values, and no gradient flows through them.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name != "wrap_with_set_grad_enabled":
            raise error("unsupported-model", f"forward uses `{name}`{_at(node)}, which Piper cannot capture yet",
                        hint="move that block out of forward, or write it without the context manager")
        enabled, sub_node, *args = node.args
        sub = getattr(gm, sub_node.target)
        custom = node.meta.get("custom")
        if any(n.op not in ("placeholder", "output", "call_function") for n in sub.graph.nodes):
            raise error("unsupported-model", f"a `torch.no_grad()` block{_at(node)} holds a nested "
                        "sub-graph, which Piper cannot capture yet", hint="move that block out of forward")

        def adjust(n, copied, custom=custom):
            if custom and not copied.meta.get("custom"):
                copied.meta["custom"] = dict(custom)

        outputs = _copy_before(graph, node, sub.graph, args, adjust)
        with graph.inserting_before(node):
            results = []
            for value in outputs:
                if not enabled and isinstance(value, fx.Node):
                    detached = graph.call_function(_DETACH, (value,))
                    detached.meta = dict(value.meta)
                    value = detached
                results.append(value)
        _replace_call(gm, node, sub_node, results)
    graph.lint()


def _copy_before(graph: fx.Graph, node: fx.Node, sub_graph: fx.Graph, args, adjust) -> list:
    """Copy `sub_graph`'s ops into `graph` before `node`, its placeholders read as `args`;
    `adjust(op, copy)` fixes each copy's meta. Its outputs as the copies (constants as they are)."""
    env: dict[fx.Node, fx.Node] = dict(zip([n for n in sub_graph.nodes if n.op == "placeholder"], args))
    outputs = ()
    with graph.inserting_before(node):
        for n in sub_graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = n.args[0]
                break
            copied = graph.node_copy(n, lambda a: env[a])
            adjust(n, copied)
            env[n] = copied
    return pytree.tree_map(lambda o: env[o] if isinstance(o, fx.Node) else o, outputs)


def _replace_call(gm: fx.GraphModule, node: fx.Node, sub_node: fx.Node, results: list) -> None:
    """After inlining a higher-order call's sub-graph: its users (each reads `out[i]`) read the
    inlined results, and the call (and the sub-module, once nothing else calls it) goes."""
    graph = gm.graph
    for user in list(node.users):
        assert user.target is __import__("operator").getitem, user.format_node()
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    if not sub_node.users:
        graph.erase_node(sub_node)
        delattr(gm, sub_node.target)


def materialise_constants(graph: fx.Graph, constant_inputs: dict[str, str], constants: dict) -> None:
    """Replace each lifted constant tensor by an op that makes it, in place.

    `constant_inputs` maps placeholder names to the constant's name in
    `constants` (ExportedProgram.constants). An empty tensor (a KV cache's
    `torch.tensor([])`) becomes `aten.empty`; any other constant left here was
    made in forward from Python data on the meta device, which keeps no data
    (capture sends those made on the CPU to the workers as buffers).
    """
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in constant_inputs:
            continue
        target = constant_inputs[node.name]
        value = constants.get(target)
        module = target.rpartition(".")[0] or "the model"
        user = next(iter(node.users), None)
        if not isinstance(value, torch.Tensor) or value.numel() != 0:
            raise error("unsupported-model", f"forward of `{module}` makes a constant tensor "
                        f"(`{target}`{_at(user) if user is not None else ''}) whose values capture cannot see "
                        "(made on the meta device by something other than torch.tensor / torch.as_tensor / "
                        "Tensor.new_tensor)",
                        hint="register it in __init__ with register_buffer(name, tensor, persistent=False), "
                             "make it with torch.tensor(data, device=x.device), or build it with tensor ops "
                             "(torch.arange, torch.full) from the inputs")
        with graph.inserting_before(first):
            made = graph.call_function(torch.ops.aten.empty.memory_format, (list(value.shape),),
                                       {"dtype": value.dtype, "device": torch.device("meta")})
        made.meta = dict(node.meta)
        if user is not None and user.meta.get("custom"):
            made.meta["custom"] = dict(user.meta["custom"])
        node.replace_all_uses_with(made)
        graph.erase_node(node)


def keep_only_loss(graph: fx.Graph, out_spec) -> fx.Node:
    """Make the loss the graph's one output and drop the ops only the rest needed; returns it.

    The loss is the `loss` entry of a ModelOutput or dict, the first element
    of a tuple or list, or the value itself.
    """
    output = next(n for n in graph.nodes if n.op == "output")
    flat = list(output.args[0])
    where = pytree.tree_unflatten(list(range(len(flat))), out_spec) if out_spec is not None else 0
    if isinstance(where, dict) or hasattr(where, "keys") and callable(where.keys):
        if "loss" not in where.keys():
            raise error("bad-model", f"forward returns a mapping without `loss` (keys: {', '.join(map(str, where.keys()))})",
                        hint="pass the labels so the model computes its loss (e.g. model(input_ids=x, labels=y)), "
                             "or return the scalar loss yourself")
        where = where["loss"]
    elif isinstance(where, (tuple, list)) and where:
        where = where[0]
    if not isinstance(where, int) or not isinstance(flat[where], fx.Node) or not isinstance(
            flat[where].meta.get("val"), torch.Tensor) or tuple(flat[where].meta["val"].shape) != ():
        raise error("bad-model", "forward must return one scalar loss (the mean over its batch), alone or as "
                    "the `loss` of what it returns", hint="compute the loss inside forward and return it, as "
                    "nanoGPT does, or return a ModelOutput / dict with `loss`")
    loss = flat[where]
    output.args = ((loss,),)
    graph.eliminate_dead_code()
    return loss
