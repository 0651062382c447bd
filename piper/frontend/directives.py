"""The four statements as data: what a strategy asks for, with where it asked.

Both front ends produce these records: the `.pps` interpreter (spans in the
script) and the `@piper.strategy` recorder (spans at the Python call site).
`piper.ir.statements` applies them to the IR, so there is one code path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..diagnostics import Diagnostic, Label, Span
from ..mesh import DeviceGroup
from .name_patterns import pattern_problem
from .selectors import Selector

SHARDABLE = ("batch", "optimizer", "grads", "params", "experts", "columns", "rows", "vocab", "sequence")
# Tensor parallelism: the kinds of `shard KIND of "PATTERN", ... over AXIS`, each naming its modules.
# (`sequence`, the fourth tensor-parallel kind, names none: it applies to every tensor-parallel region.)
TENSOR_KINDS = ("columns", "rows", "vocab")
# Everything tensor parallelism divides over its axis: one axis for all of them.
TENSOR_PARALLEL = TENSOR_KINDS + ("sequence",)


@dataclass(frozen=True)
class Split:
    """`split MB into 4` (what="MB", count=4) or `split B into BI, BW` (what="B")."""

    what: str
    count: int | None = None
    span: Span | None = None
    trace: tuple[Span, ...] = field(default=(), compare=False)   # as `Place.trace`


@dataclass(frozen=True)
class Place:
    """`place PP=1 on pp[1]`: the regions `selector` picks run on `group`."""

    selector: Selector
    group: DeviceGroup
    span: Span | None = None
    # The `use` sites the statement ran under, outermost first (for errors and warnings that name the
    # user's `use` line rather than a line of the strategy it ran).
    trace: tuple[Span, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Shard:
    """`shard optimizer, grads over dp`: divide each of `what` over mesh axis `over`.

    `shard columns of "**.q_proj", "**.k_proj" over tp` has what=("columns",) and `of` the module
    patterns (as `piper.annotate_modules`: `*` within one dotted part, `**` across parts);
    `of_spans` parallels `of`, one span per pattern.
    """

    what: tuple[str, ...]
    over: str
    span: Span | None = None
    trace: tuple[Span, ...] = field(default=(), compare=False)   # as `Place.trace`
    of: tuple[str, ...] = ()
    of_spans: tuple = field(default=(), compare=False)


def shard_problem(what: tuple[str, ...], of: tuple[str, ...], span: Span | None = None, *,
                  what_spans: tuple = (), of_spans: tuple = ()) -> Diagnostic | None:
    """What is wrong with `shard WHAT of OF over ...`, as an error pointed at the item at fault
    (`what_spans[i]` or `of_spans[i]` where given, else `span`), or None.

    Both front ends and `piper.ir.statements.shard` call this, each with the spans it has:

        >>> shard_problem(("columns",), ()).code
        'missing-of'
        >>> shard_problem(("columns",), ("**.q_proj",)) is None
        True
    """
    def at(spans: tuple, i: int) -> Span | None:
        return (spans[i] if i < len(spans) else None) or span

    kinds = [i for i, w in enumerate(what) if w in TENSOR_KINDS]
    if len(kinds) > 1:
        a, b = what[kinds[0]], what[kinds[1]]
        return Diagnostic("bad-shard", f"`{a}` and `{b}` in one `shard`: each kind takes its own `of`",
                          span=at(what_spans, kinds[1]),
                          hint=f'write one statement per kind: `shard {a} of "..." over tp` and '
                               f'`shard {b} of "..." over tp`')
    if kinds and not of:
        kind = what[kinds[0]]
        return Diagnostic("missing-of", f"`shard {kind}` needs `of` and the patterns of the modules it divides",
                          span=at(what_spans, kinds[0]), hint=f'write e.g. `shard {kind} of "blocks.*.attn.q" over tp`')
    if of and not kinds:
        if "sequence" in what:
            return Diagnostic("bad-shard", "`shard sequence` takes no `of`: it applies to every tensor-parallel "
                              "region", span=at(of_spans, 0),
                              hint="write `shard sequence over tp`, and name the modules in `shard columns of` "
                                   "and `shard rows of`")
        return Diagnostic("bad-shard", f"`of` names modules for columns, rows or vocab, not for `{what[0]}`",
                          span=at(of_spans, 0), hint=f"drop `of`: `shard {', '.join(what)} over ...` divides whole "
                                                     "states")
    if of and len(what) > 1:
        other = next(i for i, w in enumerate(what) if w not in TENSOR_KINDS)
        return Diagnostic("bad-shard", f"`of` belongs to `{what[kinds[0]]}` alone; `{what[other]}` takes no `of`",
                          span=at(what_spans, other), hint=f"shard `{what[other]}` in a statement of its own")
    for i, pattern in enumerate(of):
        too_long = pattern_problem(pattern, at(of_spans, i))
        if too_long is not None:
            return too_long
        if not pattern.strip():
            return Diagnostic("bad-shard", "an empty pattern matches no module", span=at(of_spans, i),
                              hint='write a module path pattern, e.g. "blocks.*.attn.q" or "**.q_proj"')
        if pattern in of[:i]:
            first = at(of_spans, of.index(pattern))
            return Diagnostic("duplicate-name", f'"{pattern}" is listed twice', span=at(of_spans, i),
                              labels=(Label(first, "first listed here"),) if first else (),
                              hint="list each pattern once")
    return None


@dataclass(frozen=True)
class Order:
    """`order PP=0: F(MB=0); [F(MB=1), B(MB=0)]; ...`.

    `slots` run one after another on the devices holding `selector`'s regions;
    the items inside one slot may overlap. `item_spans` parallels `slots`.
    """

    selector: Selector
    slots: tuple[tuple[Selector, ...], ...]
    span: Span | None = None
    item_spans: tuple[tuple[Span | None, ...], ...] = ()
    trace: tuple[Span, ...] = field(default=(), compare=False)   # as `Place.trace`


@dataclass(frozen=True)
class Recompute:
    """`recompute PP=*`: the regions the selectors pick keep only their inputs in forward
    and run forward again in backward (activation checkpointing)."""

    selectors: tuple[Selector, ...]
    span: Span | None = None
    trace: tuple[Span, ...] = field(default=(), compare=False)   # as `Place.trace`


Directive = Split | Place | Shard | Order | Recompute
