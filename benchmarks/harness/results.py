"""A suite's results as data, and their cells: what a reader sees (`Table`'s formatted
cells) and what tests and scripts read (`SuiteResult.metrics`, a flat dict of the raw numbers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


# -- results --------------------------------------------------------------------------------------

@dataclass
class Table:
    """One table of a suite: its cells formatted as they are shown (`add` formats them)."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells) -> None:
        self.rows.append([fmt(c) for c in cells])


@dataclass
class SuiteResult:
    """What a suite returns: its tables and notes, its raw `metrics`, and how long it took."""

    name: str
    number: int
    title: str
    command: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    implemented: bool = True


def fmt(value) -> str:
    """Cells: floats to 3 significant digits, None to an em dash, the rest as str."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "—"
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def short_error(exc: BaseException) -> str:
    """One line for a table cell: a PiperError's first line (its message), else the exception's last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    from piper.diagnostics import PiperError

    text = (lines[0] if isinstance(exc, PiperError) else lines[-1]) if lines else ""
    return f"{type(exc).__name__}: {text}"[:200]


def compile_or_failure(ctx, build):
    """`build()` (Piper's side of a comparison: a compiled job), or None and the failure for the
    table cell, its traceback in the log: one side failing leaves the other's numbers standing."""
    import traceback

    try:
        return build(), None
    except Exception as exc:
        ctx.log(traceback.format_exc())
        return None, f"failed: {short_error(exc)}"


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20
