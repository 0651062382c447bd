"""The regions a strategy names itself: what `piper check` plans against when given no model.

A script that places `PP=0` to `PP=3` (or orders them) describes a model of
four `PP` regions; an abstract chain of that many regions is enough to find
deadlocks, order cycles and placement mistakes without loading a model. This
module only reads directives (no torch, no Ray), so `piper check` stays light.
"""
from __future__ import annotations

from .directives import Order, Place


def named_regions(directives) -> dict[str, int]:
    """{tag: count} from the region tags in `place` and `order` statements: one more than
    the highest index named of each tag (`PP=*` and `MB` name no region).

    >>> from piper.selectors import parse_selector
    >>> named_regions([Place(parse_selector("PP=3"), None)])
    {'PP': 4}
    """
    highest: dict[str, int] = {}
    for d in directives:
        selectors = []
        if isinstance(d, Place):
            selectors.append(d.selector)
        elif isinstance(d, Order):
            selectors.append(d.selector)
            selectors += [item for slot in d.slots for item in slot]
        for selector in selectors:
            for tag, index in selector.region_tags():
                if isinstance(index, int) and not isinstance(index, bool):
                    highest[tag] = max(highest.get(tag, -1), index)
    return {tag: top + 1 for tag, top in highest.items()}


def describe(regions: dict[str, int]) -> str:
    """"PP=0..3" for {"PP": 4}."""
    return ", ".join(f"{tag}=0" if count == 1 else f"{tag}=0..{count - 1}" for tag, count in regions.items())
