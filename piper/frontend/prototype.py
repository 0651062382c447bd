"""`piper import FILE.json`: the Piper prototype's schedule directive programs as `.pps` scripts.

A program is the prototype's own format (its README, "Schedule Directives
Program"; docs/prototype-json.md): a JSON array of directives, such as its
examples/base-schedules/pp2_dp2_ep2_zero3.json with the order its
examples/build_schedule.py appends:

    [{"op": "place", "filter": {"PP": 0}, "devices": [0, 2], "stream": "pp_stream"},
     {"op": "place", "filter": {"PP": 1}, "devices": [1, 3], "stream": "pp_stream"},
     {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2], "shard_grads": true, "shard_params": true},
     {"op": "replicate", "filter": {"PP": 1}, "devices": [1, 3], "shard_grads": true, "shard_params": true},
     {"op": "shard", "filter": {"PP": 0, "EP": "*"}, "devices": [0, 2]},
     {"op": "shard", "filter": {"PP": 1, "EP": "*"}, "devices": [1, 3]},
     {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4},
     {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}], ...]},
     ...]

becomes

    mesh dp=2, pp=2
    split MB into 4
    place PP=0 on pp[0]
    place PP=1 on pp[1]
    shard batch over dp
    shard optimizer, grads, params over dp
    shard experts over dp
    order PP=0:
        F(PP=0, MB=0); F(PP=0, MB=1); ...

The mesh comes from the device lists (prototype_mesh.py); each directive is
read into a record (prototype_directives.py) and the records become the
statements that mean the same. What has no equivalent (a device group that is
not a stage, replicating or sharding some stages only or with different
flags, sharding anything but experts, splitting part of the model) is a
`prototype-unsupported` error naming the JSON path; streams and bucket sizes
are dropped with one `prototype-dropped` warning.
"""
from __future__ import annotations

from ..diagnostics import Diagnostic, PiperError
from .prototype_directives import Order, Place, Problems, Replicate, Shard, Split, read_directive, show
from .prototype_mesh import Layout, layout_of
from .prototype_read import parse_program, read_program

_WHOLE_HINT = 'use the empty filter {}, which selects the whole model'


def _selector(filter_) -> str:
    """(("PP", 1), ("EP", "*")) -> `PP=1 EP=*`."""
    return " ".join(f"{t}={v}" for t, v in filter_)


def _is_whole(filter_) -> bool:
    return all(v == "*" for _, v in filter_)


def _key(filter_) -> frozenset:
    return frozenset(filter_)


def _wrap(slots: list[str], indent: str = "    ", width: int = 100) -> list[str]:
    lines, line = [], ""
    for s in slots:
        piece = s if not line else "; " + s
        if line and len(indent) + len(line) + len(piece) > width:
            lines.append(indent + line)
            line = s
        else:
            line += piece
    if line:
        lines.append(indent + line)
    return lines


def _split_lines(splits: list[Split], region_tags: set[str], problems: Problems) -> tuple[list[str], str]:
    """`split MB into N`, and the tag the program splits by (its dim_name; MB without a split)."""
    if not splits:
        return [], "MB"
    first = splits[0]
    if len(splits) > 1:
        problems.unsupported(splits[1].at, "a second split has no equivalent: the model's batch is split once, "
                             f"into microbatches (as at {first.at})", hint="keep one split directive")
    if not _is_whole(first.filter):
        problems.unsupported(f"{first.at}.filter", f"splitting part of the model ({_selector(first.filter)}) has "
                             "no equivalent: the whole batch splits into microbatches", hint=_WHOLE_HINT)
    if first.dim in region_tags or first.dim in ("PASS", "EP"):
        problems.unsupported(f"{first.at}.dim_name", f"{show(first.dim)} is already a region tag",
                             hint='name the microbatch dimension "MB"')
    return [f"split MB into {first.count}"], first.dim


def _place_lines(places: list[Place], layout: Layout, dim: str, problems: Problems) -> list[str]:
    lines = []
    for p in places:
        if any(t == dim for t, _ in p.filter):
            problems.unsupported(f"{p.at}.filter", f"placing some microbatches ({dim}) elsewhere has no "
                                 "equivalent: a region runs every microbatch on its devices", hint=f"drop {dim}")
        elif layout.pp > 1 and _is_whole(p.filter):
            problems.unsupported(f"{p.at}.filter", f"placing the whole model on {show(list(p.devices))} while "
                                 "other places name other devices has no equivalent", hint="place each region "
                                 'by its tag: {"PP": 0}')
        elif layout.pp > 1:
            lines.append(f"place {_selector(p.filter)} on pp[{layout.stage_of[p.devices]}]")
    return lines                 # one stage: every region is on every device, as an unplaced one is


def _stage_of_filter(d, kind: str, places: dict, layout: Layout, problems: Problems, rest=None) -> bool:
    """Whether `d` (a replicate or shard) works across the devices of the stage its filter names."""
    rest = d.filter if rest is None else rest
    if _is_whole(rest):
        if layout.pp > 1:
            problems.unsupported(f"{d.at}.filter", f"{kind} of the whole model over {show(list(d.devices))} has no "
                                 "equivalent while stages run on other devices: each stage works across its own",
                                 hint=f"{kind} each stage over the devices of its place, with the place's filter")
            return False
        return True
    place = places.get(_key(rest))
    if place is None:
        problems.unsupported(f"{d.at}.filter", f"{_selector(rest)} is not the filter of a place: {kind} covers "
                             "the regions of whole stages", hint="use a place directive's filter, or {}")
        return False
    if place.devices != d.devices:
        problems.unsupported(f"{d.at}.devices", f"{_selector(rest)} runs on {show(list(place.devices))} "
                             f"({place.at}), not {show(list(d.devices))}: {kind} works across a stage's own "
                             "devices", hint=f"give the devices of {place.at}")
        return False
    return True


def _uncovered(places: list[Place], covered: set) -> list[Place]:
    return [p for p in places if _key(p.filter) not in covered]


def _replicate_lines(replicates: list[Replicate], places: list[Place], layout: Layout,
                     problems: Problems) -> list[str]:
    """`shard batch over dp` and the ZeRO level, when every stage is replicated across its devices alike."""
    if not replicates:
        if layout.dp > 1:
            p = places[0] if places else None
            problems.unsupported(f"{p.at}.devices" if p else "(top)", f"regions run on {layout.dp} devices "
                                 "each but are never replicated, so every device would train a copy of its own "
                                 "with no gradients shared", hint='add {"op": "replicate", "filter": ..., '
                                 '"devices": ...} with each place\'s filter and devices')
        return []
    by_filter = {_key(p.filter): p for p in places}
    covered, whole = set(), False
    for r in replicates:
        if _stage_of_filter(r, "replicate", by_filter, layout, problems):
            whole = whole or _is_whole(r.filter)
            covered.add(_key(r.filter))
    missing = [] if whole else _uncovered(places, covered)
    if missing:
        problems.unsupported(f"{missing[0].at}.filter", f"{_selector(missing[0].filter)} is placed but not "
                             "replicated while other stages are; data parallelism covers the whole model",
                             hint="replicate every stage, or none")
    first = replicates[0]
    for r in replicates[1:]:
        if r.zero != first.zero:
            name = {0: "no sharding", 2: "ZeRO-2 (shard_grads)", 3: "ZeRO-3 (shard_params)"}
            problems.unsupported(r.at, f"{name[r.zero]} here but {name[first.zero]} at {first.at}: optimizer "
                                 "state, gradients and parameters are sharded the same way on every stage",
                                 hint="give every replicate the same shard_grads and shard_params")
            break
    if layout.dp == 1:
        return []                # across one device: nothing to share
    what = {0: None, 2: "optimizer, grads", 3: "optimizer, grads, params"}[first.zero]
    return ["shard batch over dp"] + ([f"shard {what} over dp"] if what else [])


def _shard_lines(shards: list[Shard], places: list[Place], layout: Layout, problems: Problems) -> list[str]:
    """`shard experts over dp` for the prototype's expert shards ({"PP": i, "EP": "*"} across a stage)."""
    if not shards:
        return []
    by_filter = {_key(p.filter): p for p in places}
    covered, whole, ok = set(), False, True
    for s in shards:
        tags = dict(s.filter)
        if "EP" not in tags:
            problems.unsupported(f"{s.at}.filter", f"sharding {_selector(s.filter) or 'the whole model'} has no "
                                 "equivalent: only the experts of MoE layers (the regions tagged EP) are divided "
                                 "over devices", hint='shard expert regions: {"PP": 0, "EP": "*"}')
            ok = False
            continue
        if tags["EP"] != "*":
            problems.unsupported(f"{s.at}.filter.EP", f"sharding one expert region (EP={tags['EP']}) has no "
                                 "equivalent: a MoE layer's experts are divided over the devices together",
                                 hint='use "EP": "*"')
            ok = False
            continue
        rest = tuple((t, v) for t, v in s.filter if t != "EP")
        if _stage_of_filter(s, "shard", by_filter, layout, problems, rest):
            whole = whole or _is_whole(rest)
            covered.add(_key(rest))
        else:
            ok = False
    missing = [] if whole else _uncovered(places, covered)
    if ok and missing:
        problems.widened(f"{missing[0].at}.filter", f"the experts of "
                         f"{_selector(missing[0].filter)} are not sharded while those of other stages are; "
                         "`shard experts over dp` divides the experts of every MoE layer, so these too",
                         hint="if those stages have MoE layers meant to stay whole, the program has no equivalent")
    return ["shard experts over dp"] if layout.dp > 1 else []


def _item(item, dim: str, pass_: str, problems: Problems) -> str | None:
    tags = []
    for t, v in item.tags:
        if t == "MB" and dim != "MB":
            problems.unsupported(item.at, f"the program splits by {dim}, so MB names no tag",
                                 hint=f'write the microbatch as "{dim}"')
            return None
        tags.append(f"{'MB' if t == dim else t}={v}")
    return f"{pass_}({', '.join(tags)})" if tags else pass_


def _order_lines(orders: list[Order], dim: str, problems: Problems) -> list[str]:
    lines = []
    for o in orders:
        region = next((tuple((t, v) for t, v in it.tags if t != dim) for slot in o.slots for it in slot
                       if any(t != dim for t, _ in it.tags)), None)
        if region is None:
            problems.unsupported(f"{o.at}.filters", "no filter of this order names a region, so it names no "
                                 "device", hint='name the region in each filter: {"PP": 0, "MB": 0, "PASS": "F"}')
            continue
        slots: list[str] = []
        for slot in o.slots:
            if len(slot) == 1 and slot[0].pass_ is None:       # a forward and its backward, one after the other
                slots += [x for x in (_item(slot[0], dim, p, problems) for p in ("F", "B")) if x]
                continue
            texts = []
            for it in slot:
                if it.pass_ is None:
                    problems.unsupported(it.at, "a filter without PASS selects a forward and its backward, which "
                                         "cannot share a slot with other filters", hint='name the "PASS"')
                    continue
                texts.append(_item(it, dim, it.pass_, problems))
            if texts and None not in texts:
                slots.append(texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]")
        lines.append(f"order {_selector(region)}:")
        lines.extend(_wrap(slots))
    return lines


def _dropped_warning(problems: Problems) -> None:
    if not problems.dropped:
        return
    shown = ", ".join(problems.dropped[:6]) + (f" and {len(problems.dropped) - 6} more"
                                               if len(problems.dropped) > 6 else "")
    problems.dropped_fields(problems.dropped[0], f"streams and bucket sizes dropped ({shown}): the "
                     "runtime chooses its own streams and gradient buckets", hint="the imported script trains the "
                     "same; the items of one slot run at once, in lanes")


def _keyword_tags(records, problems: Problems) -> None:
    """A tag named like a word of the .pps language (`in`, `order`) would not parse: an error at its first use."""
    used: dict[str, str] = {}
    dims = {r.dim for r in records if isinstance(r, Split)}      # written as MB
    for r in records:
        filters = [(f"{r.at}.filter", r.filter)] if not isinstance(r, Order) else [
            (it.at, it.tags) for slot in r.slots for it in slot]
        for at, filter_ in filters:
            for tag, _ in filter_:
                if tag not in dims:
                    used.setdefault(tag, at)
    lower = [t for t in used if t.islower()]
    if not lower:
        return                      # the language's words are all lower case; tags usually are not
    from ..dsl.parser import KEYWORDS

    for tag in lower:
        if tag in KEYWORDS:
            problems.bad(used[tag], f"the tag `{tag}` is a word of the .pps language", hint="rename the tag, in "
                         "the model's piper.annotate and here")


def program_to_pps(data, *, file: str = "program.json") -> tuple[str, list[Diagnostic]]:
    """A prototype program (parsed JSON) -> (.pps text, warnings); raise `PiperError` with every error."""
    problems = Problems(file)
    if not isinstance(data, list):
        earlier = isinstance(data, dict) and "directives" in data
        problems.bad("(top)", f"a program is a JSON array of directive objects, not {show(data)}",
                     hint='list the directives: [{"op": "place", ...}, ...]; the mesh comes from their device '
                     "lists" + (' (the {"mesh": ..., "directives": [...]} form of earlier versions of '
                                "`piper import` is no longer read)" if earlier else ""))
        raise PiperError(*problems.all())
    records = []
    for i, d in enumerate(data):
        if problems.full:
            break
        records.append(read_directive(d, f"[{i}]", problems))
    _keyword_tags([r for r in records if r is not None], problems)
    if problems.failed:
        raise PiperError(*problems.all())
    of = {kind: [r for r in records if isinstance(r, kind)] for kind in (Place, Replicate, Shard, Split, Order)}
    places = of[Place]
    groups = [(p.at, p.devices) for p in places] or [(d.at, d.devices) for d in of[Replicate] + of[Shard]]
    layout = layout_of(groups, problems)
    if layout is None:
        raise PiperError(*problems.all())
    region_tags = {t for p in places for t, _ in p.filter}
    splits, dim = _split_lines(of[Split], region_tags, problems)
    body = _place_lines(places, layout, dim, problems)
    body += _replicate_lines(of[Replicate], places, layout, problems)
    body += _shard_lines(of[Shard], places, layout, problems)
    orders = _order_lines(of[Order], dim, problems)
    if any(it.pass_ in ("BI", "BW") for o in of[Order] for slot in o.slots for it in slot):
        splits.append("split B into BI, BW")     # the prototype splits the backwards its orders name BI and BW
    if problems.failed:
        raise PiperError(*problems.all())
    _dropped_warning(problems)
    head = [f"# imported from {show(file, 80)} (a Piper prototype schedule directive program) by `piper import`"]
    if layout.axes:
        head.append("mesh " + ", ".join(f"{a}={n}" for a, n in layout.axes))
    text = "\n".join(head + splits + body + orders) + "\n"
    return text, [d for d in problems.found if d.severity != "error"]


def import_text(text: str, *, file: str = "program.json") -> tuple[str, list[Diagnostic]]:
    """A program's JSON text -> (.pps text, warnings), within the bounds of prototype_read.py."""
    return program_to_pps(parse_program(text, file), file=file)


def import_program(path: str) -> tuple[str, list[Diagnostic]]:
    """The program in the file at `path` -> (.pps text, warnings)."""
    import os

    return program_to_pps(read_program(path), file=os.path.basename(path))


def _looks_json(path: str) -> bool:
    """Whether the file at `path` starts (past a byte-order mark and blanks) with `[` or `{`.

    Only a regular file is opened, and without blocking (a FIFO or a device would block the open or
    the read, /dev/zero never end it): anything else is `file-not-found` here. Its first bytes are
    compared as bytes, so a file that is not UTF-8 is left to the reader that names the problem."""
    import os

    from ..diagnostics import error
    from ..dsl.source import SourceError, read_prefix

    try:
        head = read_prefix(path, 64)
    except SourceError as err:
        if err.code == "file-not-found" and not os.path.lexists(path):
            return False            # the CSV reader says the file is missing, as it always has
        raise error("file-not-found", f"cannot read {show(path, 120)}: {err.reason}",
                    hint="name a prototype .json program or a torch schedule .csv file") from None
    return head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] in (b"[", b"{")


def import_main(args) -> int:
    """`piper import FILE [-o OUT.pps]`: a prototype JSON program, else torch's schedule CSV."""
    import sys

    path = args.file
    if not path.lower().endswith(".json") and not _looks_json(path):
        from . import interop

        return int(interop.import_main(args) or 0)
    script, warnings = import_program(path)
    if warnings:
        from ..render import print_diagnostics

        print_diagnostics(warnings, file=sys.stderr)
    from .interop import write_script

    write_script(script, getattr(args, "output", None))
    return 0


# ---- the other way: a compiled strategy as a prototype program (for tests and migration)


def program_of(compiled, *, microbatches: int) -> list[dict]:
    """The prototype directives that express `compiled`: a place (and, with dp, a replicate) per region,
    the split, and one order per device group, in the prototype's own format.

    ZeRO-1 has no prototype spelling (its replicate all-reduces or shards gradients too): a `ValueError`."""
    from .interop import compute_slots

    ir = compiled.ir
    if compiled.zero == 1:
        raise ValueError("ZeRO-1 has no prototype equivalent: its replicate shards gradients with the optimizer "
                         "state (shard_grads, ZeRO-2) or neither")
    index = ir.index()
    tags = {r.index: dict(r.tags) for r in ir.regions}
    out: list[dict] = []
    first_of: dict[tuple, int] = {}
    for r in ir.regions:
        devices = ir.devices_of(r.index)
        out.append({"op": "place", "filter": tags[r.index], "devices": list(devices)})
        first_of.setdefault(devices, r.index)
    if "dp" in ir.mesh.names and ir.batch_axes():
        for r in ir.regions:
            out.append({"op": "replicate", "filter": tags[r.index], "devices": list(ir.devices_of(r.index)),
                        **({"shard_grads": True} if compiled.zero >= 2 else {}),
                        **({"shard_params": True} if compiled.zero >= 3 else {})})
    out.append({"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": microbatches})
    slots = compute_slots(compiled)
    for devices in first_of:
        filters = []
        for slot in slots[devices[0]]:
            nodes = [index[k] for k in slot]
            halves = ({(n.region, n.mb) for n in nodes if n.op == "BI"}
                      & {(n.region, n.mb) for n in nodes if n.op == "BW"})
            group = []
            for n in nodes:
                if (n.region, n.mb) in halves and n.op == "BW":
                    continue
                op = "B" if (n.region, n.mb) in halves else n.op
                group.append({**tags[n.region], "MB": n.mb, "PASS": op})
            filters.append(group)
        out.append({"op": "order", "filters": filters})
    return out
