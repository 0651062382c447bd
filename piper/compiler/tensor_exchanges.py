"""The compiler's pass for tensor parallelism: a `TP` marker after each pass whose compute issues
tensor-parallel collectives from inside its graph, so the plans, `piper show`, the order check and
the costs have them. A region with its graph is cut at its collectives instead (each one a `TP`
exchange between pieces: `piper.compiler.cut_passes`); what keeps markers is a pass the cut
leaves whole: an abstract program's (`piper check --regions`, `piper tune`'s cached profiles),
or a region whose MoE layers cannot be cut.

    compiled = add_tp_collectives(compiled, program)     # under tensor parallelism, after `compile_ir`

    before: 0F3 0SEND_F3>1.0          after: 0F3 0TP_F3 0SEND_F3>1.0
    before: 1B3 1SEND_B3>0.0          after: 1B3 1TP_B3 1SEND_B3>0.0

A region under `shard columns/rows/vocab` computes with its TP ops inside its graph: the
all-reduces of Megatron-LM's f and g (the all-gathers and reduce-scatters along the sequence
under `shard sequence`, the vocab loss's three small all-reduces) run on the device's tensor
group as the compute reaches them. `0TP_F3` stands for those of one pass (how many and the
bytes: `piper.frontend.tensor_traffic.traffic`): every device of the region issues the same ones in the
same order, which `piper check`'s collective-order check verifies, and `job.timings()` holds
their seconds under this key (moved out of the compute's own), which `simulate(...,
comm_cost=...)` prices.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.dag import Edge, Node, node_key
from ..frontend.tensor_traffic import traffic
from .plans import Compiled, project

if TYPE_CHECKING:
    from ..frontend.capture import Program

_PHASE = {"F": "F", "B": "B", "BI": "B"}      # BW computes weight gradients only: no TP collective


def add_tp_collectives(compiled, program: Program):
    """Under tensor parallelism: a `TP` node after every pass whose region issues TP collectives."""
    ir = compiled.ir
    moves = traffic(program)
    if not moves and ir.tensor_axis() is not None and all(r.graph is None for r in program.regions):
        # An abstract program (`piper check --regions`): every pass of every region stands for its
        # TP collectives, unpriced.
        moves = {(r.index, phase): (0.0, 0) for r in program.regions for phase in "FB"}
    order = list(compiled.order)
    cut = {n.region for n in order if n.op == "TP" and n.value is not None}     # its collectives are exchanges
    if not moves or cut >= {region for region, _ in moves}:
        return compiled
    last: dict[str, int] = {}
    for i, n in enumerate(order):
        if (n.region not in cut and n.is_compute and n.op in _PHASE and (n.region, _PHASE[n.op]) in moves
                and len(n.devices or ()) > 1):
            last[node_key(n.op, n.region, n.mb)] = i
    after = {i: key for key, i in last.items()}
    out, edges = [], []
    for i, n in enumerate(order):
        out.append(n)
        if i in after:
            tp = Node("TP", n.region, n.mb, n.op, devices=n.devices, stream="tp")
            out.append(tp)
            edges.append(Edge(n.key, tp.key))
    plans = compiled.plans       # the units each compute frees, read off the plans' table, not per rank
    release = {plans._table.key(k): units for k, units in plans._release.items() if units}
    ir = ir.with_(nodes=tuple(out), edges=ir.edges + tuple(edges))
    return Compiled(ir, out, project(ir, out, release), compiled.zero, compiled.warnings)
