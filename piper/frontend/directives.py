"""The four statements as data: what a strategy asks for, with where it asked.

Both front ends produce these records: the `.pps` interpreter (spans in the
script) and the `@piper.strategy` recorder (spans at the Python call site).
`piper.ir.statements` applies them to the IR, so there is one code path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..diagnostics import Span
from ..mesh import DeviceGroup
from .selectors import Selector

SHARDABLE = ("batch", "optimizer", "grads", "params", "experts")


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
    """`shard optimizer, grads over dp`: divide each of `what` over mesh axis `over`."""

    what: tuple[str, ...]
    over: str
    span: Span | None = None
    trace: tuple[Span, ...] = field(default=(), compare=False)   # as `Place.trace`


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
