"""What `piper show` and `piper simulate` print: plans, a timeline, and the
per-device figures a simulation predicts."""
from __future__ import annotations

import re

from .plans import Compiled
from .simulate import Simulation

_COMPUTE = re.compile(r"^(\d+)(F|BI|BW|B)(\d+)$")


def inflight_peak(sim: Simulation, rank: int) -> int:
    """The most microbatches whose forward ran and whose backward has not finished."""
    live: set[tuple[str, str]] = set()
    peak = 0
    for _, _, key in sorted(sim.timeline.get(rank, [])):
        for part in key.split("&"):
            m = _COMPUTE.match(part)
            if not m:
                continue
            region, op, mb = m.groups()
            if op == "F":
                live.add((region, mb))
            elif op in ("B", "BW"):
                live.discard((region, mb))
            peak = max(peak, len(live))
    return peak


def timeline_text(sim: Simulation, *, width: int = 100) -> str:
    """An ASCII Gantt chart: one row per device, one column per time unit (scaled to `width`)."""
    if sim.step_time <= 0:
        return "(empty step)"
    scale = min(1.0, width / sim.step_time)
    lines = []
    for rank in sorted(sim.timeline):
        row = [" "] * (int(sim.step_time * scale) + 1)
        for start, end, key in sim.timeline[rank]:
            if end <= start:
                continue
            m = _COMPUTE.match(key.split("&")[0])
            mark = (m.group(2)[-1] if m else "*") if "&" not in key else "X"
            for t in range(int(start * scale), max(int(start * scale) + 1, int(end * scale))):
                row[t] = mark
        lines.append(f"rank {rank:<3} |{''.join(row).rstrip()}")
    legend = "F forward, B backward, I/W backward for inputs/weights, X an overlapped slot, blank idle"
    return "\n".join(lines + [legend])


def summary_rows(compiled: Compiled, sim: Simulation) -> list[tuple]:
    """(rank, busy, bubble, bubble fraction, peak microbatches in flight) per simulated device."""
    rows = []
    for rank in sorted(sim.busy):
        busy = sim.busy[rank]
        rows.append((rank, busy, sim.step_time - busy, 1 - busy / sim.step_time if sim.step_time else 0.0,
                     inflight_peak(sim, rank)))
    return rows
