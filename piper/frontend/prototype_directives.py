"""The prototype's directives read into typed records (`piper import FILE.json`).

One reader per op, in `READERS`. Each checks one directive object's fields and
types, reports what it cannot read to the program's `Problems` (with the JSON
path, `[3].filters[2][0].PASS`), notes what it drops (streams, bucket sizes),
and returns an immutable record, or None. The format is the prototype's own
(its README's "Schedule Directives Program"; docs/prototype-json.md):

    >>> p = Problems("p.json")
    >>> read_directive({"op": "place", "filter": {"PP": 1}, "devices": [1, 3], "stream": "pp"}, "[1]", p)
    Place(at='[1]', filter=(('PP', 1),), devices=(1, 3))
    >>> p.dropped
    ['[1].stream']

Work per directive is proportional to its own size: nothing here knows the mesh.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..diagnostics import Diagnostic, did_you_mean

PASSES = ("F", "B", "BI", "BW")      # the prototype's order passes (its _VALID_ORDER_PASSES)
OPS = ("place", "replicate", "shard", "split", "order")
MAX_INDEX = 2 ** 62                  # a tag index or count: the .pps language's integer bound
MAX_NAME = 64                        # characters of a tag name (PP, EP, MB): messages and scripts quote it
MAX_DEVICE = 1 << 20                 # device numbers are below the language's mesh-size limit, 1,048,576
MAX_ERRORS = 100                     # errors kept per program, as for scripts
_DIGITS = re.compile(r"[0-9]{1,18}")

# The fields each op takes (the prototype's src/directives.py and src/schedule.py); "device" is its alias of "devices".
FIELDS = {
    "place": ("op", "filter", "devices", "device", "stream"),
    "replicate": ("op", "filter", "devices", "device", "reduce_stream", "gather_stream", "bucket_size",
                  "shard_grads", "shard_params"),
    "shard": ("op", "filter", "devices", "device", "stream"),
    "split": ("op", "filter", "dim_name", "num_microbatches"),
    "order": ("op", "filters"),
}
# Fields of the format earlier versions of `piper import` made up, with where the prototype says the same.
_EARLIER = {
    "schedule": 'an order lists its slots under "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], ...]',
    "dim": 'a split names its dimension with "dim_name"', "parts": 'a split counts with "num_microbatches"',
    "into": 'the backward splits where an order names "PASS": "BI" and "BW"',
    "over": 'a directive names its "devices"', "what": '"shard" divides expert regions: {"PP": 0, "EP": "*"}',
    "shard_optimizer": '"shard_grads" (ZeRO-2) and "shard_params" (ZeRO-3) are the replicate flags',
}

Filter = tuple[tuple[str, "int | str"], ...]    # a filter's (tag, index or "*") pairs, in the program's order


def show(value, budget: int = 40) -> str:
    """`value` as short JSON for a message: strings cut, lists and objects elided past `budget` characters."""
    if isinstance(value, str):
        text = json.dumps(value[:budget])
        return text if len(value) <= budget else text[:-1] + '..."'
    if isinstance(value, (list, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts, used = [], 0
        for k, v in items:
            if used > budget:
                parts.append("...")
                break
            part = show(v, max(8, budget // 3))
            parts.append(f"{show(str(k), 12)}: {part}" if isinstance(value, dict) else part)
            used += len(parts[-1]) + 2
        inner = ", ".join(parts)
        return f"{{{inner}}}" if isinstance(value, dict) else f"[{inner}]"
    return json.dumps(value) if isinstance(value, (bool, int, float)) or value is None else type(value).__name__


def key_path(path: str, key) -> str:
    """`[3].filter` + `PP` -> `[3].filter.PP`; a key that is not a plain name is quoted."""
    plain = isinstance(key, str) and key.isidentifier() and key.isascii() and len(key) <= 40
    return f"{path}.{key}" if plain else f"{path}[{show(key, 20)}]"


class Problems:
    """What a program's reading and translation found: errors, warnings, and the paths of dropped fields."""

    def __init__(self, file: str):
        self.file = file
        self.found: list[Diagnostic] = []
        self.dropped: list[str] = []
        self.error_count = 0

    @property
    def full(self) -> bool:
        """MAX_ERRORS errors found: reading stops (a hostile program could hold a million)."""
        return self.error_count >= MAX_ERRORS

    def _add(self, diagnostic: Diagnostic) -> None:
        if diagnostic.severity == "error":
            if self.full:
                return
            self.error_count += 1
        self.found.append(diagnostic)

    def _where(self, path: str, message: str) -> str:
        return f"{self.file} {path}: {message}"

    def unsupported(self, path: str, message: str, hint: str | None = None) -> None:
        self._add(Diagnostic("prototype-unsupported", self._where(path, message), "error", hint=hint))

    def bad(self, path: str, message: str, hint: str | None = None) -> None:
        self._add(Diagnostic("bad-program-json", self._where(path, message), "error", hint=hint))

    def dropped_fields(self, path: str, message: str, hint: str | None = None) -> None:
        self._add(Diagnostic("prototype-dropped", self._where(path, message), "warning", hint=hint))

    def widened(self, path: str, message: str, hint: str | None = None) -> None:
        self._add(Diagnostic("prototype-widened", self._where(path, message), "warning", hint=hint))

    @property
    def failed(self) -> bool:
        return self.error_count > 0

    def all(self) -> list[Diagnostic]:
        """Everything found, with a last word when reading stopped at MAX_ERRORS errors."""
        if not self.full:
            return list(self.found)
        return self.found + [Diagnostic("bad-program-json", f"{self.file}: reading stopped after {MAX_ERRORS} "
                                        "errors", "note", hint="fix these and import again")]


@dataclass(frozen=True)
class Place:
    at: str
    filter: Filter
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Replicate:
    at: str
    filter: Filter
    devices: tuple[int, ...]
    zero: int                   # 0: gradients all-reduced; 2: shard_grads (ZeRO-2); 3: shard_params (ZeRO-3)


@dataclass(frozen=True)
class Shard:
    at: str
    filter: Filter
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Split:
    at: str
    filter: Filter
    dim: str
    count: int


@dataclass(frozen=True)
class Item:
    """One filter of an order slot: a pass (None: the filter names none) and its other tags."""
    at: str
    pass_: str | None
    tags: Filter


@dataclass(frozen=True)
class Order:
    at: str
    slots: tuple[tuple[Item, ...], ...]


def is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INDEX


def _tag_value(value, path: str, problems: Problems):
    """A filter value: an index, or "*"; a string of digits is its number, as the prototype reads it."""
    if value == "*" or is_index(value):
        return value
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value)
    problems.bad(path, f"a filter's value is a tag index (0, 1, ...) or \"*\", not {show(value)}")
    return None


def read_filter(value, path: str, problems: Problems, *, passes: bool = False) -> Filter | None:
    """{"PP": 1, "EP": "*"} -> (("PP", 1), ("EP", "*")); with `passes`, "PASS" may name one of PASSES."""
    if not isinstance(value, dict):
        problems.bad(path, f'a filter is an object of tags, such as {{"PP": 1}} or {{"PP": 1, "EP": "*"}}, not '
                     f"{show(value)}")
        return None
    out = []
    for tag, index in value.items():
        if type(index) is int and 0 <= index <= MAX_INDEX and tag != "PASS" and tag.isidentifier() \
                and len(tag) <= MAX_NAME:
            out.append((tag, index))    # the common case, first
            continue
        at = key_path(path, tag)
        if not tag.isidentifier() or len(tag) > MAX_NAME:
            problems.bad(at, f"{show(tag)} is not a tag name",
                         hint=f"tags are names such as PP, EP and MB, of at most {MAX_NAME} characters")
            return None
        if tag == "PASS":
            if not passes:
                problems.unsupported(at, "this directive applies to every pass of its regions; only an order's "
                                     "filters name a PASS", hint='drop "PASS" here')
                return None
            if index not in PASSES:
                problems.bad(at, f"unknown pass {show(index)}",
                             hint=did_you_mean(index if isinstance(index, str) else "", PASSES)
                             or "passes are F, B, BI and BW")
                return None
            out.append((tag, index))
            continue
        index = _tag_value(index, at, problems)
        if index is None:
            return None
        out.append((tag, index))
    return tuple(out)


def _devices(d: dict, at: str, problems: Problems) -> tuple[int, ...] | None:
    key = "devices" if "devices" in d or "device" not in d else "device"
    value = d.get(key)
    path = f"{at}.{key}"
    if not isinstance(value, list) or not value:
        problems.bad(path, f"devices are a non-empty list of device numbers, not {show(value)}")
        return None
    for i, device in enumerate(value):
        if not (isinstance(device, int) and not isinstance(device, bool) and 0 <= device < MAX_DEVICE):
            problems.bad(f"{path}[{i}]", f"a device is a number from 0 to {MAX_DEVICE - 1:,}, not {show(device)}")
            return None
    devices = tuple(sorted(set(value)))
    if len(devices) != len(value):
        problems.bad(path, f"{show(value)} names a device twice")
        return None
    return devices


def _streams(d: dict, at: str, problems: Problems, *names: str) -> bool:
    """Note the streams `d` names as dropped; False (with an error) for a stream that is not a name."""
    for name in names:
        if name in d:
            if d[name] is not None and not isinstance(d[name], str):
                problems.bad(f"{at}.{name}", f"a stream is a name, not {show(d[name])}")
                return False
            problems.dropped.append(f"{at}.{name}")
    return True


def _flag(d: dict, name: str, at: str, problems: Problems) -> bool | None:
    value = d.get(name, False)
    if not isinstance(value, bool):
        problems.bad(f"{at}.{name}", f"{name} is true or false, not {show(value)}")
        return None
    return value


def _place(d: dict, at: str, problems: Problems):
    filter_ = read_filter(d.get("filter"), f"{at}.filter", problems)
    devices = _devices(d, at, problems)
    if filter_ is None or devices is None or not _streams(d, at, problems, "stream"):
        return None
    return Place(at, filter_, devices)


def _replicate(d: dict, at: str, problems: Problems):
    filter_ = read_filter(d.get("filter"), f"{at}.filter", problems)
    devices = _devices(d, at, problems)
    grads, params = _flag(d, "shard_grads", at, problems), _flag(d, "shard_params", at, problems)
    ok = _streams(d, at, problems, "reduce_stream", "gather_stream")
    if "bucket_size" in d:
        size = d["bucket_size"]
        if not (isinstance(size, (int, float)) and not isinstance(size, bool) and 0 < size < MAX_INDEX):
            problems.bad(f"{at}.bucket_size", f"a bucket size is a number of MB > 0, not {show(size)}")
            return None
        problems.dropped.append(f"{at}.bucket_size")
    if filter_ is None or devices is None or grads is None or params is None or not ok:
        return None
    # The prototype's replicate: shard_params gathers parameters and reduce-scatters gradients (ZeRO-3,
    # whatever shard_grads says); shard_grads alone reduce-scatters (ZeRO-2); neither all-reduces.
    return Replicate(at, filter_, devices, 3 if params else 2 if grads else 0)


def _shard(d: dict, at: str, problems: Problems):
    filter_ = read_filter(d.get("filter"), f"{at}.filter", problems)
    devices = _devices(d, at, problems)
    if filter_ is None or devices is None or not _streams(d, at, problems, "stream"):
        return None
    return Shard(at, filter_, devices)


def _split(d: dict, at: str, problems: Problems):
    filter_ = read_filter(d.get("filter"), f"{at}.filter", problems)
    dim, count = d.get("dim_name"), d.get("num_microbatches")
    if not isinstance(dim, str) or not dim.isidentifier() or len(dim) > MAX_NAME:
        problems.bad(f"{at}.dim_name", f"a split's dim_name is the name of the new tag, such as \"MB\", not "
                     f"{show(dim)}")
        return None
    if not is_index(count) or count < 1:
        problems.bad(f"{at}.num_microbatches", f"the number of microbatches is an integer >= 1, not {show(count)}")
        return None
    return None if filter_ is None else Split(at, filter_, dim, count)


def _order(d: dict, at: str, problems: Problems):
    filters = d.get("filters")
    if not isinstance(filters, list) or not filters:
        problems.bad(f"{at}.filters", 'an order\'s filters are a non-empty list of slots, each a list of filters: '
                     '[[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 0, "PASS": "B"}]]')
        return None
    slots = []
    for j, group in enumerate(filters):
        path = f"{at}.filters[{j}]"
        if not isinstance(group, list) or not group:
            problems.bad(path, f"a slot is a non-empty list of filters, not {show(group)}",
                         hint="write one filter as a list of one: [{\"PP\": 0, \"MB\": 0, \"PASS\": \"F\"}]")
            return None
        items = []
        for k, flt in enumerate(group):
            tags = read_filter(flt, f"{path}[{k}]", problems, passes=True)
            if tags is None:
                return None
            pass_ = next((v for t, v in tags if t == "PASS"), None)
            items.append(Item(f"{path}[{k}]", pass_, tuple((t, v) for t, v in tags if t != "PASS")))
        slots.append(tuple(items))
    return Order(at, tuple(slots))


READERS = {"place": _place, "replicate": _replicate, "shard": _shard, "split": _split, "order": _order}


def read_directive(d, at: str, problems: Problems):
    """One directive object -> its record, or None with the reasons in `problems`."""
    if not isinstance(d, dict):
        problems.bad(at, f'a directive is an object with an "op", not {show(d)}')
        return None
    op = d.get("op")
    if not isinstance(op, str) or op not in READERS:
        problems.bad(f"{at}.op", f"unknown directive {show(op)}",
                     hint=did_you_mean(op if isinstance(op, str) else "", OPS) or f"directives are {', '.join(OPS)}")
        return None
    unknown = [k for k in d if k not in FIELDS[op]]
    if unknown:
        k = unknown[0]
        hint = _EARLIER.get(k) or did_you_mean(k[:40], FIELDS[op]) or f"{op} takes {', '.join(FIELDS[op][1:])}"
        problems.bad(key_path(at, k), f"{op} has no field {show(k)}", hint=hint)
        return None
    if op != "order" and "filter" not in d:
        problems.bad(f"{at}.filter", f"{op} needs a filter", hint="the empty filter {} selects the whole model")
        return None
    return READERS[op](d, at, problems)
