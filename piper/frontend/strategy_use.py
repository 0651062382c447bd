"""`s.use("one_f_one_b", microbatches=8, on="pp")` in a `@piper.strategy` function.

A standard-library strategy named from Python runs through the very path a
script's `use one_f_one_b(microbatches=8) on pp` takes: the line is written out
and interpreted, so the two forms cannot drift apart. Errors point at the
Python call and show the `use` line it stands for.
"""
from __future__ import annotations

from ..diagnostics import error


def _literal(name: str, value, span) -> str:
    """A keyword argument as .pps text: ints, bools, and mesh-axis names."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.isidentifier():
        return value          # an axis, e.g. axis="pp"
    raise error("wrong-type", f"`{name}={value!r}`: a strategy takes whole numbers, true/false or axis names",
                span=span, hint=f"e.g. s.use(\"one_f_one_b\", microbatches=8, on=\"pp\")")


def use_line(name: str, params: dict, on: str | None, span) -> str:
    """The `use` statement `s.use(name, **params, on=on)` stands for.

    >>> use_line("one_f_one_b", {"microbatches": 8}, "pp", None)
    'use one_f_one_b(microbatches=8) on pp'
    """
    if not name.isidentifier():
        raise error("unknown-strategy", f"s.use({name!r}): a strategy is named by an identifier such as "
                    "\"one_f_one_b\", or given as a path ending in .pps or a @piper.strategy function", span=span)
    args = ", ".join(f"{k}={_literal(k, v, span)}" for k, v in params.items())
    line = f"use {name}({args})"
    if on is not None:
        if not isinstance(on, str) or not on.isidentifier():
            raise error("wrong-type", f"on={on!r} is not a mesh axis name", span=span, hint='write e.g. on="pp"')
        line += f" on {on}"
    return line


def build_named(name: str, params: dict, on: str | None, mesh, span):
    """Directives of `use NAME(params) on AXIS` against `mesh`, as a script would make them."""
    from ..dsl import load_strategy

    line = use_line(name, params, on, span)
    where = f"{span.file}:{span.line}" if span is not None else "<s.use>"
    script = load_strategy(line + "\n", file=f"{where} (s.use)")
    return script.build(mesh)[1]
