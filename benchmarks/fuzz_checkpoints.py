"""Fuzzing `verify_checkpoint` with damaged, mixed and hostile checkpoint folders: every case must end
in a diagnostic (or, where nothing changed, pass), in bounded time and memory.

The seeds are two small checkpoints of the same model with Piper's layout, manifest and
ids, saved once per worker without a job (`small_checkpoint`: DCP's save in one process
through Piper's own writer, as a one-device job writes). A case is a copy of the first
with 1 to 3 edits: `piper.json` edited as JSON (an entry dropped, a size, CRC or id
changed, values of the wrong kind, an entry copied from the second) or as bytes; a file
swapped in from the second checkpoint (with its entry copied, or its id rewritten);
files cut short, grown or flipped (and then re-signed: the manifest's size and CRC made
to match, so the parsers behind the checksums are reached); a file replaced by a FIFO, a
link to `/dev/zero`, a folder, a link out of the checkpoint or nothing; or the checkpoint
saved again with a hostile `piper.step` / `piper.format` / `data_position`.

Each case runs in a worker process under the same limits as `benchmarks.fuzz_scripts`
(2 GiB of address space, an alarm after 5 s of CPU). Outcomes: `ok` (a PiperError),
`accepted` (verified: only right where the edits changed no byte the checkpoint needs),
`internal` (any other exception), `memory`, `timeout`, `crashed`.

    .venv/bin/python -m benchmarks.fuzz_checkpoints --cases 100000 --seed 0
    .venv/bin/python -m benchmarks.fuzz_checkpoints --cases 200 --show-failures

tests/test_fuzz_checkpoints.py runs a few hundred cases of it (drawn by hypothesis).
"""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import sys
from pathlib import Path

from benchmarks.fuzz_scripts import BAD, CASE_SECONDS, Worker as ScriptWorker, cli, drive, run_limited, serve

FILES = (".metadata", "__0_0.distcp", "piper.json")
STEPS = [-3, -1, 0, 2**53 - 1, 2**53, 10**30, True, 1.5, "3", None, [3], {"a": 1}]


def small_checkpoint(path, *, seed: int = 0, identity: str | None = None, **piper_items) -> dict:
    """A checkpoint of a small model with Piper's layout, written here as a one-device `job.save`
    writes it (DCP through `checkpoint_files.Writer`, the manifest, the id): no job, no Ray."""
    import uuid
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from piper.job import checkpoint
    from piper.runtime.state import checkpoint_files

    identity = identity or uuid.uuid4().hex
    gen = torch.Generator().manual_seed(seed)
    meta = {"format": 1, "step": 3, "strategy": "test", "mesh": {"dp": 1}, "world_size": 1, "zero": 0,
            "microbatches": 1, "checksums": "crc32", **piper_items, "ids": {"0": identity}}
    state = {"model": {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(8, generator=gen)},
             "optim": {"state": {"w": {"exp_avg": torch.randn(16, 8, generator=gen), "step": torch.tensor(3.0)}}},
             "piper": meta}
    os.makedirs(path, exist_ok=True)
    writer = checkpoint_files.Writer(path, identity=identity)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    names = writer.written + [checkpoint.METADATA]
    checkpoint._write_manifest(str(path), checkpoint_files.checksums(path, names), identity)
    return state


# ---- cases: a list of edits, as JSON, drawn from a seed


def case(rng: random.Random) -> list[dict]:
    """One case: 1 to 3 edits of the first checkpoint."""
    return [_edit(rng) for _ in range(rng.randint(1, 3))]


def _edit(rng: random.Random) -> dict:
    kind = rng.random()
    name = rng.choice(FILES)
    if kind < 0.25:
        return {"op": "manifest", "what": rng.choice(["drop", "bytes", "crc32", "id", "entry_id", "top", "copy",
                                                      "type", "extra"]),
                "name": rng.choice(FILES[:2] + ("__1_0.distcp", "../x")), "value": rng.choice(
                    [-1, 0, 1, 2**32, 2**64, 1.5, "x", None, [], {}, True, "0" * 32, "f" * 31, 10**400])}
    if kind < 0.4:
        return {"op": "swap", "name": name, "entry": rng.choice(["keep", "copy", "copy_with_id"])}
    if kind < 0.65:
        return {"op": "bytes", "name": name, "how": rng.choice(["cut", "grow", "flip", "zero", "empty"]),
                "at": rng.random(), "count": rng.choice([1, 2, 8, 64, 1000]),
                "resign": rng.random() < 0.6}
    if kind < 0.85:
        return {"op": "special", "name": name, "kind": rng.choice(["fifo", "dev_zero", "folder", "outside",
                                                                    "dangling", "missing", "self_link"])}
    return {"op": "piper", "key": rng.choice(["step", "format", "data_position"]), "value": rng.choice(STEPS)}


def _read(path) -> bytes | None:
    """The bytes of `path` where it is a regular file (an edit never opens the FIFO an earlier one made)."""
    return Path(path).read_bytes() if os.path.isfile(path) else None


def _write(path, text: str) -> None:
    if os.path.isfile(path):
        Path(path).write_text(text)


def _json(path):
    data = _read(path)
    return json.loads(data) if data is not None else None


def _signed(folder: str, name: str, identity: str) -> None:
    """Make `piper.json`'s entry for `name` match the file as it is now (a re-signed edit)."""
    from piper.job import checkpoint
    from piper.runtime.state import checkpoint_files

    full = os.path.join(folder, name)
    manifest_path = os.path.join(folder, checkpoint.MANIFEST)
    if name == checkpoint.MANIFEST or not os.path.isfile(full) or not os.path.isfile(manifest_path):
        return
    try:
        data = _json(manifest_path)
        data["files"][name] = {**checkpoint_files.checksum(full), "checkpoint_id": identity}
    except (ValueError, TypeError, KeyError, AttributeError):
        return
    _write(manifest_path, json.dumps(data))


def apply(folder: str, other: str, edits: list[dict], scratch: str) -> None:
    """Apply `edits` to the checkpoint copy `folder` (`other`: the second checkpoint); an edit that
    does not fit what earlier ones left (a manifest no longer JSON) is skipped."""
    for edit in edits:
        try:
            _apply(folder, other, edit, scratch)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass


def _apply(folder: str, other: str, edit: dict, scratch: str) -> None:
    if True:
        op = edit["op"]
        manifest = os.path.join(folder, "piper.json")
        if op == "manifest":
            _edit_manifest(manifest, other, edit)
        elif op == "swap":
            full = os.path.join(folder, edit["name"])
            _remove(full)
            shutil.copyfile(os.path.join(other, edit["name"]), full)
            if edit["entry"] != "keep" and edit["name"] != "piper.json":
                try:
                    mine = _json(manifest)
                    theirs = _json(os.path.join(other, "piper.json"))
                    entry = dict(theirs["files"][edit["name"]])
                    if edit["entry"] == "copy_with_id":
                        entry["checkpoint_id"] = mine["checkpoint_id"]
                    mine["files"][edit["name"]] = entry
                    _write(manifest, json.dumps(mine))
                except (ValueError, TypeError, KeyError, AttributeError, OSError):
                    pass
        elif op == "bytes":
            _edit_bytes(os.path.join(folder, edit["name"]), edit)
            if edit["resign"]:
                _signed(folder, edit["name"], _identity(manifest))
        elif op == "special":
            _special(os.path.join(folder, edit["name"]), edit["kind"], scratch)
        elif op == "piper":
            shutil.rmtree(folder, ignore_errors=True)
            small_checkpoint(folder, seed=0, **{edit["key"]: edit["value"]})


def _identity(manifest: str) -> str:
    try:
        return _json(manifest).get("checkpoint_id") or ""
    except (ValueError, OSError, AttributeError):
        return ""


def _edit_manifest(manifest: str, other: str, edit: dict) -> None:
    try:
        data = _json(manifest)
        files = data["files"]
    except (ValueError, TypeError, KeyError, OSError):
        return
    name, value, what = edit["name"], edit["value"], edit["what"]
    entry = files.get(name)
    if what == "drop":
        files.pop(name, None)
    elif what in ("bytes", "crc32", "entry_id") and isinstance(entry, dict):
        entry["checkpoint_id" if what == "entry_id" else what] = value
    elif what == "id":
        data["checkpoint_id"] = value
    elif what == "top":
        data.pop("checkpoint_id" if isinstance(value, int) else "checksums", None)
    elif what == "copy":
        try:
            files[name] = _json(os.path.join(other, "piper.json"))["files"].get(name, value)
        except (ValueError, OSError):
            return
    elif what == "type":
        data["files"] = value
    elif what == "extra":
        files[name] = {"bytes": 0, "crc32": 0, "checkpoint_id": data.get("checkpoint_id")}
    try:
        text = json.dumps(data)
    except ValueError:          # 10**400 as JSON: over the digits Python writes
        return
    _write(manifest, text)


def _edit_bytes(full: str, edit: dict) -> None:
    try:
        data = _read(full)
    except OSError:
        return
    if data is None:
        return
    data = bytearray(data)
    at = int(edit["at"] * len(data)) if data else 0
    how, count = edit["how"], edit["count"]
    if how == "cut":
        data = data[:at]
    elif how == "grow":
        data[at:at] = bytes(count)
    elif how == "flip":
        for i in range(at, min(len(data), at + count)):
            data[i] ^= 0xFF
    elif how == "zero":
        data[at:at + count] = bytes(len(data[at:at + count]))
    else:
        data = bytearray()
    if os.path.isfile(full):
        Path(full).write_bytes(bytes(data))


def _remove(full: str) -> None:
    if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full)
    elif os.path.lexists(full):
        os.unlink(full)


def _special(full: str, kind: str, scratch: str) -> None:
    _remove(full)
    if kind == "fifo":
        os.mkfifo(full)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", full)
    elif kind == "folder":
        os.mkdir(full)
    elif kind == "outside":            # a link to a copy of a good file that lies outside the checkpoint
        target = os.path.join(scratch, "outside-" + os.path.basename(full))
        Path(target).write_bytes(b"not this checkpoint's")
        os.symlink(target, full)
    elif kind == "dangling":
        os.symlink(os.path.join(scratch, "nothing-here"), full)
    elif kind == "self_link":
        os.symlink(os.path.basename(full), full)


# ---- the worker: cases in, outcomes out


def run_case(base: str, other: str, folder: str, edits: list[dict], seconds: float = CASE_SECONDS) -> dict:
    """`verify_checkpoint` of a copy of `base` with `edits` applied, under the CPU alarm."""
    from piper.job.checkpoint import verify_checkpoint

    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base, folder)
    apply(folder, other, edits, os.path.dirname(folder))

    def act():
        verify_checkpoint(folder)
        return "accepted", ""            # verified: right only where the edits changed nothing it needs

    result = run_limited(act, seconds, where=True)
    return {**result, "codes": [result["detail"]] if result["outcome"] == "ok" else []}


def worker(seconds: float = CASE_SECONDS) -> None:
    """Read cases (JSON lines: name, text = the edits as JSON) from stdin; outcomes to stdout."""
    import warnings

    def prepare(scratch):
        small_checkpoint(os.path.join(scratch, "a"), seed=0)
        small_checkpoint(os.path.join(scratch, "b"), seed=1)

    def one(scratch, item, secs):
        return run_case(os.path.join(scratch, "a"), os.path.join(scratch, "b"), os.path.join(scratch, "case"),
                        json.loads(item["text"]), secs)

    warnings.simplefilter("ignore")
    serve(one, seconds, prefix="piper-fuzz-ckpt-", prepare=prepare)


class Worker(ScriptWorker):
    """`benchmarks.fuzz_scripts.Worker`, starting this module's worker."""

    MODULE = "benchmarks.fuzz_checkpoints"


def fuzz(cases: int, seed: int, *, make_case=case, worker_class=Worker, minutes: float | None = None,
         show: bool = False, report=print, failures_to: str | None = None) -> dict:
    """Run `cases` cases (or until `minutes` pass): counts per outcome, the slowest case, the failures."""
    return drive(lambda rng: ("case", json.dumps(make_case(rng))), seed, worker_class(), cases, minutes=minutes,
                 show=show, report=report, failures_to=failures_to, outcomes=("ok", "accepted") + BAD,
                 show_chars=2000, record_name=False, progress_rss=False)


def main(argv=None, *, run_worker=worker, make_case=case, worker_class=Worker) -> int:
    return cli(argv, (__doc__ or "").split("\n")[0],
               functools.partial(fuzz, make_case=make_case, worker_class=worker_class), run_worker)


if __name__ == "__main__":
    sys.exit(main())
