"""The compiler's pass for expert parallelism: every pass that moves tokens, cut at its all-to-alls.

    compiled = add_all_to_alls(compiled, program)     # under `shard experts`, after `compile_ir`

In the compiler, since it remakes the compiled plans (`project`); the IR side (which regions, how many
exchanges, one pass's pieces) stays in `piper.ir.experts`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.dag import Edge, Node
from ..ir.experts import cut_pass, exchanges_by_region, moe_regions
from .plans import Compiled, project

if TYPE_CHECKING:
    from ..frontend.capture import Program


def add_all_to_alls(compiled, program: Program):
    """Under `shard experts`: cut every pass that moves tokens at its all-to-alls.

    before: 0F3 0SEND_F3>1.0            after: 0F3 0ALL_TO_ALL_F3.0 0F3.1 0ALL_TO_ALL_F3.1 0F3.2 0SEND_F3>1.0
    A forward of a region with MoE layers becomes its pieces (before the first
    dispatch, each layer's experts, after each combine) with an ALL_TO_ALL
    action between each two: the layer's dispatch (counts, then rows) and its
    combine. Its backward (B, or BI after `split B`) is the mirror image; BW
    moves no tokens and stays one action. The executor issues each exchange
    on the expert group of the lane that runs it and the next piece waits for
    it, so work the plan puts between them runs while the tokens travel
    (`piper.runtime.moe.pieces`). Data edges into a forward keep reaching its
    first piece and those out of it leave from its last; a backward the other
    way round. Temporal edges (the `order`) stay on the pass's own token.

    A region that cannot be cut (`exchanges_by_region` gives 0) keeps one
    ALL_TO_ALL after each such pass, standing for the exchanges its compute
    issues from inside its graph: a marker for the plans, the collective-order
    check and the simulator's costs.
    """

    if compiled.ir.sharded("experts") is None:
        return compiled
    regions = moe_regions(program)
    if not regions:
        return compiled
    ir = compiled.ir
    cuts = exchanges_by_region(program, ir)
    order, edges = [], []
    moved_src, moved_dst = {}, {}          # a pass's token -> the piece its outgoing / incoming edges move to
    release = {a.key: a.release for plan in compiled.plans.values() for a in plan
               if a is not None and a.node.is_compute and a.release}
    for n in compiled.order:
        if n.op not in ("F", "B", "BI") or n.region not in regions or len(n.devices) < 2:
            order.append(n)
        elif cuts.get(n.region):
            seq, inner = cut_pass(n, cuts[n.region])
            order += seq
            edges += inner
            if n.op == "F":
                moved_src[n.key] = seq[-1].key
                if n.key in release:           # the parameters stay until the last piece is done
                    release[seq[-1].key] = release.pop(n.key)
            else:
                moved_dst[n.key] = seq[0].key
        else:
            order.append(n)
            a2a = Node("ALL_TO_ALL", n.region, n.mb, n.op, devices=n.devices, stream="ep")
            order.append(a2a)
            edges.append(Edge(n.key, a2a.key))
    kept = []
    for e in ir.edges:
        if e.kind == "data" and (e.src in moved_src or e.dst in moved_dst):
            e = Edge(moved_src.get(e.src, e.src), moved_dst.get(e.dst, e.dst), e.kind, e.span)
        kept.append(e)
    ir = ir.with_(nodes=tuple(order), edges=tuple(kept) + tuple(edges))
    return Compiled(ir, order, project(ir, order, release), compiled.zero, compiled.warnings)
