"""Tensor parallelism's statements on the IR: `shard columns|rows|vocab of "PATTERN", ... over AXIS`
and `shard sequence over AXIS`, as records and the checks that need the whole strategy.

`piper.ir.statements.shard` calls these; nothing here inserts communication (lowering does).
"""
from __future__ import annotations

from ..diagnostics import Label, Span, error
from ..frontend.directives import TENSOR_PARALLEL, Shard
from .dag import IR

# The hint of every axis clash: tensor parallelism divides within a layer, the others across copies.
OWN_AXIS = "TP needs an axis of its own: mesh dp=2, tp=2"
# What a clash of a tensor-parallel axis with another sharding means, by the other's name.
_OTHER = {"batch": "the batch", "optimizer": "ZeRO's optimizer state", "grads": "ZeRO's gradients",
          "params": "ZeRO's parameters", "experts": "the experts"}


def check_axes(records: list[tuple[str, str]], spans: list[Span | None], what: str, axis: str,
               span: Span | None) -> None:
    """Refuse `shard WHAT over AXIS` next to `records` (with their `spans`) where the axes clash.

    All tensor-parallel kinds use one axis, and that axis is none of the batch's, ZeRO's or the
    experts': `unsupported-sharding` (with the first statement labelled) otherwise.
    """
    for (other, other_axis), other_span in zip(records, spans):
        labels = (Label(other_span, f"`{other}` sharded over `{other_axis}` here"),) if other_span else ()
        if what in TENSOR_PARALLEL and other in TENSOR_PARALLEL and other_axis != axis:
            raise error("unsupported-sharding", f"`{what}` over `{axis}` but `{other}` over `{other_axis}`: "
                        "tensor parallelism divides over one axis", span=span, labels=labels,
                        hint=f"shard columns, rows, vocab and sequence over one axis (`over {other_axis}`)")
        if other_axis == axis and (what in TENSOR_PARALLEL) != (other in TENSOR_PARALLEL):
            tp, rest = (what, other) if what in TENSOR_PARALLEL else (other, what)
            raise error("unsupported-sharding", f"`{tp}` is sharded over `{axis}`, the axis of "
                        f"{_OTHER.get(rest, f'`{rest}`')}", span=span, labels=labels, hint=OWN_AXIS)


def add_patterns(ir: IR, d: Shard) -> tuple[tuple[str, str, Span | None], ...]:
    """`ir.tensor_patterns` with those of `d` added; a pattern already sharded is `sharded-twice`.

    One module is divided one way: a pattern both columns and rows (or listed twice) is refused,
    with both statements' spans.
    """
    if not d.of:
        return ir.tensor_patterns
    (kind,) = d.what            # `shard_problem` vouched for it: `of` goes with one kind alone
    spans = d.of_spans if len(d.of_spans) == len(d.of) else (d.span,) * len(d.of)
    known = {pattern: (k, span) for k, pattern, span in ir.tensor_patterns}
    added = []
    for pattern, span in zip(d.of, spans):
        if pattern in known:
            first_kind, first = known[pattern]
            both = f"as `{kind}` twice" if first_kind == kind else f"both as `{first_kind}` and as `{kind}`"
            raise error("sharded-twice", f'"{pattern}" is sharded {both}', span=span or d.span,
                        labels=(Label(first, f"`{first_kind}` here"),) if first else (),
                        hint="divide each module one way, in one `shard` statement"
                        if first_kind != kind else "list each pattern once")
        added.append((kind, pattern, span or d.span))
    return ir.tensor_patterns + tuple(added)


def check_sequence(ir: IR) -> None:
    """`shard sequence` needs tensor-parallel regions (columns or rows) to run between: checked once
    every statement has run, as statements come in any order."""
    if ir.sharded("sequence") is None or ir.sharded("columns") is not None or ir.sharded("rows") is not None:
        return
    axis = ir.sharded("sequence")
    raise error("sequence-without-tp", f"`shard sequence over {axis}` without tensor parallelism: no "
                "`shard columns` or `shard rows` names the modules it runs between",
                span=ir.sharding_span("sequence"),
                hint=f'add `shard columns of "..." over {axis}` and `shard rows of "..." over {axis}`, or drop '
                     "`shard sequence`")
