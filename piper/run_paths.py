"""The paths `piper run` writes (`--save`, `--trace`, `--metrics`, `--checkpoint-dir`), checked before
any worker starts: a path that cannot be written is a `bad-output` error then, not after training.

    check_output_paths(args)      # raises bad-output naming the flag, the path and what is wrong
"""
from __future__ import annotations

import os

from .diagnostics import error

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


def file_problem(path: str) -> str | None:
    """What stops `path` from being written as a file, or None."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return "is a directory, and a file is written there"
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        return f"is in {parent}, which does not exist" if not os.path.exists(parent) else \
            f"is in {parent}, which is not a directory"
    if os.path.exists(full) and not os.access(full, os.W_OK):
        return "exists and cannot be written (no write permission)"
    if not os.path.exists(full) and not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def directory_problem(path: str) -> str | None:
    """What stops `path` from being used as a directory that is written into (created when missing), or None."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        return "is a file, and a directory is written there"
    found = _nearest_existing(full)
    if not os.path.isdir(found):
        return f"is under {found}, which is a file"
    if not os.access(found, os.W_OK | os.X_OK):
        what = "exists and is" if found == full else f"cannot be created: {found} is"
        return f"{what} not writable"
    return None


def check_output_paths(args) -> None:
    """Raise `bad-output` for the first of `piper run`'s output paths that cannot be written."""
    wanted = []
    save = getattr(args, "save", None)
    if save:
        wanted.append(("--save", save, "file" if save.endswith(WEIGHT_FILES) else "directory"))
    for flag, name in (("--trace", "trace"), ("--metrics", "metrics")):
        if getattr(args, name, None):
            wanted.append((flag, getattr(args, name), "file"))
    if getattr(args, "checkpoint_dir", None) and getattr(args, "checkpoint_every", None):
        wanted.append(("--checkpoint-dir", args.checkpoint_dir, "directory"))
    for flag, path, kind in wanted:
        problem = file_problem(path) if kind == "file" else directory_problem(path)
        if problem:
            raise error("bad-output", f"{flag} {path} {problem}",
                        notes=("output paths are checked before the workers start, so a run is not lost at "
                               "its end",),
                        hint=f"pass a writable {'file in an existing directory' if kind == 'file' else 'directory'}"
                             f" to {flag}" + (" (FILE.pt for the weights, any other path for a checkpoint "
                                              "directory)" if flag == "--save" else ""))
