"""One run per checkpoint folder: `piper run --checkpoint-dir DIR` holds an exclusive lock on DIR
while it runs, so a second run given the same folder is refused before it trains, instead of the two
deleting each other's `step-N` checkpoints as each keeps its own last two.

    with hold("ckpt"):            # checkpoint-dir-busy, naming the holder, when another run has it
        ...train...

The lock is `flock` on `DIR/.piper-lock`: the kernel drops it when its holder exits or is killed,
so a lock file left behind by a dead run blocks nothing. The file records who holds it (pid, host,
start time, command) for the message; it is never deleted (a run that deleted it could lock the
old file while the next run locks a new one).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import sys
import time

from ..diagnostics import clip, error

LOCK_FILE = ".piper-lock"
_HOLDER_BYTES = 4096          # what is read of the holder's note: the file may be anyone's


def _open(path: str) -> int:
    """The lock file's descriptor: opened without following a link and without blocking (a FIFO
    planted there must not hang the run), and only a regular file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error("unreadable-file", f"{path} is not a regular file, so the checkpoint folder cannot be "
                    "locked for this run", hint=f"remove {path}; piper run recreates it")
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, from its note ("pid 123 on host h, started 2026-12-05 01:20:00 UTC: piper run ...")."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        note = json.loads(os.read(fd, _HOLDER_BYTES).decode("utf-8", "replace"))
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(note["started"])))
        return (f"pid {int(note['pid'])} on host {clip(note['host'], 60)}, started {started}: "
                f"{clip(note.get('command', '?'), 120)}")
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "a process whose note cannot be read"


def _write_holder(fd: int) -> None:
    """Write this process's note over the file's old one."""
    note = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "command": " ".join(["piper", *sys.argv[1:]]) if sys.argv else "piper"}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(note).encode(), 0)


def acquire(directory: str) -> int:
    """Lock `directory` (created when missing) for this process; the descriptor that holds the lock.
    `checkpoint-dir-busy` naming the holder when another process has it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise error("checkpoint-dir-busy", f"the checkpoint folder {clip(directory, 120)} is in use by another "
                    f"run ({holder})",
                    notes=("two runs in one folder would each keep only their own last checkpoints and delete "
                           "the other's",),
                    hint="wait for that run to end, or give this one its own --checkpoint-dir") from None
    except OSError:
        os.close(fd)
        raise
    _write_holder(fd)
    return fd


def release(fd: int) -> None:
    """Unlock: the note is emptied first, so nobody is named as holding a free folder."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)                  # closing the last descriptor drops the flock


@contextlib.contextmanager
def hold(directory: str | None):
    """Hold `directory`'s lock for the `with` block (nothing when `directory` is None)."""
    if directory is None:
        yield
        return
    fd = acquire(directory)
    try:
        yield
    finally:
        release(fd)
