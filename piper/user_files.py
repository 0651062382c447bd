"""One way to read a file a user or a cache hands Piper (a config, a manifest, a cache entry, a script):
regular files only, opened without blocking, bounded in size, read in bounded chunks.

A FIFO in place of `piper.json` would block `open()` forever, `/dev/zero` would fill memory, and a
directory raises an `IsADirectoryError` deep in a parser; each is refused here by name instead:

    text = read_text("run.toml", limit=1 << 20, what="the config")

A file a library opens itself (DCP's shards, `torch.load`'s) is first checked with
`regular_file(path, ...)`, which also refuses a symbolic link that leads outside its folder; a file
too large to hold in memory (a checkpoint's shard) is read piece by piece with `chunks`.

The primitives below (`check_path`, `open_regular`, `read_open`) raise `Refused`, a reason phrased to
follow the file's name; the readers above them turn it into a PiperError, `unreadable-file` (or
`file-not-found`), and the script reader (`dsl/source.py`) into its own `SourceError`.
Nothing here imports torch.
"""
from __future__ import annotations

import errno
import os
import stat

from .diagnostics import PiperError, clip, error

CHUNK = 1 << 20          # bytes read at a time: a whole file is never asked of the kernel in one call
_HINT = "give the path of an ordinary file"


class Refused(Exception):
    """Why a file cannot be read: `reason` follows its name ("is a pipe (FIFO), not a regular file"),
    `code` is `file-not-found` or `unreadable-file`, `hint` says what to do."""

    def __init__(self, code: str, reason: str, hint: str = _HINT):
        super().__init__(reason)
        self.code, self.reason, self.hint = code, reason, hint

    def diagnostic(self, path, what: str) -> PiperError:
        """This refusal as the PiperError the readers raise: "`what` `path` `reason`"."""
        return error(self.code, f"{what} `{clip(os.fspath(path), 120)}` {self.reason}", hint=self.hint)


def kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words ("a pipe (FIFO)")."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(mode: int) -> Refused:
    return Refused("unreadable-file", f"is {kind(mode)}, not a regular file")


def _os_refusal(exc: BaseException) -> Refused:
    if isinstance(exc, FileNotFoundError):
        return Refused("file-not-found", "does not exist", "check the path")
    if isinstance(exc, ValueError):                  # a NUL byte in the path
        return Refused("file-not-found", "is not a path (it holds a NUL byte)", "check the path")
    if getattr(exc, "errno", None) in (errno.EACCES, errno.EPERM):
        return Refused("unreadable-file", "cannot be read: permission denied", "check the file's permissions")
    return Refused("unreadable-file", f"cannot be opened ({getattr(exc, 'strerror', None) or exc})")


def _check_inside(path, inside) -> None:
    try:
        real, folder = os.path.realpath(path), os.path.realpath(inside)
        outside = os.path.commonpath([real, folder]) != folder
    except (OSError, ValueError) as exc:
        raise _os_refusal(exc) from None
    if outside:
        raise Refused("unreadable-file", f"leads outside `{clip(os.fspath(inside), 120)}` (a symbolic link to "
                      f"`{clip(real, 120)}`)", "copy the file into the folder instead of linking it")


def check_path(path, *, inside=None) -> os.stat_result:
    """The stat of `path` (links followed) when it is a regular file (inside the folder `inside`,
    where given), opening nothing; `Refused` otherwise."""
    if inside is not None:
        _check_inside(path, inside)
    try:
        info = os.stat(path)
    except (OSError, ValueError) as exc:
        raise _os_refusal(exc) from None
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(info.st_mode)
    return info


def open_regular(path, *, inside=None) -> int:
    """A descriptor of `path`, opened read-only without blocking (a FIFO would block a plain open)
    and checked to be a regular file once open (it may have been replaced since a stat); `Refused`
    otherwise. The caller closes it."""
    if inside is not None:
        _check_inside(path, inside)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:
        raise _os_refusal(exc) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise _os_refusal(exc) from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(mode)
    return fd


def read_open(fd: int, count: int) -> bytes:
    """At most `count` bytes from descriptor `fd`, read in pieces of at most `CHUNK`; `Refused` for
    a read error (EIO, EISDIR)."""
    parts, total = [], 0
    while total < count:
        try:
            piece = os.read(fd, min(CHUNK, count - total))
        except OSError as exc:
            raise Refused("unreadable-file", f"cannot be read ({exc.strerror or exc})") from None
        if not piece:
            break
        parts.append(piece)
        total += len(piece)
    return b"".join(parts)


def _too_large(path, what: str, size: str, limit: int) -> PiperError:
    return error("unreadable-file", f"{what} `{clip(os.fspath(path), 120)}` is {size}, over the "
                 f"{limit:,} bytes this file may be", hint="check that this is the file you meant")


def regular_file(path, *, what: str, limit: int | None = None, inside=None) -> int:
    """The size of `path` once it is known to be a regular file of at most `limit` bytes (inside the
    folder `inside`, where given); raises `unreadable-file` otherwise. Opens nothing that blocks."""
    try:
        fd = open_regular(path, inside=inside)
    except Refused as refused:
        raise refused.diagnostic(path, what) from None
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if limit is not None and size > limit:
        raise _too_large(path, what, f"{size:,} bytes", limit)
    return size


def read_bytes(path, *, limit: int, what: str, inside=None) -> bytes:
    """The whole content of the regular file `path`, refused once it passes `limit` bytes (counted as
    it is read, so a file that grows while read is bounded too).

    >>> import tempfile; f = tempfile.NamedTemporaryFile(delete=False); _ = f.write(b"x = 1"); f.close()
    >>> read_bytes(f.name, limit=100, what="the config")
    b'x = 1'
    """
    try:
        fd = open_regular(path, inside=inside)
        try:
            if os.fstat(fd).st_size > limit:         # known before reading any of it (a sparse 100 GB file)
                raise _too_large(path, what, f"{os.fstat(fd).st_size:,} bytes", limit)
            data = read_open(fd, limit + 1)
        finally:
            os.close(fd)
    except Refused as refused:
        raise refused.diagnostic(path, what) from None
    if len(data) > limit:
        raise _too_large(path, what, f"more than {limit:,} bytes (it grew while read)", limit) from None
    return data


def read_text(path, *, limit: int, what: str, inside=None) -> str:
    """`read_bytes` decoded as UTF-8; bytes that are not UTF-8 are refused with their offset."""
    data = read_bytes(path, limit=limit, what=what, inside=inside)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise Refused("unreadable-file", f"is not UTF-8 text (byte {exc.start:,}, line {line})",
                      "save the file as UTF-8").diagnostic(path, what) from None


def chunks(path, *, what: str, inside=None, size: int = CHUNK):
    """The bytes of the regular file `path`, `size` at a time (for files too large to hold: a
    checkpoint's shard read for its checksum); `unreadable-file` as `read_bytes`."""
    try:
        fd = open_regular(path, inside=inside)
    except Refused as refused:
        raise refused.diagnostic(path, what) from None
    try:
        while True:
            try:
                piece = os.read(fd, size)
            except OSError as exc:
                raise Refused("unreadable-file", f"cannot be read ({exc.strerror or exc})").diagnostic(path, what) from None
            if not piece:
                return
            yield piece
    finally:
        os.close(fd)
