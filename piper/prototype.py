"""`piper import FILE.json`: the Piper prototype's directive programs as `.pps` scripts.

A prototype program is a JSON list of directives (the format is described in
docs/prototype-json.md), or an object {"mesh": {...}, "directives": [...]}:

    [{"op": "split", "dim": "MB", "parts": 4},
     {"op": "place", "filter": {"PP": 0}, "devices": [0]},
     {"op": "place", "filter": {"PP": 1}, "devices": [1]},
     {"op": "order", "filter": {"PP": 0},
      "schedule": [{"PASS": "F", "MB": 0}, {"PASS": "F", "MB": 1}, {"PASS": "B", "MB": 0}, ...]},
     {"op": "replicate", "devices": [0, 1], "shard_grads": true}]

Each directive becomes the statement that means the same (`split MB into 4`,
`place PP=0 on pp[0]`, `order PP=0: ...`, `shard batch over dp` and
`shard optimizer, grads over dp`). What the language has no equivalent for
(a device list that is not one index of a mesh axis, per-region replication,
tensor or expert sharding) is an error naming the directive's JSON path
(`[3].devices`); streams are a warning and dropped, since the runtime runs
an overlapped slot's items in lanes of its own.
"""
from __future__ import annotations

import json

from .diagnostics import Diagnostic, PiperError, did_you_mean
from .mesh import Mesh

OPS = ("place", "replicate", "shard", "split", "order")
PASSES = ("F", "B", "BI", "BW", "UPD")
_SHARDABLE = ("batch", "optimizer", "grads", "params")


class _Problems:
    def __init__(self, file: str):
        self.file = file
        self.found: list[Diagnostic] = []

    def unsupported(self, path: str, message: str, hint: str | None = None):
        self.found.append(Diagnostic("prototype-unsupported", f"{self.file} {path}: {message}", "error", hint=hint))

    def bad(self, path: str, message: str, hint: str | None = None):
        self.found.append(Diagnostic("bad-program-json", f"{self.file} {path}: {message}", "error", hint=hint))

    def warning(self, path: str, message: str, hint: str | None = None):
        self.found.append(Diagnostic("prototype-dropped", f"{self.file} {path}: {message}", "warning", hint=hint))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.found if d.severity == "error"]


def _selector(filter_, path: str, problems: _Problems) -> str | None:
    """{"PP": 1, "EP": "*"} -> `PP=1 EP=*`."""
    if not isinstance(filter_, dict) or not filter_:
        problems.bad(path, "a filter is an object of region tags, such as {\"PP\": 1} or {\"EP\": \"*\"}")
        return None
    parts = []
    for tag, value in filter_.items():
        if not str(tag).isidentifier():
            problems.bad(f"{path}.{tag}", f"`{tag}` is not a region tag")
            return None
        if value == "*" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            parts.append(f"{tag}={value}")
        else:
            problems.bad(f"{path}.{tag}", f"a tag's value is an index >= 0 or \"*\", not {json.dumps(value)}")
            return None
    return " ".join(parts)


def _is_all(filter_) -> bool:
    return filter_ is None or filter_ == {} or (isinstance(filter_, dict) and all(v == "*" for v in filter_.values()))


def _devices(value, path: str, problems: _Problems) -> tuple[int, ...] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (not isinstance(value, list) or not value
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)):
        problems.bad(path, f"devices are a non-empty list of device numbers, not {json.dumps(value)}")
        return None
    return tuple(sorted(set(value)))


def _infer_mesh(directives, problems: _Problems) -> Mesh | None:
    """dp x pp from the device lists: each place names one pipeline stage's devices, replicate the data-parallel group."""
    places = [tuple(sorted(set(d["devices"]))) for d in directives
              if isinstance(d, dict) and d.get("op") == "place" and isinstance(d.get("devices"), list)]
    stages = list(dict.fromkeys(places))
    replicas = [len(set(d["devices"])) for d in directives
                if isinstance(d, dict) and d.get("op") == "replicate" and isinstance(d.get("devices"), list)]
    if stages:
        sizes = {len(s) for s in stages}
        dp = sizes.pop() if len(sizes) == 1 else None
        if dp is None:
            problems.unsupported("(mesh)", "the places' device lists differ in length, so they are not the stages of "
                           "one dp x pp mesh", hint='give the program a "mesh" object')
            return None
        pp = len(stages)
        if pp == 1:                     # every region on every device: no pipeline axis
            return Mesh((("dp", dp),)) if dp > 1 else Mesh(())
        axes = (("dp", dp), ("pp", pp)) if dp > 1 or replicas else (("pp", pp),)
        return Mesh(tuple((a, n) for a, n in axes if n > 1 or a == "pp"))
    if replicas:
        return Mesh((("dp", max(replicas)),))
    return Mesh(())


def _axis_index(mesh: Mesh, devices: tuple[int, ...]) -> tuple[str, int] | None:
    """The (axis, index) whose devices are exactly `devices`, if any."""
    for axis, size in mesh.axes:
        for i in range(size):
            if tuple(r for r in range(mesh.world_size) if mesh.coords(r)[axis] == i) == devices:
                return axis, i
    return None


def _group_axis(mesh: Mesh, devices: tuple[int, ...]) -> str | None:
    """The data-parallel axis a replicate over `devices` (every device of the mesh) means: `dp`, or the only axis."""
    if devices != tuple(range(mesh.world_size)):
        return None
    if "dp" in mesh.names:
        return "dp"
    return mesh.names[0] if len(mesh.names) == 1 else None


def _item(item, path: str, problems: _Problems) -> str | None:
    if isinstance(item, list):
        if not item:
            problems.bad(path, "an empty slot")
            return None
        parts = [_item(x, f"{path}[{i}]", problems) for i, x in enumerate(item)]
        if any(p is None or p.startswith("[") for p in parts):
            if not any(p is None for p in parts):
                problems.bad(path, "slots do not nest")
            return None
        return parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    if not isinstance(item, dict) or "PASS" not in item:
        problems.bad(path, 'a schedule item is {"PASS": "F", "MB": 0, ...} or a list of them (one slot)')
        return None
    op = item["PASS"]
    if op not in PASSES:
        problems.bad(f"{path}.PASS", f"unknown pass {json.dumps(op)}",
                       hint=did_you_mean(str(op), PASSES) or "passes are F, B, BI, BW and UPD")
        return None
    tags = []
    for key, value in item.items():
        if key == "PASS":
            continue
        if key == "stream":
            problems.warning(f"{path}.stream", f"stream {json.dumps(value)} dropped: the runtime runs the items of "
                             "a slot in lanes of its own", hint="write items meant to overlap as one slot: a list")
            continue
        if not str(key).isidentifier() or not (value == "*" or (isinstance(value, int) and not isinstance(value, bool))):
            problems.bad(f"{path}.{key}", f"a tag is NAME: index, not {json.dumps(key)}: {json.dumps(value)}")
            return None
        tags.append(f"{key}={value}")
    return f"{op}({', '.join(tags)})" if tags else op


def _wrap(slots: list[str], indent: str, width: int = 100) -> list[str]:
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


def program_to_pps(data, *, file: str = "program.json", name: str | None = None) -> tuple[str, list[Diagnostic]]:
    """A prototype program (parsed JSON) -> (.pps text, warnings); raise `PiperError` with every error."""
    problems = _Problems(file)
    mesh = None
    if isinstance(data, dict):
        directives = data.get("directives", data.get("program"))
        if "mesh" in data:
            m = data["mesh"]
            if (isinstance(m, dict) and m and all(str(k).isidentifier() and isinstance(v, int)
                                                  and not isinstance(v, bool) and v > 0 for k, v in m.items())):
                mesh = Mesh(tuple(m.items()))
            else:
                problems.bad(".mesh", 'the mesh is an object of axis sizes, such as {"dp": 2, "pp": 4}')
    else:
        directives = data
    if not isinstance(directives, list):
        problems.bad("(top)", 'a program is a JSON list of directives (or {"mesh": ..., "directives": [...]})')
        raise PiperError(*problems.found)
    if mesh is None and not problems.errors:
        mesh = _infer_mesh(directives, problems)
    lines: list[str] = []
    splits: list[str] = []
    tail: list[str] = []
    for i, d in enumerate(directives):
        at = f"[{i}]"
        if not isinstance(d, dict):
            problems.bad(at, "a directive is an object with an \"op\"")
            continue
        op = d.get("op")
        if op not in OPS:
            problems.bad(f"{at}.op", f"unknown directive {json.dumps(op)}",
                           hint=did_you_mean(str(op), OPS) or f"directives are {', '.join(OPS)}")
            continue
        if "stream" in d:
            problems.warning(f"{at}.stream", f"stream {json.dumps(d['stream'])} dropped: communication and compute "
                             "streams are chosen by the runtime")
        if op == "split":
            if "PASS" in d:
                into = d.get("into")
                if d["PASS"] != "B" or into != ["BI", "BW"]:
                    problems.unsupported(f"{at}.into", "only the backward splits, into BI and BW",
                                   hint='write {"op": "split", "PASS": "B", "into": ["BI", "BW"]}')
                    continue
                splits.append("split B into BI, BW")
                continue
            dim, parts = d.get("dim", "MB"), d.get("parts", d.get("into"))
            if dim != "MB":
                problems.unsupported(f"{at}.dim", f"splitting {json.dumps(dim)} has no equivalent; only the batch "
                               "splits into microbatches (MB)")
                continue
            if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
                problems.bad(f"{at}.parts", f"the number of microbatches is an integer >= 1, not "
                               f"{json.dumps(parts)}")
                continue
            splits.insert(0, f"split MB into {parts}")
        elif op == "place":
            sel = _selector(d.get("filter"), f"{at}.filter", problems)
            devices = _devices(d.get("devices"), f"{at}.devices", problems)
            if sel is None or devices is None or mesh is None:
                continue
            if devices == tuple(range(mesh.world_size)):
                continue                # on every device: what an unplaced region does
            where = _axis_index(mesh, devices)
            if where is None:
                problems.unsupported(f"{at}.devices", f"devices {list(devices)} are not the devices of one index of an "
                               f"axis of the mesh {mesh}", hint="place each region on one pipeline stage's devices "
                               "(a mesh axis index), or give the program a \"mesh\" object that makes them one")
                continue
            lines.append(f"place {sel} on {where[0]}[{where[1]}]")
        elif op == "replicate":
            if not _is_all(d.get("filter")):
                problems.unsupported(f"{at}.filter", "replicating some regions only has no equivalent: data parallelism "
                               "covers the whole model", hint="drop the filter (or use {\"PP\": \"*\"})")
                continue
            devices = _devices(d.get("devices", list(range(mesh.world_size)) if mesh else None), f"{at}.devices",
                               problems)
            if devices is None or mesh is None:
                continue
            axis = d.get("over") or _group_axis(mesh, devices)
            if not axis or axis not in mesh.names:
                problems.unsupported(f"{at}.devices", f"devices {list(devices)} are not a data-parallel axis of the mesh "
                               f"{mesh}", hint='give the program a "mesh" object with a dp axis, or "over": "dp"')
                continue
            shard_grads, shard_params = bool(d.get("shard_grads")), bool(d.get("shard_params"))
            shard_optimizer = bool(d.get("shard_optimizer", shard_grads or shard_params))
            if shard_params and not shard_grads:
                problems.unsupported(f"{at}.shard_params", "sharded parameters with full gradients have no equivalent "
                               "(ZeRO-3 shards the optimizer state, gradients and parameters)",
                               hint='set "shard_grads": true as well')
                continue
            if (shard_grads or shard_params) and not shard_optimizer:
                problems.unsupported(f"{at}.shard_optimizer", "sharded gradients with full optimizer state have no "
                               "equivalent (ZeRO-2 shards both)", hint='drop "shard_optimizer": false')
                continue
            tail.append(f"shard batch over {axis}")
            what = [w for w, on in (("optimizer", shard_optimizer), ("grads", shard_grads),
                                    ("params", shard_params)) if on]
            if what:
                tail.append(f"shard {', '.join(what)} over {axis}")
        elif op == "shard":
            if d.get("filter"):
                problems.unsupported(f"{at}.filter", "sharding regions (tensor or expert parallelism) has no "
                               "equivalent in this version", hint="shard the batch, optimizer state, gradients or "
                               "parameters over a mesh axis instead")
                continue
            what = d.get("what", ["batch"])
            what = [what] if isinstance(what, str) else what
            axis = d.get("over")
            if not isinstance(what, list) or not what or any(w not in _SHARDABLE for w in what):
                problems.bad(f"{at}.what", f"shard takes a list of {', '.join(_SHARDABLE)}")
                continue
            if mesh is None or axis not in mesh.names:
                problems.unsupported(f"{at}.over", f"{json.dumps(axis)} is not an axis of the mesh {mesh}",
                               hint=did_you_mean(str(axis), mesh.names) if mesh else None)
                continue
            tail.append(f"shard {', '.join(what)} over {axis}")
        elif op == "order":
            sel = _selector(d.get("filter"), f"{at}.filter", problems)
            schedule = d.get("schedule")
            if not isinstance(schedule, list) or not schedule:
                problems.bad(f"{at}.schedule", "an order's schedule is a non-empty list of items")
                continue
            slots = [_item(x, f"{at}.schedule[{j}]", problems) for j, x in enumerate(schedule)]
            if sel is None or any(s is None for s in slots):
                continue
            lines.append(f"order {sel}:")
            lines += _wrap(slots, "    ")
    if problems.errors:
        raise PiperError(*problems.found)
    head = [f"# imported from {file} (a Piper prototype directive program) by `piper import`"]
    if mesh is not None and mesh.axes:
        head.append("mesh " + ", ".join(f"{a}={n}" for a, n in mesh.axes))
    text = "\n".join(head + splits + lines + tail) + "\n"
    return text, [d for d in problems.found if d.severity != "error"]


def import_program(path: str) -> tuple[str, list[Diagnostic]]:
    import os

    from .diagnostics import error

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise error("file-not-found", f"cannot read {path!r}: {err.strerror or err}",
                    hint="check the path; it is relative to the current folder") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise error("bad-program-json", f"{os.path.basename(path)}:{err.lineno}:{err.colno}: not JSON: {err.msg}",
                    hint="a prototype program is a JSON list of directive objects") from None
    return program_to_pps(data, file=os.path.basename(path))


def import_main(args) -> int:
    """`piper import FILE [-o OUT.pps]`: a prototype JSON program, else torch's schedule CSV."""
    import sys

    path = args.file
    if not path.lower().endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                looks_json = f.read(64).lstrip()[:1] in ("[", "{")
        except OSError:
            looks_json = False
        if not looks_json:
            from . import interop

            return int(interop.import_main(args) or 0)
    script, warnings = import_program(path)
    if warnings:
        from .render import print_diagnostics

        print_diagnostics(warnings, file=sys.stderr)
    from .interop import write_script

    write_script(script, getattr(args, "output", None))
    return 0


# ---- the other way: a compiled strategy as a prototype program (for tests and migration)


def program_of(compiled, *, microbatches: int) -> list[dict]:
    """The prototype directives that express `compiled`'s placement, per-device order and data parallelism."""
    from .interop import compute_slots

    ir = compiled.ir
    mesh = ir.mesh
    out: list[dict] = [{"op": "split", "dim": "MB", "parts": microbatches}]
    if any(n.op in ("BI", "BW") for n in ir.nodes):
        out.append({"op": "split", "PASS": "B", "into": ["BI", "BW"]})
    index = ir.index()
    tags = {r.index: dict(r.tags) for r in ir.regions}
    first_of: dict[tuple, int] = {}
    for r in ir.regions:
        devices = ir.devices_of(r.index)
        out.append({"op": "place", "filter": tags[r.index], "devices": list(devices)})
        first_of.setdefault(devices, r.index)
    slots = compute_slots(compiled)
    for devices, region in first_of.items():
        rank = devices[0]
        schedule = []
        for slot in slots[rank]:
            items = []
            nodes = [index[k] for k in slot]
            halves = {(n.region, n.mb) for n in nodes if n.op == "BI"} & {(n.region, n.mb) for n in nodes if n.op == "BW"}
            for n in nodes:
                if (n.region, n.mb) in halves:
                    if n.op == "BW":
                        continue
                    op = "B"
                else:
                    op = n.op
                items.append({"PASS": op, **tags[n.region], "MB": n.mb})
            schedule.append(items[0] if len(items) == 1 else items)
        out.append({"op": "order", "filter": tags[region], "schedule": schedule})
    if mesh.names and "dp" in mesh.names and compiled.ir.batch_axes():
        out.append({"op": "replicate", "devices": list(range(mesh.world_size)),
                    "shard_grads": compiled.zero >= 2, "shard_params": compiled.zero >= 3,
                    **({"shard_optimizer": True} if compiled.zero == 1 else {})})
    return out
