"""Capture: a model's forward, traced by TorchDynamo on the meta device and cut
into regions by `piper.annotate` tags.

The result is a `Program`: the regions in trace order, each a small fx graph
whose inputs are parameters, buffers, batch inputs and values made by other
regions (any number of them, so skip connections just work).
"""
from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field

from .annotate import reset_counters
from .diagnostics import error
from .lazy import LazyModule
from .model_checks import check_layers

# Imported on first use: planning with `--regions` (Program.chain) never needs torch.
torch = LazyModule("torch")
fx = LazyModule("torch.fx")

# The kinds of region input, in the order a region's graph takes them.
PARAM, BUFFER, BATCH, VALUE = "param", "buffer", "batch", "value"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t) -> "TensorSpec":
        return TensorSpec(tuple(int(s) for s in t.shape), t.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        dtype = getattr(torch, self.dtype) if isinstance(self.dtype, str) else self.dtype
        return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Value:
    """A tensor one region makes and others use. `index` is its position in
    the producer's outputs; `differentiable` says whether a gradient flows back."""

    id: int
    producer: int
    index: int
    consumers: tuple[int, ...]
    spec: TensorSpec
    differentiable: bool


@dataclass(frozen=True)
class RegionInput:
    kind: str            # PARAM | BUFFER | BATCH | VALUE
    ref: str | int       # parameter/buffer name, batch input position, or value id


@dataclass
class Region:
    index: int
    tags: tuple[tuple[str, int], ...]
    inputs: tuple[RegionInput, ...]
    outputs: tuple[int, ...]             # value ids, in graph-output order
    loss: bool                           # the last output is the step's loss
    graph: fx.GraphModule | None = field(default=None, repr=False)
    source: str | None = None            # "file:line" of the region's first op

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(i.ref for i in self.inputs if i.kind == PARAM)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.tags)


@dataclass
class Program:
    regions: tuple[Region, ...]
    values: tuple[Value, ...]
    params: dict[str, TensorSpec]
    buffers: dict[str, TensorSpec]
    batch: tuple[TensorSpec, ...]        # microbatch-sized example inputs

    def owner(self, param: str) -> int:
        """The region that owns a parameter: the first one that uses it."""
        for region in self.regions:
            if param in region.params:
                return region.index
        raise KeyError(param)

    @staticmethod
    def chain(tags: dict[str, int] | str) -> "Program":
        """An abstract chain of regions (`--regions PP=8`) for checking without a model."""
        if isinstance(tags, str):
            name, _, count = tags.partition("=")
            tags = {name.strip(): int(count)}
        (name, count), = tags.items()
        spec = TensorSpec((1,), "float32")   # a torch dtype's name: an abstract chain never loads torch
        values = tuple(Value(i, i, 0, (i + 1,), spec, True) for i in range(count - 1))
        regions = []
        for i in range(count):
            inputs = [RegionInput(PARAM, f"r{i}.weight")]
            inputs += [RegionInput(BATCH, 0)] if i == 0 else [RegionInput(VALUE, i - 1)]
            if i == count - 1:
                inputs.append(RegionInput(BATCH, 1))
            regions.append(Region(i, ((name, i),), tuple(inputs), (i,) if i < count - 1 else (), i == count - 1))
        params = {f"r{i}.weight": spec for i in range(count)}
        return Program(tuple(regions), values, params, {}, (spec, spec))


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A structural copy of `model` whose tensors live on the meta device (no data copied)."""
    memo = {}
    tensors = list(model.parameters()) + list(model.buffers())
    # Plain tensor attributes too, so they reach the "make it a buffer" error rather than a device mismatch.
    tensors += [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
            t, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _user_frame(text: str) -> str | None:
    """The last `File "...", line N` of a Dynamo message: where the user's code broke."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', text)
    frames = [f for f in frames if "/torch/" not in f[0]]
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


def _export(model, example_inputs):
    reset_counters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.export.export(model, tuple(example_inputs), strict=True)
        except Exception as exc:  # Dynamo raises many types; all mean "cannot capture"
            text = str(exc)
            where = _user_frame(text)
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
            raise error(
                "graph-break",
                f"cannot capture the model's forward as one graph: {first}"
                + (f" (at {where})" if where else ""),
                notes=("Piper captures forward with TorchDynamo (strict torch.export) on the meta device; "
                       "data-dependent Python control flow, .item(), printing tensors and unsupported "
                       "library calls break the graph",),
                hint="rewrite that line with tensor operations (torch.where instead of `if`, no .item()), "
                     "or move it out of forward",
            ) from None


def _stack_line(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    frames = [f for f in frames if "/torch/" not in f[0] and "/piper/" not in f[0]]
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


def capture(model: torch.nn.Module, example_inputs) -> Program:
    """Trace `model(*example_inputs)` on the meta device and cut it into regions.

    `example_inputs` must already have the microbatch shape the regions will
    run with: export specialises shapes into the graph.
    """
    if not isinstance(model, torch.nn.Module):
        raise error("bad-model", f"piper.compile needs a torch.nn.Module, not {type(model).__name__}")
    check_layers(model)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise error("bad-inputs", f"example input {i} is a {type(x).__name__}, not a tensor",
                        hint="forward takes the batch as tensors, e.g. (idx, targets), and returns the loss")
    meta_model = _meta_copy(model)
    meta_inputs = tuple(x.detach().to("meta") for x in example_inputs)
    exported = _export(meta_model, meta_inputs)
    return _cut(exported, model)


def _cut(exported, model) -> Program:
    graph = exported.graph
    sig = exported.graph_signature
    kind_of: dict[str, RegionInput] = {}
    params: dict[str, TensorSpec] = {}
    buffers: dict[str, TensorSpec] = {}
    batch: list[TensorSpec] = []
    for spec in sig.input_specs:
        name = spec.arg.name
        kind = spec.kind.name
        node = next(n for n in graph.nodes if n.op == "placeholder" and n.name == name)
        if kind == "PARAMETER":
            kind_of[name] = RegionInput(PARAM, spec.target)
            params[spec.target] = TensorSpec.of(node.meta["val"])
        elif kind == "BUFFER":
            kind_of[name] = RegionInput(BUFFER, spec.target)
            buffers[spec.target] = TensorSpec.of(node.meta["val"])
        elif kind == "USER_INPUT":
            kind_of[name] = RegionInput(BATCH, len(batch))
            batch.append(TensorSpec.of(node.meta["val"]))
        else:
            raise error("unsupported-model", f"forward uses a {kind.lower().replace('_', ' ')} (`{spec.target}`), "
                        "which Piper cannot place yet",
                        hint="make constant tensors buffers of the module (register_buffer)")
    outputs = [s for s in sig.output_specs]
    if any(s.kind.name != "USER_OUTPUT" for s in outputs):
        raise error("unsupported-model", "forward mutates a buffer (e.g. BatchNorm running statistics)",
                    hint="use LayerNorm or freeze the statistics; buffer updates are not supported yet")
    output_node = next(n for n in graph.nodes if n.op == "output")
    results = output_node.args[0]
    if len(results) != 1 or not isinstance(results[0], fx.Node) or tuple(
            results[0].meta["val"].shape) != ():
        raise error("bad-model", "forward must return one scalar loss (the mean over its batch)",
                    hint="compute the loss inside forward and return it alone, as nanoGPT does")
    loss_node = results[0]

    for n in graph.nodes:
        # Export keeps in-place updates of parameters and buffers (BatchNorm statistics, counters) in the graph.
        schema = getattr(n.target, "_schema", None)
        if n.op == "call_function" and schema is not None and schema.is_mutable and n.args \
                and isinstance(n.args[0], fx.Node) and kind_of.get(n.args[0].name, RegionInput(BATCH, 0)).kind in (
                    PARAM, BUFFER):
            where = _stack_line(n)
            raise error("unsupported-model", f"forward updates `{kind_of[n.args[0].name].ref}` in place "
                        f"(`{n.target}`{f' at {where}' if where else ''})",
                        hint="buffer and parameter updates inside forward are not supported yet: use "
                             "LayerNorm instead of BatchNorm, or move the update out of forward")
    compute = [n for n in graph.nodes if n.op == "call_function"]
    # Export adds shape asserts with no users; they carry no data, so drop them.
    compute = [n for n in compute if n.users or "assert" not in str(n.target)]
    tagged = [n for n in compute if n.meta.get("custom")]
    if not tagged:
        tag_of = {n: (("PP", 0),) for n in compute}   # no annotations: one region
    else:
        missing = [n for n in compute if not n.meta.get("custom")]
        if missing:
            where = _stack_line(missing[0])
            raise error("unannotated-compute",
                        f"`{missing[0].target}` runs outside every piper.annotate region"
                        + (f" (at {where})" if where else "")
                        + f"; {len(missing)} op(s) in all",
                        hint="wrap that code in a `with piper.annotate(\"PP\"):` block, or join it "
                             "to the region before or after it")
        tag_of = {}
        for n in compute:
            tags = n.meta["custom"]
            for k, v in tags.items():
                if not isinstance(v, int):
                    raise error("bad-annotation", f"annotation {k}={v!r} is not a region index",
                                hint="use piper.annotate(\"PP\"), which numbers regions for you")
            tag_of[n] = tuple(tags.items())

    order: list[tuple] = []
    for n in compute:
        if tag_of[n] not in order:
            order.append(tag_of[n])
    region_of = {n: order.index(tag_of[n]) for n in compute}
    if loss_node not in region_of:
        raise error("bad-model", "the loss is not computed inside any region",
                    hint="compute the loss inside the last `piper.annotate` block")

    # Values: nodes used by another region.
    value_ids: dict[fx.Node, int] = {}
    consumers: dict[fx.Node, list[int]] = {}
    for n in compute:
        users = sorted({region_of[u] for u in n.users if u in region_of and region_of[u] != region_of[n]})
        if users:
            consumers[n] = users
    member = {r: [n for n in compute if region_of[n] == r] for r in range(len(order))}
    region_outputs: dict[int, list[fx.Node]] = {r: [] for r in range(len(order))}
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
                                val.dtype.is_floating_point or val.dtype.is_complex))
            region_outputs[r].append(n)

    regions = []
    for r, tags in enumerate(order):
        inputs: list[RegionInput] = []
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        external: list[fx.Node] = []
        for n in member[r]:
            for a in n.all_input_nodes:
                if a not in env and (a.op == "placeholder" or region_of.get(a) != r) and a not in external:
                    external.append(a)
        # Order the inputs: params, buffers, batch, values.
        rank = {PARAM: 0, BUFFER: 1, BATCH: 2, VALUE: 3}

        def ref_of(a):
            return kind_of[a.name] if a.op == "placeholder" else RegionInput(VALUE, value_ids[a])

        external.sort(key=lambda a: (rank[ref_of(a).kind], str(ref_of(a).ref)))
        for a in external:
            ph = sub.placeholder(re.sub(r"\W", "_", a.name))
            ph.meta = dict(a.meta)
            env[a] = ph
            inputs.append(ref_of(a))
        for n in member[r]:
            env[n] = sub.node_copy(n, lambda a: env[a])
        outs = [env[n] for n in region_outputs[r]]
        is_loss = region_of[loss_node] == r
        if is_loss:
            outs.append(env[loss_node])
        sub.output(tuple(outs))
        gm = fx.GraphModule(torch.nn.Module(), sub)
        regions.append(Region(r, tags, tuple(inputs), tuple(value_ids[n] for n in region_outputs[r]), is_loss, gm,
                              _stack_line(member[r][0]) if member[r] else None))
    return Program(tuple(regions), tuple(values), params, buffers, tuple(batch))
