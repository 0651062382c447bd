"""Interop with torch.distributed.pipelining: its compute-only schedule CSV, both ways.

    text = export_torch_csv(compiled)        # one row per pp rank: 0F0,0F1,...,(0F7;7B3)OVERLAP_F_B,...
    script = import_torch_csv(text)          # a .pps strategy with `place` and `order` lines

The CSV is what `_PipelineScheduleRuntime._load_csv(path, "compute_only")`
reads: row r lists pipeline rank r's compute actions, each `{stage}{F|B|I|W}{microbatch}`,
with the stage index = the region's PP number, I/W = Piper's BI/BW, and an
overlapped slot written as torch's compound `(a;b)OVERLAP_F_B`.

The command line calls `import_main` for `piper import` and `piper.cli_export.export_main` (which
compiles first) for `piper export`; their flags are listed on each.
"""
from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from typing import TYPE_CHECKING

from ..diagnostics import clip, error

if TYPE_CHECKING:                  # the front end reads a compiled result; it does not compile
    from ..compiler.plans import Compiled

# Piper pass -> torch computation type, and back.
TO_TORCH = {"F": "F", "B": "B", "BI": "I", "BW": "W"}
FROM_TORCH = {v: k for k, v in TO_TORCH.items()}
OVERLAP = "OVERLAP_F_B"
_ACTION = re.compile(r"(\d+)(F|B|I|W)(\d+)$")
_IGNORED = ("REDUCE_GRAD", "UNSHARD", "RESHARD")   # torch bookkeeping with no Piper compute
_TORCH_RANK = {"F": 0, "B": 1, "BI": 2, "BW": 3}   # torch writes an overlapped slot forward first: (F;B)
# `piper import` reads files from anywhere: a bounded size, and stage and microbatch numbers within
# what a script may name (`dsl.values`), checked before anything is made of them. A real schedule's
# CSV is far smaller: 64 ranks x 512 microbatches x 3 passes is about 1 MB.
MAX_CSV_BYTES = 16 * 1024 * 1024
MAX_STAGE = 4095                 # dsl.values.MAX_TAG_INDEX
MAX_MICROBATCH = 4095            # dsl.values.MAX_MICROBATCHES - 1


# ---- slots: what one `order` slot became in a device's plan


def compute_slots(compiled: Compiled, rank: int | None = None):
    """`rank`'s compute actions (no UPD) in plan order, grouped into the `order` slots they came from.

    Items of one slot get the same temporal edges (from every item of the
    slot before, to every item of the slot after), so a run of consecutive
    actions with the same non-empty temporal neighbours is one slot. A whole
    backward after `split B` (BI and BW of one item `B(...)`) is one slot too.
    With `rank=None`, a dict rank -> slots for every device.

    >>> compute_slots(dualpipev_p4_m8, 0)[17:19]       # doctest: +SKIP
    [('0F7', '7BI3', '7BW3'), ('7F4', '0BI0', '0BW0')]
    """
    before: dict[str, set] = defaultdict(set)
    after: dict[str, set] = defaultdict(set)
    for e in compiled.ir.edges:
        if e.kind == "temporal":
            after[e.src].add(e.dst)
            before[e.dst].add(e.src)

    def of(r: int) -> list[tuple[str, ...]]:
        slots: list[list[str]] = []
        last = None
        for action in compiled.plans[r]:
            node = action.node
            if not node.is_compute or node.op == "UPD" or node.value:
                continue          # a later piece of a pass cut at its all-to-alls belongs to the pass's slot
            sig = (frozenset(before[node.key]), frozenset(after[node.key]))
            if slots and sig == last and (sig[0] or sig[1]):
                slots[-1].append(node.key)
            else:
                slots.append([node.key])
            last = sig
        return [tuple(s) for s in slots]

    if rank is None:
        return {r: of(r) for r in compiled.plans}
    return of(rank)


def _merge_backward(nodes) -> list[tuple[str, int, int]]:
    """(pass, region, microbatch) of a slot's nodes, a BI and BW of one microbatch merged into B."""
    have = {(n.op, n.region, n.mb) for n in nodes}
    out = []
    for n in nodes:
        if n.op in ("BI", "BW") and ("BI", n.region, n.mb) in have and ("BW", n.region, n.mb) in have:
            if n.op == "BI":
                out.append(("B", n.region, n.mb))
        else:
            out.append((n.op, n.region, n.mb))
    return out


def overlapped_slots(compiled: Compiled) -> tuple[tuple[str, ...], ...]:
    """Every slot of several passes (not just one whole backward): what `simulate(overlap=...)` takes.

    >>> simulate(c.plans, costs={"F&B": 2.0}, overlap=overlapped_slots(c))   # doctest: +SKIP
    """
    seen: dict[tuple[str, ...], None] = {}
    index = compiled.ir.index()
    for slots in compute_slots(compiled).values():
        for slot in slots:
            if len(_merge_backward([index[k] for k in slot])) > 1:
                seen.setdefault(slot, None)
    return tuple(seen)


# ---- export


def _stage_of(compiled: Compiled, region: int) -> int:
    info = compiled.ir.regions[region]
    tags = dict(info.tags)
    if set(tags) != {"PP"}:
        raise error("export-unsupported", f"region {info.label} is not a plain pipeline region (PP=k)",
                    hint="torch's schedule CSV knows pipeline stages only; export a model whose regions "
                         "are tagged PP alone, or use --regions PP=N")
    return tags["PP"]


def _pipeline_ranks(compiled: Compiled, axis: str | None) -> list[int]:
    """One device per coordinate along `axis` (the others at 0): the rows of the CSV."""
    mesh = compiled.ir.mesh
    if axis is None:
        axis = "pp" if "pp" in mesh.names else (mesh.names[0] if len(mesh.names) == 1 else None)
        if axis is None:
            raise error("export-unsupported", f"cannot tell the pipeline axis of the mesh `{mesh}`",
                        hint="name it: export_torch_csv(compiled, axis=\"pp\")")
    mesh.check_axis(axis)
    base = {name: 0 for name in mesh.names}
    return [mesh.rank({**base, axis: i}) for i in range(mesh.size(axis))]


def torch_actions(compiled: Compiled, *, axis: str | None = None) -> list[list[str]]:
    """Per pipeline rank, torch's compute action strings (what one CSV row holds)."""
    index = compiled.ir.index()
    every = compute_slots(compiled)
    rows = []
    for rank in _pipeline_ranks(compiled, axis):
        row = []
        for slot in every[rank]:
            items = sorted(_merge_backward([index[k] for k in slot]), key=lambda a: _TORCH_RANK[a[0]])
            parts = [f"{_stage_of(compiled, r)}{TO_TORCH[op]}{mb}" for op, r, mb in items]
            row.append(parts[0] if len(parts) == 1 else f"({';'.join(parts)}){OVERLAP}")
        rows.append(row)
    return rows


def export_torch_csv(compiled: Compiled, *, axis: str | None = None) -> str:
    """The schedule as torch's compute-only CSV: one row per rank along `axis` (default pp).

    >>> print(export_torch_csv(plan("stdlib/one_f_one_b.pps", mesh="pp=2", ...)))   # doctest: +SKIP
    0F0,0F1,0B0,0F2,0B1,0B2
    1F0,1B0,1F1,1B1,1F2,1B2
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in torch_actions(compiled, axis=axis):
        writer.writerow(row)
    return out.getvalue()


# ---- import


def _parse_action(text: str, where: str) -> tuple[str, int, int] | None:
    text = text.strip()
    if not text or any(word in text for word in _IGNORED):
        return None
    m = _ACTION.match(text)
    if not m:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise error("bad-schedule-csv", f"{where}: cannot read action {shown!r}",
                    hint="compute actions look like 0F3, 2B1, 1I0, 1W0, or (0F7;7B3)OVERLAP_F_B; "
                         "export torch's schedule with format=\"compute_only\"")
    for digits, limit, what in ((m.group(1), MAX_STAGE, "stages"), (m.group(3), MAX_MICROBATCH, "microbatches")):
        if len(digits) > 6 or int(digits) > limit:
            shown = digits if len(digits) <= 12 else f"of {len(digits):,} digits"
            raise error("bad-schedule-csv", f"{where}: the action {text[:24]!r}... names a number {shown}, past the "
                        f"last of the {what} a plan may hold ({limit:,})" if len(text) > 24 else
                        f"{where}: the action {text!r} names a number {shown}, past the last of the {what} a plan "
                        f"may hold ({limit:,})", hint=f"a schedule numbers its {what} from 0 to {limit:,}")
    return FROM_TORCH[m.group(2)], int(m.group(1)), int(m.group(3))


def read_torch_csv(text: str) -> list[list[tuple[tuple[str, int, int], ...]]]:
    """Per rank, its slots: each a tuple of (pass, stage, microbatch); an overlapped action is one slot."""
    if len(text) > MAX_CSV_BYTES:
        raise error("bad-schedule-csv", f"the schedule CSV holds {len(text):,} characters; piper import reads at "
                    f"most {MAX_CSV_BYTES:,}", hint="a real schedule's CSV is a few megabytes at most")
    rows = []
    try:
        for r, row in enumerate(csv.reader(io.StringIO(text))):
            rows.append(_row_slots(r, row))
    except csv.Error as err:        # a NUL byte, a field past csv's own size limit
        raise error("bad-schedule-csv", f"cannot read the schedule CSV: {err}",
                    hint="export torch's schedule with _dump_csv(path, format=\"compute_only\")") from None
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise error("bad-schedule-csv", "the schedule CSV holds no compute actions",
                    hint="export one with torch's _dump_csv(path, format=\"compute_only\")")
    return rows


def _row_slots(r: int, row: list[str]) -> list[tuple[tuple[str, int, int], ...]]:
    """One CSV row's slots (row `r`, counted from 0)."""
    slots = []
    for c, cell in enumerate(row):
        cell = cell.strip()
        where = f"row {r + 1}, column {c + 1}"
        if cell.startswith("("):
            inner, _, kind = cell[1:].partition(")")
            if kind != OVERLAP:
                shown = cell if len(cell) <= 40 else cell[:40] + "..."
                raise error("bad-schedule-csv", f"{where}: unknown compound action {shown!r}",
                            hint=f"the only compound action is (F;B){OVERLAP}")
            items = tuple(a for a in (_parse_action(s, where) for s in inner.split(";")) if a)
        else:
            one = _parse_action(cell, where)
            items = (one,) if one else ()
        if items:
            slots.append(items)
    return slots


def _item(op: str, stage: int, mb: int) -> str:
    return f"{op}(PP={stage}, MB={mb})"


def import_torch_csv(text: str, *, name: str = "imported", source: str = "a torch schedule CSV",
                     per_line: int = 6) -> str:
    """A .pps strategy that reproduces a compute-only CSV: `place` each stage on its rank, `order` each rank.

    The strategy takes the pipeline axis (`axis = pp`); the microbatch count is
    the CSV's. I and W become `split B into BI, BW` and BI/BW items; an
    overlapped action becomes one slot `[F(...), B(...)]`.
    """
    rows = read_torch_csv(text)
    owner: dict[int, int] = {}
    microbatches, split = 0, False
    for rank, slots in enumerate(rows):
        for slot in slots:
            for op, stage, mb in slot:
                if owner.setdefault(stage, rank) != rank:
                    raise error("bad-schedule-csv", f"stage {stage} runs on rank {owner[stage]} and on rank {rank}",
                                hint="each stage belongs to one rank")
                microbatches = max(microbatches, mb + 1)
                split |= op in ("BI", "BW")
    stages = sorted(owner)
    if stages != list(range(len(stages))):
        missing = sorted(set(range(max(stages) + 1)) - set(stages))
        shown = ", ".join(map(str, missing[:10])) + (f" and {len(missing) - 10:,} more" if len(missing) > 10 else "")
        raise error("bad-schedule-csv", f"stage(s) {shown} never run",
                    hint="every stage from 0 to the last needs its actions in the CSV")
    def count(n: int, word: str, plural: str | None = None) -> str:
        return f"{n} {word if n == 1 else plural or word + 's'}"

    p = len(rows)
    mbs = count(microbatches, "microbatch", "microbatches")
    lines = [f"# Imported from {source} by `piper import`: {count(p, 'rank')}, {count(len(stages), 'stage')}, "
             f"{mbs}.",
             f"strategy {name}(axis = pp):",
             f'    """A fixed schedule for {mbs} over {count(len(stages), "pipeline region")} on '
             f"{count(p, 'device')} along `axis`.",
             "",
             "    Each `order` lists one device's passes in the order torch runs them; a",
             '    bracketed slot is torch\'s overlapped forward and backward (OVERLAP_F_B)."""',
             f"    split MB into {microbatches}"]
    if split:
        lines.append("    split B into BI, BW")
    for stage in stages:
        lines.append(f"    place PP={stage} on axis[{owner[stage]}]")
    for rank, slots in enumerate(rows):
        if not slots:
            continue
        first = min(stage for slot in slots for _, stage, _ in slot)
        lines.append(f"    order PP={first}:")
        texts = []
        for slot in slots:
            items = [_item(*a) for a in slot]
            texts.append(items[0] if len(items) == 1 else f"[{', '.join(items)}]")
        for i in range(0, len(texts), per_line):
            lines.append("        " + "; ".join(texts[i:i + per_line]))
    return "\n".join(lines) + "\n"


# ---- command line


def _sets(items) -> dict:
    if isinstance(items, dict):
        return dict(items)
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq:
            raise error("bad-flag", f"--set takes NAME=VALUE, not {item!r}", hint="e.g. --set microbatches=8")
        out[key.strip()] = value.strip()
    return out


def _regions(text):
    if text is None or isinstance(text, dict):
        return text
    out = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        key, _, count = part.partition("=")
        if not count.strip().isdigit() or len(count.strip()) > 30:
            shown = part if len(part) <= 40 else part[:40] + "..."
            raise error("bad-flag", f"--regions takes TAG=COUNT such as PP=8, not {shown!r}",
                        hint="give the number of regions, e.g. --regions PP=8")
        out[key.strip()] = int(count)
    return out


def import_main(args) -> int:
    """`piper import FILE.csv [-o OUT.pps] [--name NAME]`.

    `args` fields: file (the CSV path), output (a path, or None / "-" for
    stdout), optionally name (the strategy's name; default the CSV's stem).
    Returns the exit status.
    """
    import os

    from ..dsl.source import SourceError, read_source

    path = args.file
    try:       # a regular file only (a FIFO would block), read to the limit, as UTF-8
        text = read_source(path, limit=MAX_CSV_BYTES)
    except SourceError as err:
        if err.code == "script-too-large":
            raise error("bad-schedule-csv", f"cannot import {clip(path, 200)!r}: it holds over {MAX_CSV_BYTES:,} bytes, the "
                        "most piper import reads", hint="a real schedule's CSV is a few megabytes at most") from None
        if "UTF-8" in err.reason:
            raise error("bad-schedule-csv", f"cannot import {clip(path, 200)!r}: {err.reason}",
                        hint="torch writes its schedule CSV as ASCII; export it again with _dump_csv") from None
        raise error("file-not-found", f"cannot read {clip(path, 200)!r}: {err.reason}",
                    hint="check the path; it is relative to the current folder") from None
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0]) or "imported"
    name = getattr(args, "name", None) or (stem if stem[0].isalpha() or stem[0] == "_" else f"s_{stem}")
    script = import_torch_csv(text, name=name, source=os.path.basename(path))
    write_script(script, getattr(args, "output", None))
    return 0


def write_script(script: str, output: str | None) -> None:
    """`-o FILE` of `piper import`: the script to FILE, or to standard output for none or `-`."""
    import sys

    if output in (None, "-"):
        sys.stdout.write(script)
    else:
        with open(output, "w", encoding="utf-8") as f:
            f.write(script)
