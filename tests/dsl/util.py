"""Helpers for the language tests."""
import dataclasses

from piper.frontend.directives import Order


def strip_spans(directives) -> tuple:
    """The directives without their spans, so two front ends can be compared."""
    out = []
    for d in directives:
        d = dataclasses.replace(d, span=None)
        if isinstance(d, Order):
            d = dataclasses.replace(d, item_spans=())
        out.append(d)
    return tuple(out)


def codes(diagnostics) -> list[str]:
    return [d.code for d in diagnostics]
