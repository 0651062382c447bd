"""The compiler's cut of passes into pieces at their collectives: a MoE layer's all-to-alls under
`shard experts`, the TP collectives under tensor parallelism.

    compiled = add_exchanges(compiled, program)     # after `compile_ir`, before the TP markers

In the compiler, since it remakes the compiled plans (`project`); the graph side (where a
region is cut, what each exchange is) is `piper.ir.region_cut`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.dag import Edge, Node
from ..ir.experts import moe_regions
from ..ir.region_cut import ALL_TO_ALL, exchange_ops
from .plans import Compiled, project

if TYPE_CHECKING:
    from ..frontend.capture import Program
    from ..ir.dag import IR

_STREAM = {ALL_TO_ALL: "ep", "TP": "tp"}


def exchanges_by_region(program: Program, ir: IR) -> dict[int, tuple[str, ...]]:
    """Region -> the plan op of each exchange its passes are cut at (`ALL_TO_ALL` or `TP`, in graph
    order), for the regions the plan cuts: on more than one device, with a graph, and MoE layers
    (under `shard experts`) that alternate dispatch and combine. A region missing here that
    issues collectives keeps them inside its graph, with a marker after each pass. (A
    recomputed region is cut too: each piece keeps its inputs and runs again in its backward,
    so no exchange is repeated.)"""
    experts = ir.sharded("experts") is not None
    tensor = getattr(program, "tensor", None)
    tensor = tensor is not None and tensor.size > 1 and ir.tensor_axis() is not None
    if not experts and not tensor:
        return {}
    out = {}
    for region in program.regions:
        if region.graph is None or len(ir.devices_of(region.index)) < 2:
            continue
        ops = exchange_ops(region.graph, experts=experts, tensor=tensor)
        if ops:
            out[region.index] = ops
    return out


def cut_pass(n, ops: tuple[str, ...]) -> tuple[list, list]:
    """The pieces and exchanges of pass `n` in run order, and the data edges between them.

    before: 0F3                         after: 0F3 0ALL_TO_ALL_F3.0 0F3.1 0TP_F3.1 0F3.2
    before: 0B3                         after: 0B3.2 0TP_B3.1 0B3.1 0ALL_TO_ALL_B3.0 0B3
    Piece 0 keeps the pass's token: it is where a forward starts and a backward ends.
    """
    def piece(p):
        return n if p == 0 else Node(n.op, n.region, n.mb, value=p, devices=n.devices, stream=n.stream)

    def exchange(k):
        return Node(ops[k], n.region, n.mb, n.op, value=k, devices=n.devices, stream=_STREAM[ops[k]])

    if n.op == "F":
        seq = [piece(0)]
        for k in range(len(ops)):
            seq += [exchange(k), piece(k + 1)]
    else:
        seq = [piece(len(ops))]
        for k in reversed(range(len(ops))):
            seq += [exchange(k), piece(k)]
    return seq, [Edge(a.key, b.key) for a, b in zip(seq, seq[1:])]


def add_exchanges(compiled, program: Program):
    """Cut every pass that issues collectives at them (`exchanges_by_region`).

    before: 0F3 0SEND_F3>1.0            after: 0F3 0ALL_TO_ALL_F3.0 0F3.1 0ALL_TO_ALL_F3.1 0F3.2 0SEND_F3>1.0
    A forward becomes its pieces with an exchange action between each two: a MoE layer's
    dispatch (counts, then rows) and its combine (`ALL_TO_ALL`), or one TP collective (`TP`:
    Megatron-LM's f and g, their sequence-parallel all-gather and reduce-scatter, the vocab
    loss's reductions). Its backward (B, or BI after `split B`) is the mirror image; BW moves
    nothing and stays one action. The executor issues each exchange on the expert or tensor
    group of the lane that runs it and the next piece waits for it, so work the plan puts
    between them runs while the data travels (`piper.runtime.moe.pieces`). Data edges into a
    forward keep reaching its first piece and those out of it leave from its last; a backward
    the other way round. Temporal edges (the `order`) stay on the pass's own token.

    A MoE region that cannot be cut keeps one ALL_TO_ALL after each pass that moves tokens,
    standing for the exchanges its compute issues from inside its graph: a marker for the
    plans, the collective-order check and the simulator's costs (tensor parallelism's
    markers: `piper.compiler.tensor_exchanges`).
    """
    ir = compiled.ir
    cuts = exchanges_by_region(program, ir)
    markers = moe_regions(program) if ir.sharded("experts") is not None else {}
    if not cuts and not markers:
        return compiled
    order, edges = [], []
    moved_src, moved_dst = {}, {}          # a pass's token -> the piece its outgoing / incoming edges move to
    # The devices of a group run one sequence, so one replica of each holds every release (every
    # device's plan would be made in proportion to the mesh: 131,072 at dp=65,536 x tp=2).
    release = {a.key: a.release for plan in compiled.plans.representatives().values() for a in plan
               if a is not None and a.node.is_compute and a.release}
    for n in compiled.order:
        if n.op not in ("F", "B", "BI") or len(n.devices or ()) < 2 or (n.region not in cuts
                                                                        and n.region not in markers):
            order.append(n)
        elif n.region in cuts:
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
            a2a = Node(ALL_TO_ALL, n.region, n.mb, n.op, devices=n.devices, stream="ep")
            order.append(a2a)
            edges.append(Edge(n.key, a2a.key))
    kept = []
    for e in ir.edges:
        if e.kind == "data" and (e.src in moved_src or e.dst in moved_dst):
            e = Edge(moved_src.get(e.src, e.src), moved_dst.get(e.dst, e.dst), e.kind, e.span)
        kept.append(e)
    ir = ir.with_(nodes=tuple(order), edges=tuple(kept) + tuple(edges))
    return Compiled(ir, order, project(ir, order, release), compiled.zero, compiled.warnings)
