"""The limits on a plan's size, checked before the work they bound begins.

Planning is linear in what it copies: `split MB` makes each region's passes
once per microbatch (the global DAG), `place` lists each region's devices, and
lowering makes each pass once per device that runs it. A strategy of a few
lines can ask for any of these to be huge (`split MB into 4000000`, a region
on a million devices), so each is bounded here, far above real use: the
stdlib's schedules at 64 stages x 512 microbatches x dp 8 are 32,768 passes of
a region and microbatch, 512 region-device pairs and 262,144 passes on devices
(0.8 s and about 150 MB to plan); the bounds below are 8x, 4,096x and 2x that.
At the last one 1F1B plans in 2.4 s CPU and about 250 MB, ZBV (split backward,
twice the passes) in 8.6 s and 460 MB (`piper check`, `/usr/bin/time -v`).

    >>> MAX_COMPUTES, MAX_PLACEMENTS, MAX_DEVICE_COMPUTES
    (262144, 2097152, 524288)
"""
from __future__ import annotations

from ..diagnostics import error

MAX_COMPUTES = 1 << 18            # microbatches x regions: the global DAG's forwards (and backwards)
MAX_PLACEMENTS = 1 << 21          # region-device pairs that `place` statements list
MAX_DEVICE_COMPUTES = 1 << 19     # microbatches x the devices of each region, summed: the plans' passes

_HINT = ("use fewer microbatches, regions or devices; the largest real schedules are a few times "
         "smaller than this")


def check_split(ir, d) -> None:
    """plan-too-large before `split MB into d.count` copies the passes of `ir`'s regions."""
    regions = max(1, len(ir.regions))
    if d.count * regions > MAX_COMPUTES:
        raise error("plan-too-large", f"{d.count:,} microbatches of {regions:,} regions make "
                    f"{d.count * regions:,} passes of each kind; a plan holds at most {MAX_COMPUTES:,}",
                    span=d.span, hint=_HINT)


def check_placement(ir, d, group_size: int, regions: int) -> int:
    """plan-too-large before `place` lists `group_size` devices for each of `regions` regions; else
    the region-device pairs listed so far (`place` keeps the running sum in the IR's indexes)."""
    found = ir._indexes.get("placed_pairs")
    placed = found[1] if found is not None and found[0] is ir.placement else \
        sum(len(ranks) for _, ranks in ir.placement)
    if placed + group_size * regions > MAX_PLACEMENTS:
        raise error("plan-too-large", f"this places {regions:,} region(s) on {group_size:,} devices each, "
                    f"{placed + group_size * regions:,} region-device pairs with the places before it; a plan "
                    f"holds at most {MAX_PLACEMENTS:,}", span=d.span, hint=_HINT)
    return placed


def check_lowering(ir) -> None:
    """plan-too-large before lowering makes each pass of each microbatch on every device of its region."""
    world = ir.mesh.world_size
    placed = {r: len(ranks) for r, ranks in ir.placement}
    devices = sum(placed.get(r.index, world) for r in ir.regions)
    total = ir.microbatches * devices
    if total > MAX_DEVICE_COMPUTES:
        raise error("plan-too-large", f"{ir.microbatches:,} microbatch(es) on {devices:,} region-device pairs make "
                    f"{total:,} passes of each kind on the devices; a plan holds at most "
                    f"{MAX_DEVICE_COMPUTES:,}", span=ir.split_span, hint=_HINT)
