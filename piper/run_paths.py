"""The paths `piper run` writes (`--save`, `--trace`, `--metrics`, `--tensorboard`, `--checkpoint-dir`),
checked before the model loads: a path that cannot be written is a `bad-output` error then, not after
training.

    check_output_paths(args)      # raises bad-output naming the flag, the path and what is wrong

Each output is tried for real: a probe file is created (and removed) in its place, or in the folder
it is written into, so whatever the kernel refuses (a name over 255 bytes, /proc even for root, a
folder under a regular file, a read-only mount) is found here; permission bits alone say none of it.
Folders an output is written into are created (`--checkpoint-dir`, `--tensorboard`, and the folder of
`--metrics`); `--save` and `--trace` need theirs to exist.
"""
from __future__ import annotations

import errno
import os
import uuid

from .diagnostics import clip, error

WEIGHT_FILES = (".pt", ".pth", ".bin")     # `--save FILE.pt`: weights; any other path: a checkpoint directory


def _nearest_existing(path: str) -> str:
    """The path itself, or the closest folder above it that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _why(exc: OSError) -> str:
    """An OSError as the end of a sentence about the path ("cannot be written: its name is too long")."""
    if exc.errno == errno.ENAMETOOLONG:
        return "cannot be written: a name in it is longer than the file system allows (255 bytes)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "cannot be written (permission denied)"
    if exc.errno == errno.EROFS:
        return "is on a read-only file system"
    if exc.errno == errno.ENOTDIR:
        return "is under a file, where a directory is needed"
    if exc.errno == errno.ENOSPC:
        return "cannot be written: the disk is full"
    return f"cannot be written ({os.strerror(exc.errno) if exc.errno else exc})"


def _probe_file(path: str) -> str | None:
    """Create `path` as a new file and remove it (or, when it exists, open it to append, unchanged)."""
    try:
        if os.path.lexists(path):
            with open(path, "ab"):
                pass
            return None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(path)
    except OSError as exc:
        return _why(exc)
    return None


def _probe_name(name: str) -> str:
    """A probe's name a little longer than `.{name}.saving-<12 hex>`, `job.save`'s staging folder
    beside a checkpoint: a name that fits the probe fits the staging folder."""
    return f".{name}.probe-{uuid.uuid4().hex[:14]}"


def file_problem(path: str) -> str | None:
    """What stops `path` from being written as a file, or None (tried with a probe file)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return "is a directory, and a file is written there"
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        return f"is in {parent}, which does not exist" if not os.path.exists(parent) else \
            f"is in {parent}, which is not a directory"
    return _probe_file(full)


def _not_a_folder(full: str) -> str | None:
    """Why the absolute path `full` cannot become a folder: it or a folder above it is a file."""
    if os.path.exists(full) and not os.path.isdir(full):
        return "is a file, and a directory is written there"
    found = _nearest_existing(full)
    if not os.path.isdir(found):
        return f"is under {found}, which is a file"
    return None


def folder_problem(path: str) -> str | None:
    """What stops `path` from being a folder files are written into, or None: the folder is created
    when missing (with those above it) and a probe file is written in it."""
    full = os.path.abspath(path)
    problem = _not_a_folder(full)
    if problem:
        return problem
    try:
        os.makedirs(full, exist_ok=True)
    except OSError as exc:
        return _why(exc)
    return _probe_file(os.path.join(full, _probe_name("probe")))


def new_file_problem(path: str) -> str | None:
    """`file_problem`, with the folder `path` is in created when missing (`--metrics`)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return "is a directory, and a file is written there"
    parent = os.path.dirname(full)
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"is in {parent}, which is a file"
    problem = folder_problem(parent)
    return f"is in {parent}, which {problem}" if problem else _probe_file(full)


def directory_problem(path: str) -> str | None:
    """What stops `path` from being written as a directory that `job.save` renames into place (so its
    parent is created and a probe named like the staging folder is written beside it), or None."""
    full = os.path.abspath(path)
    problem = _not_a_folder(full)
    if problem:
        return problem
    parent, name = os.path.split(full)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        return _why(exc)
    return _probe_file(os.path.join(parent, _probe_name(name))) or \
        (None if os.path.exists(full) else _probe_file(full))


def _outputs(args) -> list[tuple[str, str, str]]:
    """(flag, path, kind) of every output the run writes; kind is file, folder or directory."""
    wanted = []
    save = getattr(args, "save", None)
    if save:
        wanted.append(("--save", save, "file" if save.endswith(WEIGHT_FILES) else "directory"))
    if getattr(args, "trace", None):
        wanted.append(("--trace", args.trace, "file"))
    if getattr(args, "metrics", None):
        wanted.append(("--metrics", args.metrics, "new file"))
    if getattr(args, "tensorboard", None):
        wanted.append(("--tensorboard", args.tensorboard, "folder"))
    if getattr(args, "checkpoint_dir", None) and getattr(args, "checkpoint_every", None):
        wanted.append(("--checkpoint-dir", args.checkpoint_dir, "folder"))
    return wanted


_CHECKS = {"file": file_problem, "new file": new_file_problem, "folder": folder_problem,
           "directory": directory_problem}
_WANTED = {"file": "file in an existing directory", "new file": "file", "folder": "directory",
           "directory": "directory"}


def check_output_paths(args) -> None:
    """Raise `bad-output` for the first of `piper run`'s output paths that cannot be written, and
    `bad-flag` for `--tensorboard` without the tensorboard package."""
    for flag, path, kind in _outputs(args):
        problem = _CHECKS[kind](path)
        if problem:
            raise error("bad-output", f"{flag} {clip(path, 120)} {problem}",
                        notes=("output paths are checked before the model loads, so a run is not lost at "
                               "its end",),
                        hint=f"pass a writable {_WANTED[kind]} to {flag}" + (
                            " (FILE.pt for the weights, any other path for a checkpoint directory)"
                            if flag == "--save" else ""))
    if getattr(args, "tensorboard", None):
        check_tensorboard()


def check_tensorboard() -> None:
    """`bad-flag` when torch's TensorBoard writer cannot be imported (the tensorboard package is missing)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise error("bad-flag", "--tensorboard needs the tensorboard package, which is not installed",
                    hint="pip install tensorboard (or pip install 'piper[tensorboard]'; or leave out "
                         "--tensorboard: --metrics FILE.jsonl writes the same numbers)") from None
