"""Which expert group the calling thread's MoE ops exchange tokens over, and the seconds it spent there.

    with lane_group(groups, lane):   # the runtime, around one lane's compute
        current()                    # `piper.nn`'s dispatch/combine: that lane's group (None on one device)

Pure Python, below both the front end's ops (`piper.nn`) and the runtime's expert groups
(`piper.runtime.moe.expert_groups`, which makes the groups and sets the default): the ops ask, the
runtime answers (`piper.lane_context`).
"""
from __future__ import annotations

from .lane_context import LaneContext

_context = LaneContext()
forget, set_default, current = _context.forget, _context.set_default, _context.current
add_seconds, take_seconds, lane_group = _context.add_seconds, _context.take_seconds, _context.lane_group
