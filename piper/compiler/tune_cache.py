"""`piper tune`'s measurement cache on disk: JSON files with a format version, read back only into the
dataclasses a caller names. Nothing in a cache file runs when it is read (a pickle would run what it names).

    value = cached({"what": "machine"}, measure, types=())     # read tune-<hash>.json, else measure and store

A file that does not parse, has another version or key, or names a type the caller did not allow
is ignored (one line through `log`, no traceback) and the value measured again; so is one that is
not the user's own (`cache_dir.distrusted`: another user's, or writable by others) and one that is
not a regular file of at most `MAX_BYTES` (read by `user_files.read_text`: a FIFO does not block,
`/dev/zero` does not fill memory). A cache is never worth failing a run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys

FORMAT = "piper-tune-cache"
VERSION = 3        # 2: pickles (`tune-*.pkl`, never read now); 3: this JSON form
# A profile holds an entry per parameter and region: 15 KB for examples/gpt.py's small_gpt (4 layers),
# so some hundreds of KB for 80 layers; 32 MiB is far past any, and bounds what a bad file costs.
MAX_BYTES = 32 << 20


class CacheFormatError(ValueError):
    """A cache file that is not one this version wrote."""


def encode(value):
    """`value` as JSON-ready data: scalars as they are, tuples, lists, dicts (any hashable keys),
    torch dtypes and dataclasses tagged with what they were.

        encode((1, {2: 0.5})) == {"tuple": [1, {"dict": [[2, 0.5]]}]}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return {"list": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"dataclass": type(value).__name__, "fields": fields}
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return {"dtype": str(value).removeprefix("torch.")}
    raise TypeError(f"tune's cache cannot store a {type(value).__name__}")


def decode(data, types=()):
    """The value `encode` made `data` from; a dataclass only if it is one of `types` (by name).
    Raises `CacheFormatError` for anything else."""
    allowed = {t.__name__: t for t in types}

    def walk(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if not isinstance(x, dict) or len(x) not in (1, 2):
            raise CacheFormatError(f"unexpected {type(x).__name__} in the file")
        if "tuple" in x and len(x) == 1:
            return tuple(walk(v) for v in _array(x["tuple"]))
        if "list" in x and len(x) == 1:
            return [walk(v) for v in _array(x["list"])]
        if "dict" in x and len(x) == 1:
            pairs = [_array(p) for p in _array(x["dict"])]
            if any(len(p) != 2 for p in pairs):
                raise CacheFormatError("a dict entry that is not a [key, value] pair")
            return {walk(k): walk(v) for k, v in pairs}
        if "dtype" in x and len(x) == 1:
            import torch

            dtype = getattr(torch, str(x["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CacheFormatError(f"unknown dtype {x['dtype']!r}")
            return dtype
        if set(x) == {"dataclass", "fields"}:
            cls = allowed.get(x["dataclass"])
            if cls is None or not isinstance(x["fields"], dict):
                raise CacheFormatError(f"a {x['dataclass']!r}, which this cache does not hold")
            names = {f.name for f in dataclasses.fields(cls) if f.init}
            if not set(x["fields"]) <= names:
                raise CacheFormatError(f"fields {sorted(set(x['fields']) - names)} that {cls.__name__} lacks")
            return cls(**{k: walk(v) for k, v in x["fields"].items()})
        raise CacheFormatError(f"an entry tagged {sorted(x)}")

    return walk(data)


def _array(x) -> list:
    if not isinstance(x, list):
        raise CacheFormatError(f"a {type(x).__name__} where a list belongs")
    return x


def cache_key(key: dict) -> dict:
    """`key` with what else makes a measurement invalid: this machine, torch, the cache's version."""
    import torch

    return {**key, "host": socket.gethostname(), "torch": torch.__version__, "version": VERSION}


def cache_path(full: dict) -> str:
    """The file for a full key (`cache_key`) in the cache folder (`piper.cache_dir`), which is made
    (private, where this makes it)."""
    from ..cache_dir import make_cache_dir

    folder = make_cache_dir()
    digest = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return os.path.join(folder, f"tune-{digest}.json")


def read(path: str, full: dict, types=()):
    """The value stored at `path` for `full`; `CacheFormatError` if the file is not one this version
    wrote for that key, not the user's own or not a regular file of at most `MAX_BYTES`;
    `FileNotFoundError` if there is none."""
    from ..cache_dir import distrusted
    from ..diagnostics import PiperError
    from ..user_files import read_text

    reason = distrusted(path)
    if reason is not None:
        raise CacheFormatError(f"{reason}, so it is not read (the cache folder must be yours alone: "
                               f"`chmod 700 {os.path.dirname(path)}`, or set PIPER_CACHE to one that is)")
    try:
        text = read_text(path, limit=MAX_BYTES, what="the tune cache file")
    except PiperError as err:
        if err.code == "file-not-found":
            raise FileNotFoundError(path) from None
        raise CacheFormatError(err.diagnostics[0].message) from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:      # JSONDecodeError, and an int too long to convert
        raise CacheFormatError(f"not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CacheFormatError("not a tune cache file")
    if data.get("version") != VERSION:
        raise CacheFormatError(f"version {data.get('version')!r}, not {VERSION}")
    if data.get("key") != json.loads(json.dumps(full, sort_keys=True, default=str)):
        raise CacheFormatError("stored for another key")
    try:
        return decode(data.get("value"), types)
    except (TypeError, ValueError, RecursionError) as err:     # a dataclass refusing its fields, too
        raise CacheFormatError(str(err)) from None


def write(path: str, full: dict, value) -> None:
    """Store `value` for `full` at `path` (atomically: a reader sees the old file or the new)."""
    text = json.dumps({"format": FORMAT, "version": VERSION, "key": json.loads(json.dumps(full, default=str)),
                       "value": encode(value)})
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)                  # left by a run of the same pid that died
    except FileNotFoundError:
        pass
    # The user's alone whatever the umask (a group-writable file would be ignored when read back);
    # O_EXCL: a link planted at the temporary name is not followed.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def cached(key: dict, make, *, types=(), again: bool = False, log=None):
    """The value stored under `key` (and this machine, torch and version), else (or with `again`)
    `make()`, stored there unless it is None. `types`: the dataclasses the value may hold; a file
    that holds anything else, or is not this version's, is ignored with a line through `log`."""
    say = log or (lambda m: print(f"piper: {m}", file=sys.stderr))
    full = cache_key(key)
    try:
        path = cache_path(full)
    except OSError as err:
        say(f"cannot make the cache folder ({err.strerror or err}): measuring without a cache")
        return make()
    if not again:
        try:
            return read(path, full, types)
        except FileNotFoundError:
            pass
        except OSError as err:
            say(f"cannot read the cache file {path} ({err.strerror or err}): measuring again")
        except CacheFormatError as err:
            say(f"ignoring the cache file {path}: {err}; measuring again")
    value = make()
    if value is None:          # nothing made: try again next time
        return value
    from ..cache_dir import distrusted

    if distrusted(path, folder_only=True) is None:     # a folder others may write: keep nothing there
        try:
            write(path, full, value)
        except OSError:
            pass
    return value
