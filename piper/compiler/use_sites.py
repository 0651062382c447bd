"""Warnings raised by a line of a `use`d strategy, pointed at the user's `use` line that ran it.

`use zero3() on dp` on a mesh with dp=1 makes the compiler warn about
`shard batch over axis`, a line of stdlib/zero3.pps the user never wrote.
The warning is moved to the `use` line (the outermost one, in the user's own
file), with a label on the strategy's line that raised it, and warnings that
then say the same thing at the same place are given once. An error stays at the
strategy's line, where the fault is, and carries the `use` lines that ran it
(`errors_traced`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from ..diagnostics import Diagnostic, Label, PiperError, Span


def _use_sites(directives) -> dict[Span, Span]:
    """A strategy statement's span -> the outermost `use` line it ran under (the first, if several did)."""
    sites: dict[Span, Span] = {}
    for d in directives:
        if not getattr(d, "trace", ()):
            continue            # the script's own statement: its span is already the user's line
        spans = [d.span] + [s for slot in getattr(d, "item_spans", ()) for s in slot]
        for span in spans:
            if span is not None:
                sites.setdefault(span, d.trace[0])
    return sites


def at_use_sites(warnings: list[Diagnostic], directives) -> list[Diagnostic]:
    """`warnings` with those raised inside a `use`d strategy moved to its `use` line; repeats merged.

    A moved warning keeps the strategy's line as a label ("raised by this line
    of the strategy"); two warnings with the same code, message and span are
    one, with the labels of both.
    """
    sites = _use_sites(directives)
    merged: dict[tuple, Diagnostic] = {}
    for w in warnings:
        site = sites.get(w.span) if w.span is not None else None
        if site is not None:
            w = Diagnostic(w.code, w.message, w.severity, site,
                           (Label(w.span, "raised by this line of the strategy this `use` runs"),) + w.labels,
                           w.notes, w.hint)
        key = (w.code, w.message, w.span)
        first = merged.get(key)
        if first is None:
            merged[key] = w
        else:
            labels = first.labels + tuple(label for label in w.labels if label not in first.labels)
            merged[key] = Diagnostic(first.code, first.message, first.severity, first.span, labels,
                                     first.notes, first.hint, first.trace)
    return list(merged.values())


def _traces(directives) -> dict[Span, tuple[Span, ...]]:
    """A strategy statement's span -> the `use` sites it ran under (outermost first)."""
    traces: dict[Span, tuple[Span, ...]] = {}
    for d in directives:
        trace = getattr(d, "trace", ())
        if not trace:
            continue
        for span in [d.span] + [s for slot in getattr(d, "item_spans", ()) for s in slot]:
            if span is not None:
                traces.setdefault(span, trace)
    return traces


@contextmanager
def errors_traced(directives):
    """Errors raised at a line of a `use`d strategy (a stdlib file the user never wrote) carry the
    `use` lines that ran it, as the interpreter's own errors do: `piper check` renders them as
    "note: used from job.pps:2:1" under the strategy's line.

        with errors_traced(directives):
            ir = apply_all(initial_ir(program, mesh), directives)
    """
    try:
        yield
    except PiperError as err:
        traces = _traces(directives)
        if not traces:
            raise
        found = [replace(d, trace=traces[d.span]) if not d.trace and d.span in traces else d
                 for d in err.diagnostics]
        if found == list(err.diagnostics):
            raise
        raise PiperError(*found) from err
