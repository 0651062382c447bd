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

from ..diagnostics import Diagnostic, PiperError, did_you_mean
from ..mesh import Mesh
from .prototype_directives import PASSES, TRANSLATE, Script  # noqa: F401 - PASSES stays importable from here

OPS = ("place", "replicate", "shard", "split", "order")


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


def _read_program(data, problems: _Problems) -> tuple[list | None, Mesh | None]:
    """A program's directives, and the mesh it gives (None: inferred from the directives)."""
    if not isinstance(data, dict):
        return data, None
    mesh = None
    directives = data.get("directives", data.get("program"))
    if "mesh" in data:
        m = data["mesh"]
        if (isinstance(m, dict) and m and all(str(k).isidentifier() and isinstance(v, int)
                                              and not isinstance(v, bool) and v > 0 for k, v in m.items())):
            mesh = Mesh(tuple(m.items()))
        else:
            problems.bad(".mesh", 'the mesh is an object of axis sizes, such as {"dp": 2, "pp": 4}')
    return directives, mesh


def program_to_pps(data, *, file: str = "program.json", name: str | None = None) -> tuple[str, list[Diagnostic]]:
    """A prototype program (parsed JSON) -> (.pps text, warnings); raise `PiperError` with every error."""
    problems = _Problems(file)
    directives, mesh = _read_program(data, problems)
    if not isinstance(directives, list):
        problems.bad("(top)", 'a program is a JSON list of directives (or {"mesh": ..., "directives": [...]})')
        raise PiperError(*problems.found)
    if mesh is None and not problems.errors:
        mesh = _infer_mesh(directives, problems)
    script = Script()
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
        TRANSLATE[op](d, at, mesh, problems, script)
    if problems.errors:
        raise PiperError(*problems.found)
    head = [f"# imported from {file} (a Piper prototype directive program) by `piper import`"]
    if mesh is not None and mesh.axes:
        head.append("mesh " + ", ".join(f"{a}={n}" for a, n in mesh.axes))
    text = "\n".join(head + script.splits + script.lines + script.tail) + "\n"
    return text, [d for d in problems.found if d.severity != "error"]


def import_program(path: str) -> tuple[str, list[Diagnostic]]:
    import os

    from ..diagnostics import error

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
        from ..render import print_diagnostics

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
