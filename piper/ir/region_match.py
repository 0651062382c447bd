"""Which regions of an IR a selector's region tags pick: shared by the statements (`place`, `shard`,
`order`) and by `recompute`, below both.

    regions_matching(ir, parse_selector("PP=1"))    # [RegionInfo of the region tagged PP=1]
"""
from __future__ import annotations

from ..diagnostics import did_you_mean, error
from ..frontend.selectors import ANY, Selector
from .dag import IR, RegionInfo


def regions_matching(ir: IR, selector: Selector, span=None) -> list[RegionInfo]:
    """The regions a selector's region tags pick; an error naming the known tags if none."""
    tags = selector.region_tags()
    if len(tags) == 1 and tags[0][1] != ANY:       # `PP=3`, most selectors: the regions tagged so
        found = list(regions_by_tag(ir).get(tags[0], ()))
    else:
        found = [r for r in ir.regions if selector.matches_region(dict(r.tags))]
    if not found:
        known_tags = sorted({k for r in ir.regions for k, _ in r.tags})
        labels = ", ".join(r.label for r in ir.regions) or "(none)"
        hint = None
        for name, _ in selector.region_tags():
            if name not in known_tags:
                hint = did_you_mean(name, known_tags)
        raise error("unknown-region", f"`{selector}` matches no region of the model", span=span,
                    notes=(f"the model's regions are {labels}",),
                    hint=hint or "check the tag and index against the model's piper.annotate blocks")
    return found


def regions_by_tag(ir: IR) -> dict[tuple, list[RegionInfo]]:
    """(tag, value) -> the regions tagged so (nested ones too), made once per IR's regions."""
    found = ir._indexes.get("by_tag")
    if found is None or found[0] is not ir.regions:
        index: dict[tuple, list] = {}
        for r in ir.regions:
            for tag in r.tags:
                index.setdefault(tag, []).append(r)
        found = ir._indexes["by_tag"] = (ir.regions, index)
    return found[1]
