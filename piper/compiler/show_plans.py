"""`piper show`: each device's plan laid out for reading, one action per line or as a grid, with a legend.

    rank 0 (pp=0)            rank 1 (pp=1)
      1  0F0                   1  1RECV_F0<0.0
      2  0SEND_F0>1.0          2  1F0
"""
from __future__ import annotations

LEGEND = """\
legend (region R, microbatch M, value V, peer region P):
  RFM            forward of region R on microbatch M (e.g. 0F3)
  RBM            backward; RBIM / RBWM: backward for inputs / for weights (split B)
  RUPD           optimizer step for the parameters region R owns
  RSEND_FM>P.V   send forward value V of microbatch M to region P's devices (e.g. 0SEND_F0>1.0)
  RRECV_FM<P.V   receive it from region P; SEND_B / RECV_B carry its gradient back
  RALL_REDUCE    all-reduce region R's gradients (data parallel, ZeRO-1)
  RREDUCE_SCATTER    reduce-scatter them (ZeRO-2/3); _BM: after microbatch M's backward
  RALL_GATHER    all-gather region R's parameters after the update (ZeRO-1/2);
                 RALL_GATHER_FM before its forward of microbatch M (ZeRO-3)
  RALL_TO_ALL_FM.K   exchange K of a pass cut at its collectives: a MoE layer's dispatch, then
                 its combine (_BM.K / _BIM.K: their backward); RFM.K: piece K of the pass between
                 them (RFM itself is piece 0). RALL_TO_ALL_FM alone: the all-to-alls of a pass
                 that is not cut, issued from inside its compute
  RTP_FM.K       exchange K: a tensor-parallel collective (Megatron's f/g all-reduce, or under
                 `shard sequence` an all-gather / reduce-scatter; _BM.K: the backward's). RTP_FM
                 alone: the TP collectives a pass not cut issues from inside its compute"""


def _title(compiled, rank: int) -> str:
    coords = compiled.ir.mesh.coords(rank)
    where = ", ".join(f"{k}={v}" for k, v in coords.items())
    return f"rank {rank}" + (f" ({where})" if where else "")


def plan_lines(compiled, *, legend: bool = True) -> str:
    """Each device's plan, one numbered action per line, devices one after another."""
    out = []
    for rank, plan in compiled.plans.items():
        out.append(f"{_title(compiled, rank)}: {len(plan)} actions")
        width = len(str(len(plan)))
        out += [f"  {i:>{width}}  {action.key}" for i, action in enumerate(plan, 1)]
        out.append("")
    if legend:
        out.append(LEGEND)
    return "\n".join(out).rstrip() + "\n"


def plan_grid(compiled, *, legend: bool = True) -> str:
    """The plans side by side: one column per device, row i holds each device's i-th action."""
    ranks = list(compiled.plans)
    columns = [[_title(compiled, r)] + [a.key for a in compiled.plans[r]] for r in ranks]
    widths = [max(len(text) for text in column) for column in columns]
    rows = max(len(column) for column in columns)
    step = len(str(rows - 1))
    lines = []
    for i in range(rows):
        label = " " * step if i == 0 else f"{i:>{step}}"
        cells = [(column[i] if i < len(column) else "").ljust(width) for column, width in zip(columns, widths)]
        lines.append((label + "  " + "  ".join(cells)).rstrip())
    if legend:
        lines += ["", LEGEND]
    return "\n".join(lines) + "\n"
