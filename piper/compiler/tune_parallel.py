"""`piper tune`'s tensor, sequence and expert parallelism: the `--tensor-parallel` flag checked before
the search, the scripts' lines that use a plan, what a MoE layer's all-to-alls move, and why
candidates were skipped.

    check_tensor_flag("examples/train_hf.py:tiny_llama", "llama_tensor_parallel")   # -> SP searchable?
    tensor_lines("llama_tensor_parallel", ["mesh tp=2"], sequence=True)
        # ['mesh tp=2', 'use llama_tensor_parallel(sequence=true) on tp']

A flag value tune cannot use (no such strategy, a malformed `FILE.pps:NAME`, a strategy that divides
no module, a pattern that matches no module of the model) is an error before anything is measured;
a size the plan cannot divide (heads, vocabulary, experts) skips that size's candidates with the
reason, which tune prints (`skip_summary`).
"""
from __future__ import annotations

import os
import re
from dataclasses import replace

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
EXPERT_CODES = ("indivisible-experts", "no-experts", "unsupported-sharding")   # `shard experts`'s own errors


def tensor_lines(tensor: str, lines: list[str], *, sequence: bool = False) -> list[str]:
    """`lines` using the tensor-parallel plan `tensor` on tp: a standard strategy's name, or
    `FILE.pps:NAME` (imported by its path from the working directory, as a script there would);
    `sequence`: with `sequence=true` (sequence parallelism)."""
    args = "sequence=true" if sequence else ""
    path, _, name = tensor.rpartition(":")
    if path.endswith(".pps"):
        return [f'import "{os.path.relpath(path)}"', *lines, f"use {name}({args}) on tp"]
    return [*lines, f"use {tensor}({args}) on tp"]


def tensor_plan(tp: int, tensor: str | None, *, sequence: bool = False):
    """The `TensorPlan` of `use TENSOR() on tp` on a mesh with tp devices (None for tp 1)."""
    if tp <= 1:
        return None
    return _plan(tensor, tp, sequence)


def _plan(tensor: str, tp: int, sequence: bool):
    from ..dsl import load_strategy
    from ..frontend.tensor_parallel import plan_of
    from .planning import build_strategy

    text = "\n".join(tensor_lines(tensor, [f"mesh tp={tp}"], sequence=sequence)) + "\n"
    mesh, directives = build_strategy(load_strategy(text, file="<tune>"), None)
    return plan_of(directives, mesh)


def check_tensor_flag(model_spec: str, tensor: str) -> str | None:
    """Raise `bad-flag` (or the plan's own error, `unknown-module` for a pattern that matches
    nothing) where `--tensor-parallel tensor` cannot divide the model at any size; else why
    sequence parallelism is not searched (None: it is, as `use TENSOR(sequence=true) on tp`).

    The modules are checked on a meta copy of the model at size 1, where every size's
    divisibility holds: what fails there fails at every size."""
    from ..diagnostics import PiperError, clip, error

    path, colon, name = tensor.rpartition(":")
    if colon and not (path.endswith(".pps") and _NAME.match(name)) or not colon and not _NAME.match(tensor):
        raise error("bad-flag", f"--tensor-parallel takes a strategy's name or FILE.pps:NAME, not {clip(tensor)!r}",
                    hint="e.g. --tensor-parallel llama_tensor_parallel, or --tensor-parallel my_plans.pps:my_tp")
    try:
        plan = _plan(tensor, 2, False)
    except PiperError as err:
        first = err.diagnostics[0]
        raise error("bad-flag", f"--tensor-parallel {clip(tensor)}: {first.message}",
                    notes=tuple(d.message for d in err.diagnostics[1:]),
                    hint="name a tensor-parallel strategy: a standard one (llama_tensor_parallel) or "
                         "FILE.pps:NAME, a strategy of that file whose statements shard columns, rows or vocab "
                         "over its axis") from None
    if plan is None or not plan.patterns:
        raise error("bad-flag", f"--tensor-parallel {clip(tensor)} divides no module over tp: it has no "
                    "`shard columns/rows/vocab of ...` statement",
                    hint="name a tensor-parallel plan, e.g. llama_tensor_parallel, or write one "
                         "(docs/tensor_parallel.md)")
    _check_modules(model_spec, replace(plan, size=1))
    try:
        with_sequence = _plan(tensor, 2, True)
    except PiperError as err:
        return err.diagnostics[0].message
    if plan.sequence:
        return f"{tensor} always shards the sequence: its candidates are sequence-parallel already"
    if with_sequence is None or not with_sequence.sequence:
        return f"{tensor}(sequence=true) does not shard the sequence"
    return None


def _check_modules(model_spec: str, plan) -> None:
    """`plan`'s patterns and module checks against a meta copy of the model (its own errors)."""
    from ..frontend.capture import _meta_copy
    from ..frontend.models import load_model
    from ..frontend.tensor_parallel import apply

    model, _ = load_model(model_spec)
    apply(_meta_copy(model), plan)


# ---- expert parallelism's all-to-alls --------------------------------------------------------------------


def moe_bytes(program) -> dict[int, tuple[float, ...]]:
    """Region -> per MoE layer (its `piper::moe_dispatch`, in graph order), the bytes of the routed
    rows (tokens x top_k rows of the layer's width): what its dispatch and its combine each move,
    of which (n - 1)/n leaves a device of an expert group of n."""
    from ..ir.experts import DISPATCH, _op_name

    out: dict[int, tuple[float, ...]] = {}
    for region in program.regions:
        if region.graph is None:
            continue
        sizes = []
        for node in region.graph.graph.nodes:
            if node.op == "call_function" and _op_name(node) == DISPATCH:
                x, experts = (getattr(a, "meta", {}).get("val") for a in node.args[:2])
                if x is None or experts is None or not x.dim():
                    continue
                sizes.append(float(x.element_size() * (x.numel() // max(1, x.shape[0])) * experts.numel()))
        if sizes:
            out[region.index] = tuple(sizes)
    return out


def with_all_to_alls(comm, moe: dict, *, scale: float, bandwidth: float):
    """`comm` (`simulate`'s comm_cost) with each MoE exchange priced by its rows' bytes
    (`moe_bytes`, times `scale` for another microbatch size) over `bandwidth`: an exchange between
    pieces (`0ALL_TO_ALL_F3.1`) the mean of its region's layers, a pass's marker for all of them
    (not cut) each layer's dispatch and combine."""
    def cost(node) -> float:
        layers = moe.get(node.region) if node.op == "ALL_TO_ALL" else None
        if not layers:
            return comm(node)
        n = len(node.devices or ()) or 1
        rows = sum(layers) / len(layers) if node.value is not None else 2 * sum(layers)
        return rows * scale * (n - 1) / n / bandwidth

    return cost


# ---- skipped candidates ----------------------------------------------------------------------------------


def skip_summary(skipped, *, no_sequence: str | None = None) -> list[dict]:
    """`Search.skipped`'s (candidate, reason, what) as one entry per what was skipped and why,
    in the order first met: {"what": "tp=4", "reason": ..., "candidates": 10}; `no_sequence`
    (`Search.no_sequence`): why sequence parallelism was not searched, an entry of no candidates."""
    out: dict[tuple, dict] = {}
    for _, reason, what in skipped:
        entry = out.setdefault((what, reason), {"what": what, "reason": reason, "candidates": 0})
        entry["candidates"] += 1
    found = list(out.values())
    if no_sequence:
        found.append({"what": "sequence parallelism", "reason": no_sequence, "candidates": 0})
    return found


def skip_lines(summary: list[dict]) -> list[str]:
    """`skip_summary`'s entries as the lines tune prints under its table.

        skipped tp=4 (10 candidates): `embed` has 61 vocabulary rows, which do not divide over `tp` of size 4
    """
    return [f"not searched: {s['what']}: {s['reason']}" if not s["candidates"] else
            f"skipped {s['what']} ({s['candidates']} candidate{'s' if s['candidates'] != 1 else ''}): {s['reason']}"
            for s in summary]
