"""Where Piper keeps what it caches on disk (`piper tune`'s measurements): `$PIPER_CACHE`, else
`$XDG_CACHE_HOME/piper`, else `~/.cache/piper`; and whether a file there may be read.

A cache is read back without the user asking, so it must be the user's own: the folder is made
private (0700), and a file owned by another user, or that others may write (or in a folder others
may write or own), is not read (`distrusted` says why, for one warning line). Nothing here
imports torch.
"""
from __future__ import annotations

import os
import stat


def cache_dir() -> str:
    """The cache folder (not created here; `make_cache_dir` makes it). Point `PIPER_CACHE` at a
    folder of your own, e.g. `PIPER_CACHE=~/scratch/piper-cache piper tune ...`, never at a
    shared one such as /tmp: files others can put there are ignored, not read."""
    chosen = os.environ.get("PIPER_CACHE")
    if chosen:
        return chosen
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "piper")


def make_cache_dir() -> str:
    """`cache_dir()`, made private (0700) where this call creates it; an existing folder is left
    as it is (`distrusted` refuses its files if others may write there). Raises OSError."""
    folder = cache_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def distrusted(path: str, *, folder_only: bool = False) -> str | None:
    """Why the cache file `path` must not be read (or, with `folder_only`, written), or None when it
    is the user's own: the file and its folder belong to this user and neither may be written by
    group or others.

        distrusted("/tmp/shared/tune-1.json") == "its folder /tmp/shared may be written by others (mode 777)"

    Checked before reading: in a folder only its owner may write, no one else can swap the file
    between this check and the read. A file that does not exist is not distrusted (nothing is read).
    """
    folder = os.path.dirname(os.path.abspath(path))
    return _foreign(folder, f"its folder {folder}") or (None if folder_only else _foreign(path, "it"))


def _foreign(where: str, what: str) -> str | None:
    """What makes the file or folder `where` someone else's to change, or None."""
    try:
        info = os.stat(where)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"{what} cannot be checked ({err.strerror or err})"
    me = os.geteuid() if hasattr(os, "geteuid") else info.st_uid
    if info.st_uid != me:
        return f"{what} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} may be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None
