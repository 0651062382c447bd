"""`@piper.strategy`: a strategy written as a Python function.

The function receives a builder `s` and calls one method per statement; each
call records a directive with the caller's file and line, exactly the records
the `.pps` interpreter makes, so both forms build the identical IR.

    @piper.strategy
    def zero3(s, axis="dp"):
        s.shard("batch", over=axis)
        s.shard("optimizer", "grads", "params", over=axis)
"""
from __future__ import annotations

import functools
import inspect
import sys

from ..diagnostics import PiperError, Span, did_you_mean, error
from .directives import SHARDABLE, Directive, Order, Place, Recompute, Shard, Split, shard_problem
from ..mesh import DeviceGroup, Mesh
from .selectors import parse_selector


def _patterns(of, span: Span | None) -> tuple[str, ...]:
    """`of=` as a tuple of patterns: None -> (), "a" -> ("a",), ["a", "b"] -> ("a", "b")."""
    if of is None:
        return ()
    items = (of,) if isinstance(of, str) else of
    try:
        items = tuple(items)
    except TypeError:
        items = (of,)
    for item in items:
        if not isinstance(item, str):
            raise error("wrong-type", f"`of=` takes module path patterns (strings), got {item!r}", span=span,
                        hint='write e.g. of=["blocks.*.attn.q", "blocks.*.attn.k"]')
    return items


def _caller_span() -> Span | None:
    """The user's call site: the first frame outside this file."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return None
    info = inspect.getframeinfo(frame, context=0)
    pos = getattr(info, "positions", None)
    if pos is not None and pos.lineno is not None:
        return Span(info.filename, pos.lineno, (pos.col_offset or 0) + 1,
                    pos.end_lineno or pos.lineno, (pos.end_col_offset or 0) + 1)
    return Span(info.filename, info.lineno, 1, info.lineno, 1)


class Builder:
    """What a strategy function calls. `s.mesh` is the job's mesh."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.directives: list[Directive] = []

    def size(self, axis: str) -> int:
        """The size of mesh axis `axis` (`size(pp)` in the language)."""
        return self.mesh.size(axis)

    def split(self, what: str, count: int | None = None) -> None:
        """`s.split("MB", 8)`: 8 microbatches; `s.split("B")`: backward into BI and BW."""
        span = _caller_span()
        if what == "B":
            if count is not None:
                raise error("bad-split", "`split B` cuts backward into BI and BW and takes no count",
                            span=span, hint='write s.split("B")')
        elif not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise error("bad-split", f"`split {what}` needs a positive integer count, not {count!r}",
                        span=span, hint=f's.split("{what}", 4) cuts the batch into 4 microbatches')
        self.directives.append(Split(what, count, span))

    def place(self, selector: str, group: DeviceGroup) -> None:
        """`s.place("PP=1", s.mesh["pp"][1])`: run the regions `selector` picks on `group`."""
        span = _caller_span()
        if not isinstance(group, DeviceGroup):
            raise error("bad-place", f"place needs a device group such as s.mesh[\"pp\"][0], not {group!r}",
                        span=span)
        self.directives.append(Place(parse_selector(selector, span=span), group, span))

    def shard(self, *what: str, over: str, of=None) -> None:
        """`s.shard("optimizer", "grads", "params", over="dp")`: ZeRO-3 over dp.

        Tensor parallelism names its modules in `of`, a list of patterns (one string is one
        pattern): `s.shard("columns", of=["**.q_proj", "**.k_proj"], over="tp")`, likewise
        "rows" and "vocab"; `s.shard("sequence", over="tp")` takes no `of`.
        """
        span = _caller_span()
        for item in what:
            if item not in SHARDABLE:
                raise error("bad-shard", f"cannot shard `{item}`", span=span,
                            hint=did_you_mean(item, SHARDABLE) or f"shard one of {', '.join(SHARDABLE)}")
        if not what:
            raise error("bad-shard", "shard needs something to divide", span=span,
                        hint='e.g. s.shard("batch", over="dp")')
        patterns = _patterns(of, span)
        problem = shard_problem(tuple(what), patterns, span)
        if problem is not None:
            raise PiperError(problem)
        self.mesh.check_axis(over, span=span)
        self.directives.append(Shard(tuple(what), over, span, (), patterns, tuple(span for _ in patterns)))

    def order(self, selector: str, items) -> None:
        """`s.order("PP=0", ["F(MB=0)", ["F(MB=1)", "B(MB=0)"], "B(MB=1)"])`.

        Each entry is a slot; a nested list is one slot whose items may overlap.
        """
        span = _caller_span()
        slots = []
        for item in items:
            group = item if isinstance(item, (list, tuple)) else [item]
            slots.append(tuple(parse_selector(x, span=span) for x in group))
        self.directives.append(Order(parse_selector(selector, span=span), tuple(slots), span,
                                     tuple(tuple(span for _ in slot) for slot in slots)))

    def recompute(self, *selectors: str) -> None:
        """`s.recompute("PP=*")`: the regions picked keep only their inputs in forward and
        recompute in backward (`recompute PP=*` in the language)."""
        span = _caller_span()
        if not selectors:
            raise error("bad-recompute", "recompute needs the regions to recompute", span=span,
                        hint='e.g. s.recompute("PP=*")')
        self.directives.append(Recompute(tuple(parse_selector(x, span=span) for x in selectors), span))

    def use(self, strategy, *, on: str | None = None, **params) -> None:
        """Apply another strategy here, as `use` does in a script.

        `s.use("one_f_one_b", microbatches=8, on="pp")` is the script's
        `use one_f_one_b(microbatches=8) on pp` (a standard-library strategy by
        name); `s.use(zero3, axis="dp")` takes a `@piper.strategy` function or
        a path to a .pps file, with its parameters by name.
        """
        if isinstance(strategy, str) and not strategy.strip().endswith(".pps"):
            from .strategy_use import build_named

            self.directives.extend(build_named(strategy, params, on, self.mesh, _caller_span()))
            return
        if on is not None:
            params = {"axis": on, **params}   # `on` binds the axis parameter, as in a script
        strategy = as_strategy(strategy)
        self.directives.extend(strategy.bind(**params).build(self.mesh)[1])


class Strategy:
    """A Python strategy function with some parameters bound."""

    mesh = None  # a Python strategy does not declare its own mesh

    def __init__(self, fn, params: dict | None = None):
        self.fn = fn
        self.params = dict(params or {})
        functools.update_wrapper(self, fn)

    def bind(self, **params) -> "Strategy":
        sig = inspect.signature(self.fn)
        names = list(sig.parameters)[1:]
        for key in params:
            if key not in names:
                raise error("unknown-parameter", f"strategy `{self.fn.__name__}` has no parameter `{key}`",
                            hint=did_you_mean(key, names) or f"its parameters are {', '.join(names) or '(none)'}")
        return Strategy(self.fn, {**self.params, **params})

    __call__ = bind

    def build(self, mesh: Mesh) -> tuple[Mesh, tuple[Directive, ...]]:
        """Run the function against `mesh`; return the mesh and the directives."""
        builder = Builder(mesh)
        self.fn(builder, **self.params)
        return mesh, tuple(builder.directives)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"<piper.strategy {self.fn.__name__}({args})>"


def strategy(fn) -> Strategy:
    """Decorator: turn `fn(s, **params)` into a composable strategy."""
    return Strategy(fn)


def as_strategy(obj):
    """Accept a Strategy, a plain function `fn(s)`, or a path to a `.pps` script."""
    if hasattr(obj, "build"):
        return obj
    if isinstance(obj, str) or hasattr(obj, "__fspath__"):
        from ..dsl import load_strategy  # the language lowers to the same directives

        return load_strategy(obj)
    if callable(obj):
        return Strategy(obj)
    if obj is None:
        return Strategy(lambda s: None)
    raise PiperError(error("bad-strategy", f"cannot use {obj!r} as a strategy",
                           hint="pass a @piper.strategy function or a path to a .pps script").diagnostics[0])
