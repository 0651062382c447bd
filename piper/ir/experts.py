"""`shard experts over AXIS` on the driver: find the MoE layers of a captured
program, check the statement against them, and say what each device holds.

A MoE layer is a `piper::moe_dispatch` node in a region graph (`piper.nn.MoE`
or any layer built on `piper.nn.dispatch`); an expert weight is a parameter
fed straight into `piper::expert_mm` (or an expert bias into `piper::expert_bias`). Under `shard experts over dp` member `i`
of each expert group (the devices of a region, ordered along dp) holds rows
`[i * E/n, (i + 1) * E/n)` of every expert weight, with its gradients and
optimizer state; the rest of the model keeps whatever dp/ZeRO says.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..diagnostics import Label, error
from .dag import IR

if TYPE_CHECKING:
    from ..frontend.capture import Program

DISPATCH = "piper.moe_dispatch.default"
EXPERT_MM = "piper.expert_mm.default"
EXPERT_BIAS = "piper.expert_bias.default"


@dataclass(frozen=True)
class MoELayer:
    region: int
    num_experts: int
    source: str | None        # "file:line" of the layer's dispatch


def _op_name(node) -> str:
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is None:
        return ""
    return f"{target.namespace}.{schema.name.split('::')[1]}.{target._overloadname}"


def moe_layers(program: Program) -> list[MoELayer]:
    """Every dispatch in the program's region graphs, in region order."""
    from ..frontend.captured import _stack_line

    layers = []
    for region in program.regions:
        if region.graph is None:
            continue
        for node in region.graph.graph.nodes:
            if node.op == "call_function" and _op_name(node) == DISPATCH:
                layers.append(MoELayer(region.index, int(node.args[2]), _stack_line(node)))
    return layers


def expert_params(program: Program) -> dict[str, int]:
    """Expert weight name -> its number of experts (dim 0), for weights (and biases) fed straight
    into expert_mm (expert_bias)."""
    from ..frontend.capture import PARAM

    found: dict[str, int] = {}
    for region in program.regions:
        if region.graph is None:
            continue
        placeholders = [n for n in region.graph.graph.nodes if n.op == "placeholder"]
        ref = {p: inp for p, inp in zip(placeholders, region.inputs)}
        for node in region.graph.graph.nodes:
            if node.op == "call_function" and _op_name(node) in (EXPERT_MM, EXPERT_BIAS):
                weight = node.args[2]
                inp = ref.get(weight)
                if inp is not None and inp.kind == PARAM:
                    found[inp.ref] = program.params[inp.ref].shape[0]
    return found


def _axis_hint(axis: str, batch: tuple) -> str:
    """What to change when the experts' axis is not the batch's one axis. Where the batch is sharded,
    its axis is the data-parallel one, so the experts move to it (sharding the batch over the experts'
    axis instead would be wrong where that axis is the pipeline's)."""
    why = "expert parallelism sends each data-parallel replica's tokens to the replica holding their expert"
    if len(batch) == 1:
        return (f"shard the experts over `{batch[0]}`, the axis the batch is sharded over (`use expert_parallel() "
                f"on {batch[0]}`, or `shard experts over {batch[0]}`): {why}")
    if axis in batch:
        others = ", ".join(f"`{a}`" for a in batch if a != axis)
        return f"shard the batch over `{axis}` alone (drop its sharding over {others}): {why}"
    if batch:
        return (f"shard the batch over one axis alone and the experts over the same one (e.g. `use dp() on "
                f"{batch[0]}` and `use expert_parallel() on {batch[0]}`): {why}")
    return f"shard the batch over `{axis}` too (`use dp() on {axis}`, or `shard batch over {axis}`): {why}"


def check(program: Program, ir: IR) -> None:
    """Errors for a `shard experts` the program cannot take (none without the statement).

    Abstract programs (`--regions PP=4`, no graphs) have no layers to check.
    """
    axis = ir.sharded("experts")
    if axis is None:
        return
    span = ir.sharding_span("experts")
    batch = ir.batch_axes()
    if tuple(batch) != (axis,):
        first = ir.sharding_span("batch")
        raise error("unsupported-sharding", f"experts are sharded over `{axis}` but the batch is sharded over "
                    f"{', '.join(f'`{a}`' for a in batch) or 'nothing'}", span=span,
                    labels=(Label(first, "batch sharded here"),) if first else (), hint=_axis_hint(axis, batch))
    if any(r.graph is None for r in program.regions):
        return
    size = ir.mesh.size(axis)
    layers = moe_layers(program)
    if not layers:
        undivided = getattr(program, "undivided_experts", ())
        if undivided:
            raise error("no-experts", f"`shard experts over {axis}` but no experts module of the model can be "
                        f"divided: {undivided[0]}" + (f" (and {len(undivided) - 1} more)" if len(undivided) > 1
                                                      else ""), span=span,
                        notes=("Piper divides transformers' experts modules that run one of the library's own "
                               "implementations ('eager', 'grouped_mm', 'batched_mm') on stacked weights",),
                        hint="set `config._experts_implementation = \"eager\"` (or leave it unset), or drop the "
                             "statement")
        raise error("no-experts", f"`shard experts over {axis}` but the model has no MoE layer", span=span,
                    notes=("a MoE layer is a piper.nn.MoE, a layer that calls piper.nn.dispatch/combine, or a "
                           "Hugging Face MoE family's experts module",),
                    hint="drop the statement, or build the feed-forward with piper.nn.MoE")
    for layer in layers:
        if layer.num_experts % size:
            where = f" (at {layer.source})" if layer.source else ""
            raise error("indivisible-experts", f"a MoE layer in region {ir.regions[layer.region].label}{where} has "
                        f"{layer.num_experts} experts, which do not divide over `{axis}` of size {size}",
                        span=span,
                        hint=f"use a multiple of {size} experts, or shard them over an axis whose size divides "
                             f"{layer.num_experts}")
    for name, experts in expert_params(program).items():
        if experts % size:
            raise error("indivisible-experts", f"expert weight `{name}` has {experts} experts, which do not divide "
                        f"over `{axis}` of size {size}", span=span,
                        hint=f"use a multiple of {size} experts")


def groups(ir: IR) -> tuple[tuple[int, ...], ...]:
    """The expert groups: each region's devices, ordered along the experts' axis."""
    axis = ir.sharded("experts")
    if axis is None:
        return ()
    mesh = ir.mesh
    found = []
    for r in ir.regions:
        for devices in _by_tensor_index(ir, ir.devices_of(r.index)):
            ranks = tuple(sorted(devices, key=lambda rank: mesh.coords(rank)[axis]))
            if ranks not in found:
                found.append(ranks)
    return tuple(found)


def _by_tensor_index(ir: IR, devices) -> list[tuple[int, ...]]:
    """`devices` split by tp index (one part without tensor parallelism): the devices at one tp
    index compute the same tokens, so each tp index has expert groups of its own."""
    tensor = ir.tensor_axis()
    if tensor is None:
        return [tuple(devices)]
    parts: dict[int, list[int]] = {}
    for rank in devices:
        parts.setdefault(ir.mesh.coords(rank)[tensor], []).append(rank)
    return [tuple(parts[i]) for i in sorted(parts)]


def holdings(program: Program, ir: IR, rank: int) -> dict[int, dict[str, tuple[int, int]]]:
    """Unit (owner region) -> expert weight -> the rows `[lo, hi)` of dim 0 this rank holds."""
    axis = ir.sharded("experts")
    if axis is None:
        return {}
    out: dict[int, dict[str, tuple[int, int]]] = {}
    for name, experts in expert_params(program).items():
        owner = program.owner(name)
        devices = ir.devices_of(owner)
        if rank not in devices:
            continue
        devices = next(part for part in _by_tensor_index(ir, devices) if rank in part)
        ranks = sorted(devices, key=lambda r: ir.mesh.coords(r)[axis])
        per = experts // len(ranks)
        i = ranks.index(rank)
        out.setdefault(owner, {})[name] = (i * per, (i + 1) * per)
    return out


def slots_lanes(job) -> int:
    """How many lanes the job's overlapped slots can run at once (1: every item in turn)."""
    if not job.concurrent:
        return 1
    lanes = getattr(job, "_expert_lanes", None)     # the same for every rank: computed once per job
    if lanes is None:
        lanes = job._expert_lanes = max([len(slot) for slots in job._multi_slots().values() for slot in slots] + [1])
    return lanes


def expert_state(ir: IR, program: Program, weights: dict[str, int], shards: dict) -> dict:
    """Full expert weights from every rank's rows (`Job.state_dict`)."""
    import torch

    axis = ir.sharded("experts")
    out = {}
    for name in weights:
        devices = _by_tensor_index(ir, ir.devices_of(program.owner(name)))[0]
        ranks = sorted(devices, key=lambda r: ir.mesh.coords(r)[axis])
        out[name] = torch.cat([shards[r]["experts"][name] for r in ranks])
    return out


def moe_regions(program: Program) -> dict[int, int]:
    """Region -> how many MoE layers it holds."""
    out: dict[int, int] = {}
    for layer in moe_layers(program):
        out[layer.region] = out.get(layer.region, 0) + 1
    return out
