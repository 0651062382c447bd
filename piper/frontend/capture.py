"""Capture: a model's forward, traced by TorchDynamo on the meta device and cut
into regions by `piper.annotate` tags.

The result is a `Program`: the regions in trace order, each a small fx graph
whose inputs are parameters, buffers, batch inputs and values made by other
regions (any number of them, so skip connections just work).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from dataclasses import replace

from .annotate import reset_counters
from ..diagnostics import PiperError, error
from .frames import last_user_frame
from .captured import (BATCH, BUFFER, MAX_REGIONS, PARAM, VALUE, Program, Region, RegionInput, TensorSpec,  # noqa: F401
                       Value, _mutation_error, _stack_line, fx, torch)
from .model_checks import check_layers


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


@contextlib.contextmanager
def _quiet_torch_logs():
    """Torch's own error logs of a failed trace off: for a first try whose failure capture answers
    by trying another way (they would read as an error of a capture that then succeeds)."""
    loggers = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor", "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export(model, example_inputs, names=(), tensor=None):
    from .exported import python_data_on_cpu

    reset_counters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with python_data_on_cpu():       # `torch.tensor(data, device=x.device)` keeps its values
                if names:
                    return torch.export.export(model, (), dict(zip(names, example_inputs)), strict=True)
                return torch.export.export(model, tuple(example_inputs), strict=True)
        except Exception as exc:  # Dynamo raises many types; all mean "cannot capture"
            text = str(exc)
            where = last_user_frame(text)     # where the user's code broke
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
            if tensor is not None:
                raise _tensor_capture_error(_shape_line(text) or first, where or _real_frame(exc), tensor) from None
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


def _prepared_copy(model: torch.nn.Module):
    """The meta copy export traces, without a KV cache and with Piper's experts: (copy, the
    experts modules left undivided)."""
    from .hf_experts import use_piper_experts

    meta_model = _meta_copy(model)
    _no_kv_cache(meta_model)
    return meta_model, use_piper_experts(meta_model)


def _export_divided(model, meta_inputs, names, tensor):
    """Export the meta copy divided over tp as `tensor` says: (exported, layout, undivided experts),
    the graphs with their TP collectives merged and the vocab loss on shards."""
    from . import tensor_parallel, vocab_loss

    meta_model, undivided = _prepared_copy(model)
    layout = tensor_parallel.apply(meta_model, tensor)
    try:
        with _quiet_torch_logs() if tensor.sequence else contextlib.nullcontext():
            exported = _export(meta_model, meta_inputs, names, tensor)
    except PiperError as err:
        if not tensor.sequence or err.code != "tp-capture":
            raise
        # SP from the embedding did not trace (Hugging Face models make positions and the causal
        # mask from the embedding's output): begin the sequence shards at the first block instead.
        meta_model, undivided = _prepared_copy(model)
        layout = tensor_parallel.apply(meta_model, tensor, from_block=True)
        if layout.sequence_from is None:
            raise
        try:
            exported = _export(meta_model, meta_inputs, names, tensor)
        except PiperError:
            raise err from None
    tensor_parallel.merge_copies(exported.graph_module)
    vocab_loss.rewrite(exported.graph_module)
    if tensor.size == 1:           # nothing to exchange: the collectives are identities that cost a dispatch
        from .unit_collectives import drop_unit_collectives
        drop_unit_collectives(exported.graph_module)
    return exported, layout, undivided


def capture(model: torch.nn.Module, example_inputs, names: tuple[str, ...] = (), tensor=None) -> Program:
    """Trace `model(*example_inputs)` on the meta device and cut it into regions.

    `tensor` (a `tensor_parallel.TensorPlan`) divides the matched modules over tp first:
    the program then holds one device's shapes and the collectives (`program.tensor`).

    `example_inputs` must already have the microbatch shape the regions will
    run with: export specialises shapes into the graph. With `names`, forward
    is called with keywords instead: `model(**dict(zip(names, example_inputs)))`.
    """
    if not isinstance(model, torch.nn.Module):
        raise error("bad-model", f"piper.compile needs a torch.nn.Module, not {type(model).__name__}")
    check_layers(model)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            what = f"`{names[i]}`" if names else str(i)
            raise error("bad-inputs", f"example input {what} is a {type(x).__name__}, not a tensor",
                        hint="forward takes the batch as tensors, e.g. (idx, targets), and returns the loss")
    meta_inputs = tuple(x.detach().to("meta") for x in example_inputs)
    if tensor is None:
        meta_model, undivided = _prepared_copy(model)
        exported, layout = _export(meta_model, meta_inputs, names), None
    else:
        exported, layout, undivided = _export_divided(model, meta_inputs, names, tensor)
    program = _cut(exported, model)
    program.input_names = tuple(names)
    program.undivided_experts = undivided
    if layout is not None:
        from .tensor_gradients import summed
        from .tensor_traffic import read_moves, read_traffic

        moves = read_moves(program, layout.size)
        program.tensor = replace(layout, summed=summed(program, layout.dims), exchanges=moves,
                                 traffic=read_traffic(moves))
    return program


def _shape_line(text: str) -> str | None:
    """The line of a capture error that says which shape did not fit (Dynamo puts it below its own)."""
    for line in text.splitlines():
        if "shape" in line and ("invalid" in line or "mismatch" in line or "must match" in line):
            return line.strip().removeprefix("Explanation:").strip()
    return None


def _real_frame(exc) -> str | None:
    """"file:line" of the user's frame Dynamo was tracing when it failed (`exc.real_stack`)."""
    import os

    stack = getattr(exc, "real_stack", None) or ()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in stack if not os.path.abspath(f.filename).startswith((here, os.path.dirname(torch.__file__)))]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _tensor_capture_error(first: str, where: str | None, tensor):
    """Capture failed with the model divided over tp: most often a reshape to a whole size."""
    return error(
        "tp-capture", f"cannot capture the model divided over `{tensor.axis}` (size {tensor.size}): {first}"
        + (f" (at {where})" if where else ""),
        notes=("under tensor parallelism each device's modules compute on its shards: a columns module's output "
               "holds out_features / tp features, and under `shard sequence` the activations between a rows "
               "module and the next columns module hold sequence / tp positions",),
        hint="reshape with -1 where a size is divided (`view(B, T, -1, head_dim)`, not `view(B, T, n_head, ...)` "
             "with a size computed from the whole layer), and under `shard sequence` shard the embedding and "
             "the output layer with `shard vocab` so the sequence shards begin and end there")


def _no_kv_cache(model: torch.nn.Module) -> None:
    """Training never reads a KV cache: turn it off in Hugging Face configs
    (of the meta copy only), so forward returns no cache object."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False


def _cut(exported, model) -> Program:
    """The exported forward -> a Program: its inputs sorted by kind, its ops assigned to
    regions, each region's ops in a graph of its own (`capture_inputs`, `region_graphs`)."""
    from .capture_inputs import check_in_place_updates, read_inputs
    from .region_graphs import region_graph, region_values

    gm = exported.graph_module
    graph = gm.graph
    mutated = [s.target for s in exported.graph_signature.output_specs if s.kind.name != "USER_OUTPUT"]
    if mutated:
        raise _mutation_error(model, mutated[0])
    found = read_inputs(exported)
    from .causal_masks import causal_attention
    from .repeated_heads import repeated_heads
    from .exported import inline_autocast, inline_grad_islands, keep_only_loss, materialise_constants

    inline_autocast(gm)
    inline_grad_islands(gm)
    materialise_constants(graph, found.constant_inputs, exported.constants)
    check_in_place_updates(graph, found.kind_of, model)
    loss_node = keep_only_loss(graph, exported.call_spec.out_spec)
    causal_attention(graph)
    repeated_heads(graph)           # after the masks: only unmasked attention takes enable_gqa

    compute = [n for n in graph.nodes if n.op == "call_function"]
    # Export adds shape asserts with no users; they carry no data, so drop them.
    compute = [n for n in compute if n.users or "assert" not in str(n.target)]
    for n in compute:
        for k, v in (n.meta.get("custom") or {}).items():
            if not isinstance(v, int):
                raise error("bad-annotation", f"annotation {k}={v!r} is not a region index",
                            hint="use piper.annotate(\"PP\"), which numbers regions for you")
    order, region_of, joined = assign_regions(compute)
    _check_group_order(model, compute)
    tag_of = {n: order[region_of[n]] for n in compute}
    needs_grad = _needs_grad(graph, found.kind_of)
    value_ids, region_outputs, values = region_values(compute, region_of, tag_of, needs_grad, len(order))
    member = {r: [n for n in compute if region_of[n] == r] for r in range(len(order))}
    regions = [region_graph(r, tags, member[r], region_of=region_of, kind_of=found.kind_of, value_ids=value_ids,
                            outputs=region_outputs[r], joined=joined, loss_node=loss_node)
               for r, tags in enumerate(order)]
    return Program(tuple(regions), tuple(values), found.params, found.buffers, tuple(found.batch),
                   constants=found.constants, annotated=any(n.meta.get("custom") for n in compute))


def assign_regions(compute: list[fx.Node]):
    """Every op's region: its annotation's, or by the outside-region rule.

    An op outside every `piper.annotate` block (rotary tables, masks, the loss
    after the head) joins the region that first uses its result; with no user
    in a region, the last region that fed it. An op computed from the batch
    alone joins its first user once that is known (an op fed by nothing and
    used by nothing joins the first region). A model without annotations is one
    region, PP=0. Returns (the regions' tags in trace order, op -> region,
    op -> why it joined, for ops outside every block).
    """
    if not any(n.meta.get("custom") for n in compute):
        return [(("PP", 0),)], {n: 0 for n in compute}, {}
    order: list[tuple] = []
    for n in compute:
        tags = tuple((n.meta.get("custom") or {}).items())
        if tags and tags not in order:
            order.append(tags)
    rank = {tags: i for i, tags in enumerate(order)}
    region_of: dict[fx.Node, int] = {}
    joined: dict[fx.Node, str] = {}
    for n in compute:
        if n.meta.get("custom"):
            region_of[n] = rank[tuple(n.meta["custom"].items())]
    for n in reversed(compute):           # users come later in the trace: walk back
        if n in region_of:
            continue
        used = [region_of[u] for u in n.users if u in region_of]
        if used:
            region_of[n] = min(used)
            joined[n] = "first user"
    for n in compute:                      # producers come earlier: walk forward
        fed = [region_of[a] for a in n.all_input_nodes if a in region_of]
        if n not in region_of:
            if fed:
                region_of[n] = max(fed)
                joined[n] = "last producer"
        elif n in joined and fed and max(fed) > region_of[n]:
            label = " ".join(f"{k}={v}" for k, v in order[region_of[n]])
            later = " ".join(f"{k}={v}" for k, v in order[max(fed)])
            where = _stack_line(n)
            raise error("unannotated-compute",
                        f"`{n.target}` runs outside every piper.annotate region"
                        + (f" (at {where})" if where else "")
                        + f" and is first used by region {label} but fed by the later region {later}, "
                          "so it can join neither",
                        hint="wrap that code in the `piper.annotate` block of the region that should run it")
    for n in reversed(compute):            # fed by inputs alone (targets.flatten()): the first user, now known
        if n not in region_of:
            used = [region_of[u] for u in n.users if u in region_of]
            region_of[n] = min(used, default=0)
            joined[n] = "first user" if used else "no producer or user"
    return order, region_of, joined


def _needs_grad(graph: fx.Graph, kind_of: dict[str, RegionInput]) -> set[fx.Node]:
    """The nodes a gradient flows through: those computed from parameters, except
    detached results (a no-grad block's) and integer or boolean tensors."""
    out: set[fx.Node] = set()
    no_grad_ops = (torch.ops.aten.detach.default, torch.ops.aten.detach_.default)
    for n in graph.nodes:
        if n.op == "placeholder":
            if kind_of.get(n.name, RegionInput(BATCH, 0)).kind == PARAM:
                out.add(n)
        elif n.op == "call_function" and n.target not in no_grad_ops and any(a in out for a in n.all_input_nodes):
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype.is_complex:
                out.add(n)
    return out



def _check_group_order(model, compute: list[fx.Node]) -> None:
    """`annotate_modules` groups must run in their order: group i's first op before group i+1's."""
    from .modules import module_groups

    for tag, groups in module_groups(model).items():
        seen: list[int] = []
        for n in compute:
            index = (n.meta.get("custom") or {}).get(tag)
            if index is not None and index not in seen:
                if seen and index < seen[-1]:
                    later = seen[-1]
                    raise error("group-order", f"group {later} of `{tag}` runs before group {index} in forward "
                                f"(`{groups[later][0]}` before `{groups[index][0]}`)",
                                notes=(f"group {index}: {', '.join(groups[index])}",
                                       f"group {later}: {', '.join(groups[later])}"),
                                hint="list the groups in the order forward calls their modules: region "
                                     f"{tag}=i feeds {tag}=i+1")
                seen.append(index)


def describe(program: Program) -> str:
    """Where each op went, as comment lines for `piper show --what ir`:

        # region 0 PP=0: 41 ops (6 joined by the outside-region rule)
        #   arange      aten.arange.default     joined: first user     modeling_llama.py:379
        #   embedding   aten.embedding.default  annotated              modeling_llama.py:372
    """
    lines = []
    for r in program.regions:
        if r.graph is None:
            continue
        ops = [n for n in r.graph.graph.nodes if n.op == "call_function"]
        joined = sum(1 for n in ops if n.meta.get("piper_joined"))
        lines.append(f"# region {r.index} {r.label}: {len(ops)} ops ({joined} joined by the outside-region rule)")
        for n in ops:
            why = n.meta.get("piper_joined")
            where = _stack_line(n) or "-"
            lines.append(f"#   {n.name:<28} {str(n.target):<40} {'joined: ' + why if why else 'annotated':<28} "
                         f"{where}".rstrip())
    return "\n".join(lines) + "\n" if lines else ""
