"""When a schedule places fewer (or more) regions than the model has: say how many, and which `use` line.

`use one_f_one_b(...) on pp` on a mesh with pp=2 places PP=0 and PP=1, one
region per pipeline device; a model annotated with four `PP` regions then has
two regions nobody placed. The compiler's own `unplaced-region` knows the
regions but not the statement; this turns it into that sentence.
"""
from __future__ import annotations

import contextlib

from ..diagnostics import Diagnostic, Label, PiperError
from ..frontend.directives import Place


def _counts(regions) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for region in regions:
        for tag, index in region.tags:
            out.setdefault(tag, set()).add(index)
    return out


def stage_count_error(program, directives) -> Diagnostic | None:
    """The diagnostic for a strategy whose `place` statements cover fewer regions of one
    tag than the model has, or None when that is not what happened."""
    places = [d for d in directives if isinstance(d, Place)]
    if not places:
        return None
    model = _counts(program.regions)
    placed: dict[str, set[int]] = {}
    for d in places:
        for tag, index in d.selector.region_tags():
            if isinstance(index, int):
                placed.setdefault(tag, set()).add(index)
    for tag, indices in placed.items():
        have = model.get(tag, set())
        if not have or indices == have:
            continue
        if indices > have:      # the schedule names regions the model does not have
            return _too_many(places, tag, indices, have, annotated=getattr(program, "annotated", True))
        if not indices < have:
            continue
        top = max(indices)
        last = next(d for d in reversed(places) if dict(d.selector.region_tags()).get(tag) == top)
        if not last.trace:
            return None   # the script's own `place` lines: the compiler's message names what to add
        site = last.trace[0]
        labels = (Label(last.span, f"places {tag}={top}, the last {tag} region it places"),) \
            if last.span is not None else ()
        how = f"`{tag}=0..{top}`" if indices == set(range(top + 1)) and top else \
            ", ".join(f"`{tag}={i}`" for i in sorted(indices))
        missing = sorted(have - indices)
        return Diagnostic(
            "unplaced-region", f"the strategy places {len(indices)} `{tag}` region{'s' if len(indices) != 1 else ''} "
            f"({how}), and the model has {len(have)}: {', '.join(f'{tag}={i}' for i in missing)} "
            f"{'are' if len(missing) > 1 else 'is'} never placed", span=site, labels=labels,
            notes=(f"a pipeline schedule places one `{tag}` region per device along its axis (or `virtual` per "
                   "device, for interleaved ones), so the axis size and the model's region count must agree",),
            hint=f"make the pipeline axis {len(have)} devices long, annotate the model with {len(indices)} `{tag}` "
                 f"region{'s' if len(indices) != 1 else ''}, or use a schedule that holds several regions per "
                 f"device (e.g. "
                 f"`interleaved_1f1b(virtual={max(len(have) // max(len(indices), 1), 2)})`)")
    return None


def _too_many(places, tag: str, indices: set[int], have: set[int], *, annotated: bool = True) -> Diagnostic | None:
    extra = sorted(indices - have)
    first = next(d for d in places if dict(d.selector.region_tags()).get(tag) == extra[0])
    if not annotated:
        return _no_regions(first, tag, indices)
    if not first.trace:
        return None   # the script's own `place` line: unknown-region points at it
    # `one_f_one_b` only helps a schedule that holds several regions per device (interleaved ones):
    # never suggest the kind of schedule that is in use.
    devices = {d.group for d in places if tag in dict(d.selector.region_tags())}
    several = len(indices) > len(devices)
    return Diagnostic(
        "unknown-region", f"the strategy places {len(indices)} `{tag}` regions (`{tag}=0..{max(indices)}`), and the "
        f"model has {len(have)}: {_listed(tag, extra)} "
        f"{'do' if len(extra) > 1 else 'does'} not exist", span=first.trace[0],
        labels=(Label(first.span, f"places {tag}={extra[0]}"),) if first.span is not None else (),
        notes=(f"this schedule needs {len(indices)} `{tag}` regions on this mesh"
               + (" (`virtual` regions per device along its axis)" if several else " (one per device along its axis)"),),
        hint=f"annotate the model with {len(indices)} `{tag}` regions, "
             + ("shrink the pipeline axis or `virtual`, or use a schedule with one region per device "
                "(`one_f_one_b`)" if several else f"or shrink the pipeline axis to {len(have)} device"
                f"{'s' if len(have) != 1 else ''}"))


def _listed(tag: str, extra: list[int], most: int = 8) -> str:
    """The missing regions, named: a run of them as a range past `most` (a 4,096-stage schedule on a
    model of 64 regions would list 4,032)."""
    if len(extra) <= most or extra != list(range(extra[0], extra[-1] + 1)):
        shown = ", ".join(f"{tag}={i}" for i in extra[:most])
        return shown + (f" and {len(extra) - most:,} more" if len(extra) > most else "")
    return f"{tag}={extra[0]}..{extra[-1]} ({len(extra):,} regions)"


def _no_regions(first, tag: str, indices: set[int]) -> Diagnostic:
    """A model without `piper.annotate` regions is one region, PP=0: say so, and how to add regions."""
    span = first.trace[0] if first.trace else first.span
    labels = (Label(first.span, f"places {tag}={max(indices)}"),) if first.trace and first.span is not None else ()
    count = len(indices)
    return Diagnostic(
        "unknown-region", f"the model has no annotated regions (it is one region, PP=0), and the strategy places "
        f"{count} `{tag}` regions (`{tag}=0..{max(indices)}`)", span=span, labels=labels,
        notes=("each pipeline stage runs one region of the model; regions come from `piper.annotate` blocks in "
               "forward or from `piper.annotate_modules`",),
        hint=f"mark {count} `{tag}` regions: wrap each stage's part of forward in `with piper.annotate(\"{tag}\"):`, "
             f"or call `piper.annotate_modules(model, \"{tag}\", [[...], ...])` with {count} lists of module "
             "names (e.g. `blocks.0`), before piper.compile")


@contextlib.contextmanager
def explain_unplaced(program, directives):
    """Re-raise the compiler's `unplaced-region` as `stage_count_error` where that applies."""
    try:
        yield
    except PiperError as err:
        if err.code not in ("unplaced-region", "unknown-region"):
            raise
        better = stage_count_error(program, directives)
        if better is None:
            raise
        raise PiperError(better) from None
