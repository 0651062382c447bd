"""The `recompute` statement: activation recomputation (checkpointing) per region.

    recompute PP=*            # every region
    recompute PP=0 L=*, PP=1  # every block region of stage 0, and stage 1

A selected region's forward keeps only its inputs; its backward (B, or BI
after `split B`) runs the forward again with gradients on, then goes on as
usual, so the activations live from that backward to the end of the region's
backward (its BW under a split backward) instead of from the forward. The
statement only marks regions: the schedule, the placement and the
communication are unchanged, so it composes with every strategy. The
runtime side is `piper/runtime/autograd/recompute.py`.
"""
from __future__ import annotations

from ..diagnostics import error
from ..frontend.directives import Recompute
from .dag import IR
from .region_match import regions_matching


def recompute(ir: IR, d: Recompute) -> IR:
    """`recompute PP=*`: mark the regions the selectors pick.

    before: recompute=()      after (regions 0..3): recompute=(0, 1, 2, 3)
    A selector that names a pass or a microbatch is an error: a region
    recomputes for every microbatch or for none.
    """
    chosen = set(ir.recompute)
    for selector in d.selectors:
        if selector.op is not None or selector.tag("MB") is not None:
            raise error("bad-recompute", f"recompute takes regions, not passes or microbatches: `{selector}`",
                        span=d.span, hint="write `recompute PP=*` or `recompute PP=1`: a region recomputes in "
                                          "the backward of every microbatch")
        chosen |= {r.index for r in regions_matching(ir, selector, d.span)}
    return ir.with_(recompute=tuple(sorted(chosen)))
