"""The regions a strategy names itself: what `piper check` plans against when given no model.

A script that places `PP=0` to `PP=3` (or orders them) describes a model of
four `PP` regions; an abstract chain of that many regions is enough to find
deadlocks, order cycles and placement mistakes without loading a model. This
module only reads directives (no torch, no Ray), so `piper check` stays light.
"""
from __future__ import annotations

from ..diagnostics import Diagnostic, PiperError
from .directives import Order, Place


def named_regions(directives) -> dict[str, int]:
    """{tag: count} from the region tags in `place` and `order` statements: one more than
    the highest index named of each tag (`PP=*` and `MB` name no region).

    >>> from piper.frontend.selectors import parse_selector
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


def _unchecked(message: str, hint: str) -> Diagnostic:
    return Diagnostic("analysis-unavailable", message, "note", hint=hint)


def schedules(node) -> bool:
    """Whether a script (or any strategy in it) holds a `place`, `order` or `use` statement."""
    from ..dsl import nodes

    if isinstance(node, (nodes.Place, nodes.Order, nodes.Use)):
        return True
    if isinstance(node, (list, tuple)):
        return any(schedules(item) for item in node)
    if isinstance(node, (nodes.Module, nodes.Strategy, nodes.For, nodes.If)):
        return any(schedules(getattr(node, f)) for f in getattr(node, "__dataclass_fields__", ()))
    return False


def regions_to_check(script, mesh, file: str) -> tuple[dict[str, int] | None, list[Diagnostic]]:
    """The regions `piper check` plans `script` against without a model: ({tag: count}, []),
    or (None, notes saying plainly why the plans were not checked, or the run's first error)."""
    if not schedules(script.module):
        return None, []       # no place, order or use: nothing about devices to check
    if mesh is None:
        return None, [_unchecked(f"{file}: the schedule was not checked for deadlocks: the script declares no mesh",
                            "declare one in the script (`mesh dp=2, pp=4`) or pass --mesh dp=2,pp=4 to check "
                            "the plans too")]
    try:
        _, directives = script.build(mesh)
    except PiperError as err:
        first = err.diagnostics[0]
        if first.code == "missing-parameter":   # a strategy library: its user gives the values
            return None, [_unchecked(f"{file}: the schedule was not checked: {first.message}",
                                "pass the values with --set NAME=VALUE to check its plans")]
        return None, [first]
    regions = named_regions(directives)
    if not regions:          # nothing placed: every region runs everywhere; one region stands for them
        return {"PP": 1}, []
    if len(regions) > 1:
        return None, [_unchecked(f"{file}: the schedule was not checked: the script names {describe(regions)}, and an "
                            "abstract model has one kind of region",
                            "pass --model PATH.py:FACTORY to check it against the model itself")]
    return regions, []
