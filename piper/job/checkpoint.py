"""`job.save(path)` / `job.load(path)`: checkpoints in torch.distributed.checkpoint (DCP)
format that any strategy on any mesh can load.

    job.save("ckpt/step-100")      # every worker writes its own shards, at once
    job.load("ckpt/step-100")      # into a job of any strategy and mesh: resharded on read

A checkpoint is a DCP directory (`.metadata`, one `__R_0.distcp` file per writing
worker R, and `piper.json`: each file's size and CRC-32, and the checkpoint's id) holding

    model.<name>                   every parameter and persistent buffer, model.state_dict() names and shapes
    optim.state.<name>.<key>       the optimizer's state per parameter (AdamW: exp_avg, exp_avg_sq, step)
    piper.<key>                    step, strategy, mesh, world_size, zero, microbatches, format, checksums
                                   (and data_position, the global batches read, for a job with data=)
    piper.ids.<R>                  the checkpoint's id, in worker R's own data file

so it does not depend on the strategy that wrote it: regions, pipeline stages,
flat ZeRO units and expert rows under `shard experts` are the job's business,
not the file's (see
`piper.runtime.state.checkpoint` for how a flat shard is described).

A save is atomic (written beside the path, renamed into place); a load first
verifies every file's checksum and reads everything as data only, running no
code a crafted file names (`piper.runtime.state.checkpoint_files`), and every file
through `piper.user_files` (regular files inside the folder, bounded sizes).

The files of one checkpoint are bound together by a random id (`uuid4`), written into
`piper.json` and each file's entry there, into `.metadata` (DCP's `save_id`) and into
each data file (`piper.ids.<R>`): a file copied in from another checkpoint, even of the
same model and with its `piper.json` entry, carries the other id and is refused, and
every file the index needs must be listed. Checkpoints saved before the id was written
(no `checkpoint_id` in `piper.json`, no `piper.ids` in the index) load as before, their
files still checked by size and CRC-32. `verify_checkpoint`
does the checking alone, and `to_torch_save(dir, file)` turns a checkpoint into
one `torch.save` file that `torch.load(file, weights_only=True)["model"]` loads
into the plain model.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid

from ..frontend import loss_scaling
from ..diagnostics import PiperError, clip, error

FORMAT = 1                  # the layout of the entries below; checksums and ids add entries, not a format
METADATA = ".metadata"
# {"checksums": "crc32", "checkpoint_id": id, "files": {name: {"bytes": n, "crc32": c, "checkpoint_id": id}}}
MANIFEST = "piper.json"
CHECKSUM = "crc32"
IDS = "ids"                 # piper.ids.<rank>
# About 110 bytes a file (name, size, CRC-32, id, indented): 16 MiB is some 150,000 data files.
MAX_MANIFEST_BYTES = 16 << 20
# Steps and batch counts are whole numbers a float64 holds exactly; no run takes 2**53 steps.
MAX_STEP = 2 ** 53


def describe_strategy(strategy, overrides=None) -> str:
    """A readable name for the strategy a job was compiled with (kept as metadata only)."""
    if strategy is None:
        text = "none (one device)"
    elif isinstance(strategy, (str, os.PathLike)):
        text = os.fspath(strategy)                  # a script's path, or its text
    elif callable(getattr(strategy, "fn", None)):   # @piper.strategy
        fn = strategy.fn
        text = f"{fn.__module__}.{fn.__qualname__}"
        if getattr(strategy, "params", None):
            text += "(" + ", ".join(f"{k}={v!r}" for k, v in dict(strategy.params).items()) + ")"
    elif hasattr(strategy, "file"):                 # a loaded .pps script
        text = f"script {strategy.file}"
        if getattr(strategy, "overrides", None):
            text += " with " + ", ".join(f"{k}={v!r}" for k, v in strategy.overrides.items())
    else:
        text = repr(strategy)
    if overrides:
        text += " with " + ", ".join(f"{k}={v}" for k, v in overrides.items())
    return text


def model_keys(model, program) -> tuple[frozenset, dict[str, str]]:
    """(the model's state_dict names, {alias: name} for tied parameters).

    Capture keeps one name per tensor (`wte.weight` for a head tied to the embedding);
    `model.state_dict()` has both, so a checkpoint holds both too (the alias's chunks
    are written twice), for the converted file to load into the plain model strictly."""
    state = model.state_dict(keep_vars=True)
    owner = {id(t): name for name, t in state.items() if name in program.params}
    aliases = {name: owner[id(t)] for name, t in state.items()
               if name not in program.params and id(t) in owner}
    return frozenset(state), aliases


def _persistent_buffers(job) -> list[str]:
    return [k for k in job._buffers if k in job.state_keys]


# -- save: into a new sibling directory, renamed into place once whole -----------------------

def save(job, path) -> str:
    """Write `job`'s parameters, persistent buffers, optimizer state and step count to the
    DCP directory `path`, atomically: everything goes into a new sibling directory that then
    takes `path`'s place in one rename, so `path` holds the old checkpoint or the new one,
    whole, whatever stops the save (a worker lost, a full disk, the driver killed). A save
    that fails is `checkpoint-save-failed`, the old checkpoint untouched and the job still
    running. Returns the absolute path."""
    job._check_open()
    path = os.path.abspath(os.fspath(path))
    target = os.path.realpath(path)                  # a symlink's target is what gets replaced
    _check_replaceable(target)
    try:
        staging = _staging_dir(target)
    except OSError as exc:                           # a parent that cannot be written
        raise _save_failed(f"{type(exc).__name__}: {exc}") from None
    identity = uuid.uuid4().hex
    try:
        files = write(job, staging, identity=identity)
        try:
            files[METADATA] = _files().checksum(os.path.join(staging, METADATA))
            _write_manifest(staging, files, identity)
            _swap_into_place(staging, target)
        except OSError as exc:                       # the driver's part: a full disk, permissions
            raise _save_failed(f"{type(exc).__name__}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)   # after the swap it holds the old checkpoint
    return path


def _save_failed(why: str):
    return error("checkpoint-save-failed", f"the checkpoint could not be written: {why}",
                 notes=("nothing was replaced: the path holds what it held before, and the job still runs",),
                 hint="make room or pick a writable path (on a cluster, one every node mounts), then save again")


def write(job, directory, *, checksums: bool = True, identity: str | None = None) -> dict[str, dict]:
    """Every worker writes its shards into `directory` (rank 0 the buffers and `piper.*`; each
    rank `identity` as its `piper.ids.<rank>`, and into `.metadata`), in place; {file:
    checkpoint_files.checksum} of the data files ({} without `checksums`).
    `save` is this into a staging directory, plus the manifest and the rename."""
    meta = {"format": FORMAT, "step": job.steps, "strategy": job.strategy, "mesh": dict(job.mesh.axes),
            "world_size": job.mesh.world_size, "zero": job.compiled.zero, "microbatches": job.microbatches}
    if checksums:                           # a checkpoint with this key is verified against MANIFEST
        meta["checksums"] = CHECKSUM
    if job.data is not None:                # data=: the global batches read, so a resumed run reads on
        meta["data_position"] = job.data_position
    scaler = loss_scaling.checkpoint_state(job)
    if scaler is not None:                  # fp16: a resumed run goes on at the same loss scale
        meta["loss_scale"] = scaler
    # The buffers are the job's constants, held by the driver: rank 0 writes them with the metadata.
    first = {"model": {k: job._buffers[k] for k in _persistent_buffers(job)}, "piper": meta}
    # A parameter tied across pipeline stages has an identical copy on each: the first unit's is written.
    copies: dict = {}
    for u in sorted(job.layouts):
        for bucket in job.layouts[u].buckets:
            if getattr(bucket, "tied", None) is not None:
                for e in bucket.entries:
                    copies.setdefault(e.name, []).append(u)
    skip = {(u, name) for name, units in copies.items() for u in units[1:]}
    directory = os.fspath(directory)
    def extra(rank: int) -> dict:
        mine = {k: dict(v) for k, v in first.items()} if rank == 0 else {}
        if identity is not None:
            mine.setdefault("piper", {})[IDS] = {str(rank): identity}
        return mine

    refs = [a.save_checkpoint.remote(directory, extra(rank), job.aliases, skip, checksums)
            for rank, a in enumerate(job.actors)]
    results = job._get(refs, "save")
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise _save_failed(failed[0])
    job.saved_bytes = {rank: r["bytes"] for rank, r in enumerate(results)}
    return {name: sums for r in results for name, sums in r["files"].items()}


def _check_replaceable(path: str) -> None:
    """`path` is free, an empty directory or a checkpoint (which `save` replaces), or a
    `checkpoint-save-failed` error: other files would be lost with the directory."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise error("checkpoint-save-failed", f"{path} is a file, not a checkpoint directory",
                    hint="save to a new path or to an earlier checkpoint's directory")
    others = sorted(n for n in os.listdir(path) if not _CHECKPOINT_FILE.fullmatch(n))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise error("checkpoint-save-failed", f"{path} holds files that are not a checkpoint's ({shown}): "
                    "saving replaces the whole directory, and they would be lost",
                    hint="save to a new path (or an empty directory), or move those files out first")


# The files of a checkpoint (DCP's index, data files, per-rank index, its leftover temporary, ours).
_CHECKPOINT_FILE = re.compile(r"\.metadata(\.tmp)?|__\d+_\d+\.distcp|__\d+\.metadata(\.tmp)?|piper\.json")


def _staging_dir(path: str) -> str:
    """A new, empty sibling of `path` to write into (same file system, so a rename moves it),
    after removing those an earlier save of `path` left when its process was killed."""
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    stale = re.compile(re.escape(f".{name}.saving-") + r"[0-9a-f]{12}\Z")
    for other in os.listdir(parent):
        if stale.match(other):
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)
    staging = os.path.join(parent, f".{name}.saving-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)
    return staging


def _write_manifest(directory: str, files: dict[str, dict], identity: str | None = None) -> None:
    """MANIFEST: the size and checksum of every file (and the checkpoint's `identity`, in each
    file's entry too), flushed to disk with the directory."""
    head: dict = {"checksums": CHECKSUM}
    if identity is not None:
        head["checkpoint_id"] = identity
        files = {name: {**sums, "checkpoint_id": identity} for name, sums in files.items()}
    text = json.dumps({**head, "files": dict(sorted(files.items()))}, indent=1)
    with open(os.path.join(directory, MANIFEST), "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _swap_into_place(new: str, path: str) -> None:
    """Make directory `new` be `path`. An existing `path` trades places with `new` in one
    atomic rename (Linux's renameat2 RENAME_EXCHANGE), so `new` then holds the old one; where
    the file system cannot, the old one is renamed aside into `new`'s place first (a moment
    in which `path` is missing, the old checkpoint whole next to it)."""
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(new, path)
    elif not _exchange(new, path):
        aside = new + ".old"
        os.rename(path, aside)
        os.rename(new, path)
        os.rename(aside, new)
    _fsync_dir(parent)


def _exchange(a: str, b: str) -> bool:
    """Swap paths `a` and `b` atomically; False where the system or file system cannot."""
    import sys

    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):           # a C library before glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, exchange = -100, 2                  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


# -- read and verify, running no code --------------------------------------------------------

def _files():
    """`piper.runtime.state.checkpoint_files`, imported on use (torch.distributed.checkpoint costs about a second)."""
    from ..runtime.state import checkpoint_files

    return checkpoint_files


_FIX = ("pass the directory job.save(path) wrote (it holds a `.metadata` file); `piper run "
        "--checkpoint-dir DIR` writes them as DIR/step-N")


def read_metadata(path):
    """The DCP metadata of checkpoint `path`, read without running code
    (`runtime.state.checkpoint_files.MetadataUnpickler`) through `user_files` (a regular file
    inside the checkpoint), or a `not-a-checkpoint` (`unreadable-file`) error saying why not."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise error("not-a-checkpoint", f"{path} {what}, so it is not a checkpoint directory", hint=_FIX)
    if not os.path.lexists(os.path.join(path, METADATA)):
        raise error("not-a-checkpoint", f"{path} has no `.metadata` file: it is not a finished checkpoint "
                    "(an interrupted save leaves none)", hint=_FIX)
    try:
        md = _files().Reader(path).read_metadata()
    except _files().UnsafeFile as exc:
        raise _unsafe(path, METADATA, exc) from None
    except PiperError:
        raise
    except Exception as exc:
        raise error("not-a-checkpoint", f"cannot read the checkpoint metadata in {path}: "
                    f"{type(exc).__name__}: {clip(exc, 200)}", hint=_FIX) from None
    _check_shape(path, md)
    return md


def _check_shape(path: str, md) -> None:
    """The metadata holds what DCP's does (a crafted pickle may build these classes with
    anything inside): `not-a-checkpoint` otherwise, so nothing later meets a surprise."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)

    def bad(why: str):
        return _unsafe(path, METADATA, f"its index is malformed ({why})")

    keys, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    planner = getattr(md, "planner_data", None)
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(
            v, (TensorStorageMetadata, BytesStorageMetadata)) for k, v in keys.items()):
        raise bad("its entries are not named tensors and items")
    if not isinstance(storage, dict):
        raise bad("no table of where each entry is stored")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) or not all(
                type(getattr(info, a, None)) is int and getattr(info, a) >= 0 for a in ("offset", "length")):
            raise bad("an entry's place in its file is not two whole numbers")
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise _unsafe(path, METADATA, f"it names data outside the checkpoint directory ({clip(repr(name), 80)})")
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(k, str) and isinstance(v, (tuple, list)) and v and all(isinstance(p, (str, int)) for p in v)
            for k, v in planner.items())):
        raise bad("the places of its entries are not lists of names")


def _unsafe(path: str, name: str, exc) -> Exception:
    return error("not-a-checkpoint", f"{os.path.join(path, name)} is not a checkpoint's: {exc}",
                 notes=("nothing in it was run: checkpoint files are read as data only",),
                 hint="load only checkpoints job.save or torch.distributed.checkpoint wrote; this one was "
                      "made or changed by something else")


def verify_checkpoint(path) -> None:
    """Check that `path` is a whole checkpoint that loads without running code, or raise
    `PiperError`: `not-a-checkpoint` (no `.metadata`, a crafted one, an item that is not plain
    data, a step out of range), `checkpoint-corrupt` (a data file missing or shorter than its
    index says, a file whose size or CRC-32 differs from what the save recorded in `piper.json`,
    a file the index needs that `piper.json` does not list, a file of another checkpoint) or
    `unreadable-file` (a file that is not a regular one inside the folder: a FIFO, a device).
    Reads every byte once (CRC-32, about 2 GB/s per core, files in parallel); loads nothing.
    A checkpoint torch wrote has no `piper.json`: only its index and items are checked.

        verify_checkpoint("ckpt/step-100")        # None, or raises
    """
    _verify(os.path.abspath(os.fspath(path)))


def _verify(path: str):
    """`verify_checkpoint`; returns the DCP metadata."""
    md = read_metadata(path)
    manifest = _read_manifest(path)
    storage: dict[str, int] = {}
    for info in md.storage_data.values():
        storage[info.relative_path] = max(storage.get(info.relative_path, 0), info.offset + info.length)
    keys = md.state_dict_metadata
    if manifest is None and "piper.checksums" in keys:
        raise error("checkpoint-corrupt", f"{os.path.join(path, MANIFEST)} is missing: the checkpoint's "
                    "files cannot be checked", hint=_CORRUPT_FIX)
    for name, end in sorted(storage.items()):
        full = os.path.join(path, name)
        size = _size(path, name)
        if size is None:
            raise error("checkpoint-corrupt", f"{full} is missing: the checkpoint's index names it",
                        hint=_CORRUPT_FIX)
        if size < end:
            raise error("checkpoint-corrupt", f"{full} holds {size} bytes, and the "
                        f"checkpoint's index reads up to byte {end}: it was cut short", hint=_CORRUPT_FIX)
    if manifest is not None:
        files, identity = manifest
        unlisted = sorted((set(storage) | {METADATA}) - set(files))
        if unlisted:
            raise error("checkpoint-corrupt", f"{os.path.join(path, unlisted[0])} has no checksum in "
                        f"{MANIFEST}: the checkpoint was changed after its save", hint=_CORRUPT_FIX)
        _check_sums(path, files)
        _check_identity(path, md, files, identity)
    items = _check_items(path, md)
    if "piper.step" in keys:
        _check_info(path, items.get("piper"))
    if manifest is not None and manifest[1] is not None:
        _check_ids(path, md, items, manifest[1])
    return md


_CORRUPT_FIX = ("load an earlier checkpoint, or copy this one again from where it came from "
                "(`piper.job.checkpoint.verify_checkpoint(path)` checks one)")


def _size(path: str, name: str) -> int | None:
    """The size of checkpoint file `name`, None when it is missing; `unreadable-file` when it is
    not a regular file inside the checkpoint (a FIFO, a device, a link out of the folder)."""
    from ..user_files import regular_file

    try:
        return regular_file(os.path.join(path, name), what="the checkpoint file", inside=path)
    except PiperError as err:
        if err.code == "file-not-found":
            return None
        raise


def _read_manifest(path: str) -> tuple[dict[str, dict], str | None] | None:
    """({file: {"bytes", "crc32"[, "checkpoint_id"]}}, the checkpoint's id or None) from MANIFEST,
    None without one; `not-a-checkpoint` if malformed, `unreadable-file` if not a regular file."""
    from ..user_files import read_text

    full = os.path.join(path, MANIFEST)
    try:
        text = read_text(full, limit=MAX_MANIFEST_BYTES, what="the checkpoint manifest", inside=path)
    except PiperError as err:
        if err.code == "file-not-found":
            return None
        raise
    bad = error("not-a-checkpoint", f"{full} is not the manifest job.save writes", hint=_FIX)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise bad from None
    if not isinstance(data, dict):
        raise bad
    files, identity = data.get("files"), data.get("checkpoint_id")
    if data.get("checksums") != CHECKSUM or not isinstance(files, dict) \
            or not (identity is None or _is_id(identity)) \
            or not all(isinstance(k, str) and os.path.basename(k) == k and k not in ("", ".", "..")
                       and isinstance(v, dict) and type(v.get("bytes")) is int and v["bytes"] >= 0
                       and type(v.get("crc32")) is int and 0 <= v["crc32"] < 2 ** 32
                       and (identity is None or _is_id(v.get("checkpoint_id")))
                       for k, v in files.items()):
        raise bad
    return files, identity


def _is_id(value) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value) is not None


def _check_sums(path: str, manifest: dict[str, dict]) -> None:
    """Every file of `manifest` has its size and CRC-32, or `checkpoint-corrupt` naming the first
    that has not (`unreadable-file` for one that is not a regular file inside the checkpoint)."""
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(manifest)
    sizes = {name: _size(path, name) for name in names}     # special files refused before any is read

    def check(name):
        full = os.path.join(path, name)
        if sizes[name] is None:
            return f"{full} is missing"
        if sizes[name] != manifest[name]["bytes"]:
            return f"{full} holds {sizes[name]} bytes, and {manifest[name]['bytes']} were saved"
        got = _files().checksum(full, inside=path)
        if got["bytes"] != manifest[name]["bytes"]:
            return f"{full} holds {got['bytes']} bytes, and {manifest[name]['bytes']} were saved"
        if got["crc32"] != manifest[name]["crc32"]:
            return (f"{full} does not match its checksum (CRC-32 {got['crc32']:08x}, saved "
                    f"{manifest[name]['crc32']:08x}): it was damaged or changed after the save")
        return None

    with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:   # zlib lets go of the GIL
        problems = [p for p in pool.map(check, names) if p]
    if problems:
        raise error("checkpoint-corrupt", problems[0],
                    notes=(f"{len(problems)} of its {len(names)} files are not as saved",) if len(problems) > 1 else (),
                    hint=_CORRUPT_FIX)


_MIXED = "files of two checkpoints were mixed"


def _mixed(full: str, why: str):
    return error("checkpoint-corrupt", f"{full} belongs to another checkpoint: {why}",
                 notes=(_MIXED + ": each file of a checkpoint carries the id its save drew, in piper.json "
                                 "and in the file",), hint=_CORRUPT_FIX)


def _check_identity(path: str, md, files: dict[str, dict], identity: str | None) -> None:
    """The manifest's id is in every file's entry and is `.metadata`'s save id; a checkpoint saved
    before ids has none anywhere (an index holding `piper.ids` needs a manifest holding the id)."""
    saved = getattr(getattr(md, "storage_meta", None), "save_id", None)
    has_ids = any(k.startswith(f"piper.{IDS}.") for k in md.state_dict_metadata)
    if identity is None:
        if has_ids:
            raise error("checkpoint-corrupt", f"{os.path.join(path, MANIFEST)} has no checkpoint id, and the "
                        "checkpoint's index says it was saved with one: the manifest was replaced",
                        hint=_CORRUPT_FIX)
        return
    for name, entry in sorted(files.items()):
        if entry["checkpoint_id"] != identity:
            raise _mixed(os.path.join(path, name), f"its entry in {MANIFEST} holds id {entry['checkpoint_id']}, "
                         f"and the checkpoint's is {identity}")
    if saved != identity or not has_ids:
        raise _mixed(os.path.join(path, METADATA), f"its save id is {clip(repr(saved), 40)}, and the "
                     f"checkpoint's is {identity}")


def _check_ids(path: str, md, items: dict, identity: str) -> None:
    """Every data file holds a `piper.ids.<rank>` equal to the checkpoint's id."""
    ids = items.get("piper", {}).get(IDS) if isinstance(items.get("piper"), dict) else None
    ids = ids if isinstance(ids, dict) else {}
    holder = {index.fqn[len(f"piper.{IDS}."):]: info.relative_path for index, info in md.storage_data.items()
              if index.fqn.startswith(f"piper.{IDS}.")}
    for rank, name in sorted(holder.items()):
        if ids.get(rank) != identity:
            raise _mixed(os.path.join(path, name), f"it holds id {clip(repr(ids.get(rank)), 40)}, and the "
                         f"checkpoint's is {identity}")
    without = sorted({info.relative_path for info in md.storage_data.values()} - set(holder.values()))
    if without:
        raise _mixed(os.path.join(path, without[0]), "it holds no id of this checkpoint")


def _check_items(path: str, md) -> dict:
    """Read every non-tensor item (Piper's metadata, optimizer counts) as data here, so a
    crafted one is refused before any worker reads the checkpoint; returns them, nested."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    items = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    return _read_nested(path, md, items, lambda fqn: None) if items else {}


def _check_info(path: str, info) -> dict:
    """Piper's `piper.*` entries as job.save writes them: a format this Piper reads, a step and a
    data position of 0 <= n < MAX_STEP; `not-a-checkpoint` otherwise."""
    found = info.get("format", FORMAT) if isinstance(info, dict) else None
    if not _count(found) or type(info.get("step")) is not int:       # bool is no step
        raise _unsafe(path, METADATA, "its `piper.*` entries are not the step count and format job.save writes")
    if found > FORMAT:
        raise error("not-a-checkpoint", f"{os.fspath(path)} is in checkpoint format {found}, newer than "
                    f"this Piper's {FORMAT}", hint="load it with the Piper that wrote it, or upgrade Piper")
    for key in ("step", "data_position"):
        if key in info and not (_count(info[key]) and info[key] < MAX_STEP):
            raise _unsafe(path, METADATA, f"its `piper.{key}` is {_shown_count(info[key])}, not a count of "
                          f"0 to 2**53")
    return info


def _count(value) -> bool:
    return type(value) is int and value >= 0          # bool is no count


def _shown_count(value) -> str:
    if type(value) is int and abs(value) >= 10 ** 30:
        return f"a {value.bit_length()}-bit number"
    return clip(repr(value), 40)


def read_info(path, md=None) -> dict:
    """The `piper.*` metadata of checkpoint `path` (step, strategy, mesh...), read on this
    process as data only (its DCP metadata `md` when read already).

    A DCP checkpoint another program wrote with torch's own layout (`get_state_dict`:
    `model.<name>`, `optim.state.<name>.<key>`, as FSDP2 training saves) loads too: its
    step is the optimizer's step count, and its strategy is unknown."""
    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path) if md is None else md
    keys = md.state_dict_metadata
    if "piper.step" in keys:
        info = _read_nested(path, md, [k for k in keys if k.startswith("piper.")], lambda fqn: None).get("piper")
        return _check_info(path, info)
    if not any(k.startswith("model.") for k in keys):
        raise error("not-a-checkpoint", f"{os.fspath(path)} is a DCP checkpoint, but holds no model "
                    "(no `model.*` keys)", hint="pass a directory job.save(path) wrote, or one saved from "
                    "torch's get_state_dict as {'model': ..., 'optim': ...}")
    step = 0
    counts = sorted(k for k in keys if k.startswith("optim.state.") and k.endswith(".step"))
    if counts:
        import torch

        try:
            state = _read_nested(path, md, counts[:1], lambda fqn: torch.zeros(keys[fqn].size))
            for part in _place(md, counts[0]):
                state = state[part]
            value = float(state)
        except PiperError:
            raise
        except Exception as exc:
            raise _unsafe(path, METADATA, f"its optimizer's step count cannot be read ({type(exc).__name__})") \
                from None
        if not (0 <= value < MAX_STEP and value == int(value)):
            raise _unsafe(path, METADATA, f"its optimizer's step count is {clip(repr(value), 40)}, not a count "
                          "of 0 to 2**53")
        step = int(value)
    return {"format": None, "step": step, "strategy": "unknown (not written by Piper)", "mesh": None}


def _place(md, fqn: str) -> tuple:
    """Where flattened key `fqn` sits in the nested dict that was saved (DCP's save planner
    keeps these mappings in the metadata)."""
    return (md.planner_data or {}).get(fqn, tuple(fqn.split(".")))


def _read_nested(path, md, fqns, make) -> dict:
    """The checkpoint's entries `fqns`, read on this process into a nested dict of their own
    shape, each first made by `make(fqn)`."""
    state: dict = {}
    for fqn in fqns:
        node = state
        place = _place(md, fqn)
        for part in place[:-1]:
            node = node.setdefault(part, {})
        node[place[-1]] = make(fqn)
    _read_here(state, path)
    return state


def _read_here(state: dict, path, *, whole: bool = False) -> None:
    """DCP's load in this process alone (the driver), in place into `state`, running no code
    (`checkpoint_files`); `whole`: every entry, into the empty dict `state`. A crafted file is
    `not-a-checkpoint`, one that cannot be read `checkpoint-corrupt`."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = os.path.abspath(os.fspath(path))
    try:
        with warnings.catch_warnings():      # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            if whole:                        # as DCP's dcp_to_torch_save reads
                reader = _files().Reader(path)
                _load_state_dict(state, storage_reader=reader, planner=_files().WholeLoadPlanner(),
                                 no_dist=True)
            else:
                _files().load(state, path, _files().LoadPlanner(), no_dist=True)
    except BaseException as exc:
        cause = _cause(exc)
        if isinstance(cause, PiperError):               # a file user_files refused (a FIFO, a device)
            raise cause from None
        if isinstance(cause, _files().UnsafeFile):
            raise _unsafe(path, "", cause) from None
        if cause is not exc or isinstance(exc, Exception):
            raise error("checkpoint-corrupt", f"cannot read checkpoint {path}: {type(cause).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else ''}", hint=_CORRUPT_FIX) from None
        raise


def _cause(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException, else `exc`."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        return next(iter(exc.failures.values()))[0]
    return exc


def to_torch_save(path, file) -> str:
    """Convert checkpoint `path` into one `torch.save` file, as DCP's `dcp_to_torch_save`
    does, after `verify_checkpoint` and reading as data only (torch's converter unpickles
    `.metadata` and its items as they come): `torch.load(file, weights_only=True)["model"]`
    then loads into the plain model. Returns `file`'s absolute path.

        to_torch_save("ckpt/step-100", "gpt.pt")
    """
    import torch

    path = os.path.abspath(os.fspath(path))
    _verify(path)
    state: dict = {}
    _read_here(state, path, whole=True)
    file = os.path.abspath(os.fspath(file))
    torch.save(state, file)
    return file


def _check_model(job, md, path: str, info: dict) -> None:
    """Same names and shapes as this job's model, or a `checkpoint-mismatch` error."""
    shapes = {k: job.program.whole_shape(k) for k in job.program.params}
    shapes.update({k: tuple(job._buffers[k].shape) for k in _persistent_buffers(job)})
    saved = {k[len("model."):]: v for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and k[len("model."):] not in job.aliases}
    missing = sorted(shapes.keys() - saved.keys())
    unexpected = sorted(saved.keys() - shapes.keys())
    wrong = sorted(k for k in shapes.keys() & saved.keys()
                   if tuple(getattr(saved[k], "size", ())) != shapes[k])
    if not (missing or unexpected or wrong):
        return

    def few(names):
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    notes = []
    if missing:
        notes.append(f"missing from the checkpoint ({len(missing)}): {few(missing)}")
    if unexpected:
        notes.append(f"in the checkpoint but not in this model ({len(unexpected)}): {few(unexpected)}")
    if wrong:
        notes.append(f"different shapes ({len(wrong)}): " + ", ".join(
            f"{k} saved {tuple(saved[k].size)}, here {shapes[k]}" for k in wrong[:5]))
    raise error("checkpoint-mismatch", f"{path} holds another model's parameters than this job's "
                f"({len(missing)} missing, {len(unexpected)} unexpected, {len(wrong)} of another shape)",
                notes=tuple(notes) + (f"it was saved at step {info.get('step')} by strategy "
                                      f"{info.get('strategy')} on mesh {info.get('mesh')}",),
                hint="load a checkpoint of this model (same class and configuration); the strategy and mesh "
                     "may differ. To use some of its weights, convert it with dcp_to_torch_save and load "
                     "them into the model with load_state_dict(strict=False) before compiling")


def _check_optimizer(job, md, path: str, layouts: list[dict]) -> None:
    """The optimizer state this job's optimizer keeps, per parameter, is what was saved."""
    saved: dict[str, set] = {}
    for k in md.state_dict_metadata:
        if k.startswith("optim.state."):
            rest = k[len("optim.state."):]
            name, _, key = rest.rpartition(".")
            saved.setdefault(name, set()).add(key)
    want: dict[str, set] = {}
    for layout in layouts:
        for name, keys in layout.items():
            want.setdefault(name, set()).update(keys)
    bad = sorted(n for n in want if want[n] != saved.get(n, set()))
    if bad:
        name = bad[0]
        raise error("checkpoint-mismatch", f"{path} holds optimizer state {sorted(saved.get(name, ()))} for "
                    f"`{name}`, and this job's optimizer keeps {sorted(want[name])}",
                    notes=(f"{len(bad)} parameter(s) differ",),
                    hint="compile the job with the optimizer the checkpoint was saved with (e.g. AdamW for "
                         "exp_avg/exp_avg_sq); its learning rate and other settings may differ")


def load(job, path) -> dict:
    """Read checkpoint `path` into the running `job`, whatever strategy and mesh wrote it:
    parameters, persistent buffers, optimizer state and the step count. Returns its metadata.

    First, on the driver: `verify_checkpoint` (checksums, items as data), the model's names
    and shapes, the optimizer's state; a checkpoint refused there leaves the job untouched."""
    job._check_open()
    path = os.path.abspath(os.fspath(path))
    md = _verify(path)                  # before any worker reads: refused here, the job is untouched
    info = read_info(path, md)
    _check_model(job, md, path, info)
    with_state = any(k.startswith("optim.state.") for k in md.state_dict_metadata)
    layouts = job._get([a.optimizer_layout.remote(with_state) for a in job.actors], "load")
    _check_optimizer(job, md, path, layouts)
    buffers = _persistent_buffers(job)
    results = job._get([a.load_checkpoint.remote(path, with_state, buffers) for a in job.actors], "load")
    failed = [r for r in results if r is not None]
    if failed:
        message = f"the workers could not read checkpoint {path}: {failed[0]['error']}"
        notes = ("nothing in it was run; the job still runs, but its parameters and optimizer state may be "
                 "partly read: load a good checkpoint before training on",)
        if any(r["unsafe"] for r in failed):
            raise error("not-a-checkpoint", message, notes=notes, hint=_CORRUPT_FIX)
        raise error("checkpoint-corrupt", message, notes=notes, hint=_CORRUPT_FIX)
    if buffers:                     # the driver's copy, which new workers would start from
        _read_here({"model": {k: job._buffers[k] for k in buffers}}, path)
    loss_scaling.restore(job, info.get("loss_scale"))
    job.steps = int(info["step"])                   # 0 <= step < MAX_STEP (`_check_info`)
    if "data_position" in info:
        job.data_position = int(info["data_position"])
    return info


STEP_DIR = re.compile(r"step-(\d+)\Z")


def checkpoints(directory) -> list[tuple[int, str]]:
    """(step, path) of every finished checkpoint `piper run` wrote in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = STEP_DIR.match(name)
        full = os.path.join(directory, name)
        if m and os.path.exists(os.path.join(full, ".metadata")):
            out.append((int(m.group(1)), full))
    return sorted(out)


def save_step(job, directory, keep: int = 2) -> str:
    """Save `job` as `directory/step-N` (N = job.steps), then delete all but the last `keep`.

    `save` writes under a hidden temporary name and renames it once every worker has
    written, so a save cut short never looks like a checkpoint."""
    os.makedirs(directory, exist_ok=True)
    final = save(job, os.path.join(directory, f"step-{job.steps}"))
    for _, old in checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# -- `piper run --checkpoint-dir DIR --checkpoint-every N --resume` ----------------------------

def check_run_flags(args) -> str | None:
    """What is wrong with `piper run`'s checkpoint flags together, or None."""
    every, directory = getattr(args, "checkpoint_every", None), getattr(args, "checkpoint_dir", None)
    resuming = getattr(args, "resume", False)
    if every is not None and every < 1:
        return f"--checkpoint-every {every} is not a positive number of steps (write e.g. --checkpoint-every 100)"
    if (every or resuming) and not directory:
        flag = "--checkpoint-every" if every else "--resume"
        return f"{flag} needs --checkpoint-dir DIR, where checkpoints are written and read"
    if directory and not every and not resuming:
        return ("--checkpoint-dir without --checkpoint-every saves nothing (add --checkpoint-every N, "
                "or --resume to start from DIR's last checkpoint)")
    return None


def resume(job, directory, batches, console=None) -> int:
    """Load the last checkpoint in `directory` into `job` and skip the batches it has
    trained on (the data stream is the same whatever stopped the run). Returns its step;
    0, with nothing loaded, when `directory` has none yet."""
    found = checkpoints(directory)
    if not found:
        if console is not None:
            console.print(f"no checkpoint in {directory} yet: starting at step 0")
        return 0
    step, path = found[-1]
    info = load(job, path)
    if console is not None:
        console.print(f"resumed from {path} (step {step}, saved by {info.get('strategy')} on mesh "
                      f"{info.get('mesh')})")
    for _ in range(job.steps):
        next(batches)
    return job.steps


class Every:
    """A job whose `step` saves a checkpoint into `directory` every `every` steps (the last two kept)."""

    def __init__(self, job, directory, every: int):
        self.job, self.directory, self.every = job, directory, every

    def step(self, *batch) -> float:
        loss = self.job.step(*batch)
        if self.job.steps % self.every == 0:
            save_step(self.job, self.directory)
        return loss

    def __getattr__(self, name):          # everything else is the job's
        return getattr(self.job, name)
