"""Each prototype directive as the `.pps` statements that mean the same (`piper import`).

One function per directive op, in `TRANSLATE`; each reads one directive, reports
what has no equivalent to the program's `_Problems`, and appends its statements
to a `Script`. `program_to_pps` (prototype.py) reads the program and runs them.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..diagnostics import did_you_mean

if TYPE_CHECKING:
    from ..mesh import Mesh
    from .prototype import _Problems

PASSES = ("F", "B", "BI", "BW", "UPD")
_SHARDABLE = ("batch", "optimizer", "grads", "params")


class Script:
    """The statements a program becomes, in the script's order: splits, then places and
    orders in the program's order, then the shards."""

    def __init__(self):
        self.splits: list[str] = []
        self.lines: list[str] = []
        self.tail: list[str] = []


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


def _split(d: dict, at: str, mesh: Mesh | None, problems: _Problems, script: Script) -> None:
    if "PASS" in d:
        into = d.get("into")
        if d["PASS"] != "B" or into != ["BI", "BW"]:
            problems.unsupported(f"{at}.into", "only the backward splits, into BI and BW",
                           hint='write {"op": "split", "PASS": "B", "into": ["BI", "BW"]}')
            return
        script.splits.append("split B into BI, BW")
        return
    dim, parts = d.get("dim", "MB"), d.get("parts", d.get("into"))
    if dim != "MB":
        problems.unsupported(f"{at}.dim", f"splitting {json.dumps(dim)} has no equivalent; only the batch "
                       "splits into microbatches (MB)")
        return
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        problems.bad(f"{at}.parts", f"the number of microbatches is an integer >= 1, not "
                       f"{json.dumps(parts)}")
        return
    script.splits.insert(0, f"split MB into {parts}")


def _place(d: dict, at: str, mesh: Mesh | None, problems: _Problems, script: Script) -> None:
    sel = _selector(d.get("filter"), f"{at}.filter", problems)
    devices = _devices(d.get("devices"), f"{at}.devices", problems)
    if sel is None or devices is None or mesh is None:
        return
    if devices == tuple(range(mesh.world_size)):
        return                # on every device: what an unplaced region does
    where = _axis_index(mesh, devices)
    if where is None:
        problems.unsupported(f"{at}.devices", f"devices {list(devices)} are not the devices of one index of an "
                       f"axis of the mesh {mesh}", hint="place each region on one pipeline stage's devices "
                       "(a mesh axis index), or give the program a \"mesh\" object that makes them one")
        return
    script.lines.append(f"place {sel} on {where[0]}[{where[1]}]")


def _replicate(d: dict, at: str, mesh: Mesh | None, problems: _Problems, script: Script) -> None:
    if not _is_all(d.get("filter")):
        problems.unsupported(f"{at}.filter", "replicating some regions only has no equivalent: data parallelism "
                       "covers the whole model", hint="drop the filter (or use {\"PP\": \"*\"})")
        return
    devices = _devices(d.get("devices", list(range(mesh.world_size)) if mesh else None), f"{at}.devices",
                       problems)
    if devices is None or mesh is None:
        return
    axis = d.get("over") or _group_axis(mesh, devices)
    if not axis or axis not in mesh.names:
        problems.unsupported(f"{at}.devices", f"devices {list(devices)} are not a data-parallel axis of the mesh "
                       f"{mesh}", hint='give the program a "mesh" object with a dp axis, or "over": "dp"')
        return
    shard_grads, shard_params = bool(d.get("shard_grads")), bool(d.get("shard_params"))
    shard_optimizer = bool(d.get("shard_optimizer", shard_grads or shard_params))
    if shard_params and not shard_grads:
        problems.unsupported(f"{at}.shard_params", "sharded parameters with full gradients have no equivalent "
                       "(ZeRO-3 shards the optimizer state, gradients and parameters)",
                       hint='set "shard_grads": true as well')
        return
    if (shard_grads or shard_params) and not shard_optimizer:
        problems.unsupported(f"{at}.shard_optimizer", "sharded gradients with full optimizer state have no "
                       "equivalent (ZeRO-2 shards both)", hint='drop "shard_optimizer": false')
        return
    script.tail.append(f"shard batch over {axis}")
    what = [w for w, on in (("optimizer", shard_optimizer), ("grads", shard_grads),
                            ("params", shard_params)) if on]
    if what:
        script.tail.append(f"shard {', '.join(what)} over {axis}")


def _shard(d: dict, at: str, mesh: Mesh | None, problems: _Problems, script: Script) -> None:
    if d.get("filter"):
        problems.unsupported(f"{at}.filter", "sharding regions (tensor or expert parallelism) has no "
                       "equivalent in this version", hint="shard the batch, optimizer state, gradients or "
                       "parameters over a mesh axis instead")
        return
    what = d.get("what", ["batch"])
    what = [what] if isinstance(what, str) else what
    axis = d.get("over")
    if not isinstance(what, list) or not what or any(w not in _SHARDABLE for w in what):
        problems.bad(f"{at}.what", f"shard takes a list of {', '.join(_SHARDABLE)}")
        return
    if mesh is None or axis not in mesh.names:
        problems.unsupported(f"{at}.over", f"{json.dumps(axis)} is not an axis of the mesh {mesh}",
                       hint=did_you_mean(str(axis), mesh.names) if mesh else None)
        return
    script.tail.append(f"shard {', '.join(what)} over {axis}")


def _order(d: dict, at: str, mesh: Mesh | None, problems: _Problems, script: Script) -> None:
    sel = _selector(d.get("filter"), f"{at}.filter", problems)
    schedule = d.get("schedule")
    if not isinstance(schedule, list) or not schedule:
        problems.bad(f"{at}.schedule", "an order's schedule is a non-empty list of items")
        return
    slots = [_item(x, f"{at}.schedule[{j}]", problems) for j, x in enumerate(schedule)]
    if sel is None or any(s is None for s in slots):
        return
    script.lines.append(f"order {sel}:")
    script.lines.extend(_wrap(slots, "    "))


# op -> its translator, in the order `piper import` documents the ops
TRANSLATE = {"place": _place, "replicate": _replicate, "shard": _shard, "split": _split, "order": _order}
