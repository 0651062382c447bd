"""The limits on a plan's size, checked before the work they bound begins.

Planning is linear in what it copies: `split MB` makes each region's passes
once per microbatch (the global DAG), `place` lists each region's devices, and
lowering makes each pass once per device that plans apart (one replica of the batch's
and tp's axes stands for the others). A strategy of a few
lines can ask for any of these to be huge (`split MB into 4000000`, a region
on a million devices), so each is bounded here, at real use: the
stdlib's schedules at 64 stages x 512 microbatches x dp 8 (the README's and
RESULTS.md's `piper check` figure) are 32,768 passes of a region and microbatch,
512 region-device pairs and 32,768 passes on the devices that plan apart; the
bounds below are 1x, 256x and 4x that (a plan with more pairs than the last
bound could not be lowered, so `place` stops it before listing them). `piper
check` answers within 5 s of CPU with the script's run on top: at these bounds
ZBV and DualPipeV (split backward) on dp 8 x pp 32 with 512 microbatches take
1.7-1.8 s in all and 250 MB, gpipe's 4,096 regions x 8 microbatches 1.1 s, 1F1B at
64 x 512 x dp 8 0.7 s (`/usr/bin/time piper check`, a second run, 2 shared cores).
The first bound was 16,384 while ZBV's and DualPipeV's `if`s ran through the
general interpreter (2.0-2.2 s at 32,768); `dsl/slot_loops.py` runs them now.

    >>> MAX_COMPUTES, MAX_PLACEMENTS, MAX_DEVICE_COMPUTES
    (32768, 131072, 131072)
"""
from __future__ import annotations

from ..diagnostics import error

MAX_COMPUTES = 1 << 15            # microbatches x regions: the global DAG's forwards (and backwards)
MAX_PLACEMENTS = 1 << 17          # region-device pairs that `place` statements list: no more than lowering takes
MAX_DEVICE_COMPUTES = 1 << 17     # microbatches x the devices of each region, summed: the plans' passes

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
    """plan-too-large before lowering makes each pass of each microbatch on the devices of its region
    that plan apart. Devices that differ only along the batch's axes and tp run one plan (the
    compiler keeps it once per group and the verifier replays one replica: `Plans.representatives`),
    so a region counts its devices over those replicas: dp=64 x pp=16 x tp=8 plans 16 devices'
    passes per microbatch, not 8,192."""
    world = ir.mesh.world_size
    axes = ir.batch_axes() + ((ir.tensor_axis(),) if ir.tensor_axis() is not None else ())
    replicas = 1
    for axis in dict.fromkeys(axes):
        replicas *= ir.mesh.size(axis)
    placed = {r: len(ranks) for r, ranks in ir.placement}
    devices = sum(-(-placed.get(r.index, world) // replicas) for r in ir.regions)
    total = ir.microbatches * devices
    if total > MAX_DEVICE_COMPUTES:
        raise error("plan-too-large", f"{ir.microbatches:,} microbatch(es) on {devices:,} region-device pairs "
                    f"that plan apart make {total:,} passes of each kind on the devices; a plan holds at most "
                    f"{MAX_DEVICE_COMPUTES:,}", span=ir.split_span, hint=_HINT)
