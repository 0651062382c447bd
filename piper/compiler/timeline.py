"""A picture of the per-device schedule: `piper show SCRIPT --timeline FILE.svg` (or `.html`).

One row per device, one box per compute action placed where a simulation with
the given costs (default F = BI = BW = 1, B = 2) runs it, coloured by pass,
with its microbatch number; a thin band under each row marks communication
(sends, receives and collectives, from issue to completion). Hand-written SVG,
no dependency; every box has a tooltip with its action's name (`1F3`).
"""
from __future__ import annotations

import math
import re
from html import escape

COLOURS = {"F": "#4c78a8", "B": "#54a24b", "BI": "#72b7b2", "BW": "#eeca3b", "UPD": "#9d9d9d",
           "comm": "#e45756", "collective": "#b279a2"}
_KEY = re.compile(r"^(\d+)(F|BI|BW|B|UPD)(\d*)$")
LABEL_W, ROW_H, COMM_H, GAP, TOP, AXIS_H = 120, 26, 6, 6, 44, 30


def _parse(key: str):
    m = _KEY.match(key)
    return (int(m.group(1)), m.group(2), m.group(3)) if m else (None, None, None)


def svg(sim, *, title: str = "", names: dict[int, str] | None = None, width: int = 1400) -> str:
    """The SVG document for a simulation (`simulate(..., record_comm=True)` adds the communication band)."""
    ranks = sorted(sim.timeline)
    span = sim.step_time or 1.0
    # The shortest action gets at least 16 px, so a two-digit microbatch number fits in it.
    shortest = min((e - b for line in sim.timeline.values() for b, e, _ in line if e > b), default=span)
    width = int(min(max(width, LABEL_W + 20 + 16 * span / shortest), 16000))
    plot_w = width - LABEL_W - 20
    scale = plot_w / span
    row = ROW_H + COMM_H + GAP
    height = TOP + row * len(ranks) + AXIS_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="10" y="18" font-size="14" font-weight="bold">{escape(title)}</text>']
    # legend
    x = 10
    for name, colour in (("F forward", COLOURS["F"]), ("B backward", COLOURS["B"]), ("BI backward (inputs)", COLOURS["BI"]),
                         ("BW backward (weights)", COLOURS["BW"]), ("UPD update", COLOURS["UPD"]),
                         ("send / receive", COLOURS["comm"]), ("collective", COLOURS["collective"])):
        out.append(f'<rect x="{x}" y="27" width="12" height="10" fill="{colour}"/>'
                   f'<text x="{x + 16}" y="36" font-size="11">{escape(name)}</text>')
        x += 22 + 6.5 * len(name)
    out.append(f'<text x="{width - 10}" y="36" font-size="11" text-anchor="end">step {span:g} '
               f'· bubble {sim.bubble_fraction:.1%} · numbers: microbatch</text>')
    for i, rank in enumerate(ranks):
        y = TOP + i * row
        label = (names or {}).get(rank, f"device {rank}")
        out.append(f'<text x="{LABEL_W - 8}" y="{y + ROW_H / 2 + 4}" font-size="11" text-anchor="end">'
                   f'{escape(label)}</text>')
        out.append(f'<rect x="{LABEL_W}" y="{y}" width="{plot_w}" height="{ROW_H}" fill="#f4f4f4"/>')
        for start, end, key in sim.timeline[rank]:
            parts = key.split("&")
            h = ROW_H / len(parts)
            for j, part in enumerate(parts):
                _, op, mb = _parse(part)
                bx, bw = LABEL_W + start * scale, max((end - start) * scale, 0.5)
                by = y + j * h
                colour = COLOURS.get(op, "#888")
                out.append(f'<rect x="{bx:.2f}" y="{by:.2f}" width="{bw:.2f}" height="{h:.2f}" fill="{colour}" '
                           f'stroke="white" stroke-width="0.6"><title>{escape(part)} '
                           f'({start:g}-{end:g})</title></rect>')
                size = min(11.0, h * 0.7, bw / max(1, len(mb)) * 1.6)
                if mb and size >= 5:
                    out.append(f'<text x="{bx + bw / 2:.2f}" y="{by + h / 2 + size * 0.35:.2f}" font-size="{size:.1f}" '
                               f'text-anchor="middle" fill="white" pointer-events="none">{mb}</text>')
        for start, end, key in getattr(sim, "comm", {}).get(rank, ()):
            colour = COLOURS["comm"] if ("SEND" in key or "RECV" in key) else COLOURS["collective"]
            bx, bw = LABEL_W + start * scale, max((end - start) * scale, 1.0)
            out.append(f'<rect x="{bx:.2f}" y="{y + ROW_H + 1}" width="{bw:.2f}" height="{COMM_H - 1}" '
                       f'fill="{colour}" opacity="0.8"><title>{escape(key)} ({start:g}-{end:g})</title></rect>')
    # time axis
    axis_y = TOP + row * len(ranks)
    out.append(f'<line x1="{LABEL_W}" y1="{axis_y}" x2="{LABEL_W + plot_w}" y2="{axis_y}" stroke="#333"/>')
    step = _tick(span)
    for i in range(int(span / step + 1e-9) + 1):       # by index: adding `step` up drifts
        t = i * step
        tx = LABEL_W + t * scale
        out.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 5}" stroke="#333"/>'
                   f'<text x="{tx:.2f}" y="{axis_y + 17}" font-size="10" text-anchor="middle">{t:g}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _tick(span: float) -> float:
    """The axis's tick spacing: 1, 2 or 5 times a power of ten, the smallest that leaves at most 12
    intervals over `span` (1 for a span that is not positive).

        _tick(100) == 10;  _tick(0.5) == 0.05;  _tick(2e-5) == 2e-6
    """
    if not span > 0 or not math.isfinite(span):
        return 1.0
    raw = span / 12
    mag = 10.0 ** math.floor(math.log10(raw))
    for k in (1, 2, 5):
        if raw <= k * mag * (1 + 1e-9):
            return k * mag
    return 10 * mag


def html(svg_text: str, title: str) -> str:
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            "<style>body{margin:16px;font-family:Helvetica,Arial,sans-serif}</style></head>\n"
            f"<body>\n{svg_text}<p>Hover a box for its action. Made by <code>piper show --timeline</code>.</p>\n"
            "</body></html>\n")


def write(compiled, path: str, *, costs=None, title: str = "") -> str:
    """Simulate `compiled`'s plans (every device, up to 64; else one per data-parallel shard) and draw them."""
    from .simulate import simulate
    from .trace import _device_names

    world = compiled.ir.mesh.world_size
    plans = {r: compiled.plans[r] for r in range(world)} if world <= 64 else compiled.plans.representatives()
    from .step_costs import recompute_costs

    sim = simulate(plans, costs=recompute_costs(compiled, costs), record_comm=True)   # reruns drawn in B/BI
    picture = svg(sim, title=title, names=_device_names(compiled.ir.mesh, plans))
    with open(path, "w", encoding="utf-8") as f:
        f.write(html(picture, title) if path.lower().endswith((".html", ".htm")) else picture)
    return path
