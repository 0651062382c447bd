"""The .pps statements that record directives: `split`, `place`, `shard`, `recompute` and `order` with
its slot lines.

Mixed into `Interpreter`; each `exec_*` checks its statement and emits the record
of `piper.frontend.directives` that the Python API would make.
"""
from __future__ import annotations

from piper.diagnostics import Diagnostic, Label, Span, did_you_mean
from piper.frontend.directives import SHARDABLE, Order, Place, Recompute, Shard, Split, shard_problem

from . import nodes as n
from .outcomes import Stop
from .values import MAX_MICROBATCHES, Env, show


class DirectiveStatements:
    """One method per recording statement; needs the expression, selector and type checks of `Interpreter`."""

    def exec_split(self, stmt: n.Split, env: Env) -> None:
        what = stmt.what.name
        if what == "B":
            names = [p.name if isinstance(p, n.Name) else None for p in stmt.parts]
            if sorted(names, key=str) != ["BI", "BW"]:
                raise self.fail("bad-split", "`split B` cuts backward into `BI, BW` and takes nothing else",
                                stmt.span, hint="write `split B into BI, BW`")
            self.emit(Split("B", None, stmt.span, self.trace))
            return
        if what != "MB":
            raise self.fail("bad-split", f"cannot split `{what}`", stmt.what.span,
                            hint=did_you_mean(what, ["MB", "B"]) or
                            "split the batch (`split MB into 8`) or backward (`split B into BI, BW`)")
        if len(stmt.parts) != 1:
            raise self.fail("wrong-arity", f"`split MB into` takes one number, got {len(stmt.parts)}",
                            stmt.parts[1].span, hint="write `split MB into 8`")
        count = self.int_of(stmt.parts[0], env, "the number of microbatches")
        if isinstance(count, int) and count < 1:
            raise self.fail("value-out-of-range", f"the number of microbatches must be at least 1, not {count}",
                            stmt.parts[0].span, hint="split the batch into 1 or more microbatches")
        if isinstance(count, int) and count > MAX_MICROBATCHES:   # ends the run: its loops go per microbatch
            raise Stop(Diagnostic(
                "value-out-of-range", f"`split MB into {show(count)[:24]}`: a step holds at most "
                f"{MAX_MICROBATCHES:,} microbatches", span=stmt.parts[0].span, trace=self.trace,
                hint="split the batch into fewer, larger microbatches; a pipeline needs a few times its "
                     "stages"))
        if isinstance(count, int):
            self.emit(Split("MB", count, stmt.span, self.trace))

    def exec_place(self, stmt: n.Place, env: Env) -> None:
        selector = self.region(stmt.selector, env)
        axis = self.axis_of(self.value(stmt.axis, env), stmt.axis.span, env, "`place ... on`")
        index = self.int_of(stmt.index, env, "a device index")
        if isinstance(index, int) and index < 0:
            raise self.fail("value-out-of-range", f"device index {index} is negative", stmt.index.span,
                            hint="indices along an axis count from 0")
        if self.mesh is None or not isinstance(axis, str) or not isinstance(index, int):
            return
        size = self.mesh.size(axis)
        if index >= size:
            raise self.fail("value-out-of-range", f"`{axis}[{index}]` is outside the mesh: axis `{axis}` has "
                            f"{size} device{'s' if size != 1 else ''}", stmt.index.span,
                            hint=f"use an index from 0 to {size - 1}, or grow the mesh")
        if selector is not None:
            self.emit(Place(selector, self.mesh[axis][index], stmt.span, self.trace))

    def exec_shard(self, stmt: n.Shard, env: Env) -> None:
        seen: dict[str, Span] = {}
        for item in stmt.what:
            if item.name not in SHARDABLE:
                raise self.fail("bad-shard", f"cannot shard `{item.name}`", item.span,
                                hint=did_you_mean(item.name, SHARDABLE) or f"shard one of {', '.join(SHARDABLE)}")
            if item.name in seen:
                raise self.fail("duplicate-name", f"`{item.name}` is listed twice", item.span,
                                labels=(Label(seen[item.name], "first listed here"),))
            seen[item.name] = item.span
        of = tuple(p.text for p in stmt.of)
        problem = shard_problem(tuple(seen), of, stmt.span, what_spans=tuple(i.span for i in stmt.what),
                                of_spans=tuple(p.span for p in stmt.of))
        if problem is not None:
            raise self.fail(problem.code, problem.message, problem.span, hint=problem.hint, labels=problem.labels)
        axis = self.axis_of(self.value(stmt.over, env), stmt.over.span, env, "`shard ... over`")
        if isinstance(axis, str):
            self.emit(Shard(tuple(seen), axis, stmt.span, self.trace, of, tuple(p.span for p in stmt.of)))

    def exec_recompute(self, stmt: n.Recompute, env: Env) -> None:
        selectors = [self.region(region, env) for region in stmt.regions]
        if all(s is not None for s in selectors):
            self.emit(Recompute(tuple(selectors), stmt.span, self.trace))

    def exec_order(self, stmt: n.Order, env: Env) -> None:
        selector = self.region(stmt.selector, env)
        self._orders.append(([], []))
        try:
            self.exec_block(stmt.body, env.child())
        finally:
            slots, spans = self._orders.pop()
        if selector is not None:
            self.emit(Order(selector, tuple(slots), stmt.span, tuple(spans), self.trace))

    def exec_slots(self, stmt: n.Slots, env: Env) -> None:
        assert self._orders, "slot lines only parse inside an order block"
        slots, spans = self._orders[-1]
        # A script's slots are most of its steps (one per stage and microbatch): plain loops.
        for slot in stmt.slots:
            items, known = [], True
            for item in slot.items:
                selector = self.pass_selector(item, env)
                known &= selector is not None
                items.append(selector)
            if known:
                slots.append(tuple(items))
                spans.append(self.slot_spans(slot))

    def slot_spans(self, slot: n.Slot) -> tuple:
        """The spans of a slot's items: the same each time its line runs, so made once per run."""
        spans = self.spans_of_slots.get(id(slot))
        if spans is None:
            spans = self.spans_of_slots[id(slot)] = (slot, tuple([item.span for item in slot.items]))
        return spans[1]

    def emit(self, directive) -> None:
        if not self.abstract:
            self.directives.append(directive)
