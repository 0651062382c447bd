"""Reading script text safely: regular files only, a size limit, and the trojan-source check.

A script may come from anywhere, so reading one never blocks (a FIFO), never
reads without end (a link to /dev/zero), never reads the kernel's files
(/proc/self/environ is a "regular" file holding the environment), and never
hands the terminal a control character: `bidi_warnings` flags the invisible
direction overrides that make code read differently from how it runs
(CVE-2021-42574), as rustc does. `resolve_import` keeps an `import` inside the
importing script's folder tree: a link there may not lead out of it, nor to a
file that is not a `.pps` script, so no diagnostic ever quotes such a file.
"""
from __future__ import annotations

import dataclasses
import os
import unicodedata

from piper import user_files
from piper.diagnostics import Diagnostic, Span

# Real strategies are a few kilobytes (the largest standard-library file is under 4 KiB);
# checking costs about 0.1 ms per line, so this bounds `piper check` to seconds.
MAX_SCRIPT_BYTES = 256 * 1024

# Unicode's explicit direction embeddings, overrides and isolates (rustc's list).
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
# More than this many of one warning code in a file are summed up in one note.
MAX_SAME_WARNING = 20


class SourceError(Exception):
    """Why a script file cannot be read: `reason` is a phrase, `code` a diagnostic code."""

    def __init__(self, code: str, reason: str, hint: str):
        super().__init__(reason)
        self.code, self.reason, self.hint = code, reason, hint


# Filesystems of the kernel: their "regular" files (/proc/self/environ, /sys/...) are not scripts.
KERNEL_FOLDERS = ("/proc", "/sys", "/dev")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def resolve_import(base, path_text: str) -> str:
    """The real path of `import "path_text"` written in a script in folder `base`; SourceError when
    it leads out of the folder tree the path names (a link out of it), to a file not named `.pps`,
    or into the kernel's folders.

    The tree is the importing script's folder, or the folder a leading `../` climbs to: a
    link inside it may point anywhere inside it, never outside.

    >>> resolve_import("/tmp", "a/../b.pps")
    '/tmp/b.pps'
    """
    real_base = os.path.realpath(base)
    written = os.path.normpath(os.path.join(real_base, path_text))
    tree = os.path.commonpath([real_base, written])
    real = os.path.realpath(os.path.join(real_base, path_text))
    if not _under(real, tree):
        raise SourceError("bad-import", f"it is a link that leads out of {tree}",
                          "copy the imported file into the importing script's folder tree; an import "
                          "follows no link out of it")
    if any(_under(real, folder) for folder in KERNEL_FOLDERS):
        raise SourceError("bad-import", "it leads into the kernel's files (/proc, /sys, /dev)",
                          "import a .pps script")
    if not real.endswith(".pps"):
        raise SourceError("bad-import", "it is a link to a file that is not a .pps script",
                          "import the .pps script itself; Piper reads no other files")
    return real


_NOT_A_SCRIPT = "a script is a plain .pps file; Piper does not read devices, pipes or folders"


def _source_error(refused: user_files.Refused) -> SourceError:
    """`user_files`' refusal as this module's SourceError (a phrase after "it")."""
    if refused.reason == "does not exist":
        return SourceError("file-not-found", "no such file", "check the path")
    hint = _NOT_A_SCRIPT if "not a regular file" in refused.reason else refused.hint
    return SourceError("file-not-found", f"it {refused.reason}", hint)


def _regular(path) -> os.stat_result:
    """The stat of `path`, a regular file outside the kernel's folders; SourceError otherwise
    (`user_files.check_path`: nothing is opened, so a FIFO cannot block)."""
    try:
        info = user_files.check_path(path)
    except user_files.Refused as refused:
        raise _source_error(refused) from None
    if any(_under(os.path.realpath(path), folder) for folder in KERNEL_FOLDERS):
        raise SourceError("file-not-found", "it is one of the kernel's files (/proc, /sys, /dev), not a script",
                          "a script is a plain .pps file")
    return info


def _read_bytes(path, count: int) -> bytes:
    """At most `count` bytes of the regular file `path`, opened without blocking and refused if it
    is no longer a regular file once open (it was replaced after the stat): `user_files`' reader."""
    try:
        fd = user_files.open_regular(path)
        try:
            return user_files.read_open(fd, count)
        finally:
            os.close(fd)
    except user_files.Refused as refused:
        raise _source_error(refused) from None


def read_prefix(path, count: int) -> bytes:
    """The first `count` bytes of the regular file `path` (to tell a file's kind by its start);
    SourceError for a missing file, a folder, a FIFO, a device or one of the kernel's files."""
    _regular(path)
    return _read_bytes(path, count)


def read_source(path, *, limit: int = MAX_SCRIPT_BYTES) -> str:
    """The UTF-8 text of the regular file `path`, at most `limit` bytes; SourceError otherwise.

    Checks the file's kind before opening it (a FIFO would block the open), and
    reads one byte past the limit rather than the whole file.
    """
    info = _regular(path)
    if info.st_size > limit:
        raise SourceError("script-too-large", _too_large(info.st_size, limit), _TOO_LARGE_HINT)
    data = _read_bytes(path, limit + 1)
    if len(data) > limit:   # the file grew after stat
        raise SourceError("script-too-large", _too_large(len(data), limit, more=True), _TOO_LARGE_HINT)
    try:
        return data.decode("utf-8-sig")     # a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as err:
        raise SourceError("file-not-found", f"it is not UTF-8 text (byte {err.start})",
                          "save the script as UTF-8") from None


_TOO_LARGE_HINT = "split the strategy into files joined by `import`, or generate fewer lines with `for` loops"


def _too_large(size: int, limit: int, more: bool = False) -> str:
    return f"it holds {'over ' if more else ''}{size:,} bytes; a script holds at most {limit:,}"


def too_large(text: str, file: str, limit: int = MAX_SCRIPT_BYTES) -> Diagnostic | None:
    """script-too-large for source text over `limit` bytes (text passed in, not read from a file)."""
    if len(text) <= limit // 4 or len(text.encode("utf-8", "surrogatepass")) <= limit:
        return None
    return Diagnostic("script-too-large", f"{file}: the script is too large to check: "
                      f"{_too_large(len(text.encode('utf-8', 'surrogatepass')), limit)}", hint=_TOO_LARGE_HINT)


def bidi_warnings(text: str, file: str, *, cap: int = MAX_SAME_WARNING) -> list[Diagnostic]:
    """One `bidi-character` warning per line holding a direction control (as rustc's
    `text_direction_codepoint_in_literal`), up to `cap`, then a count."""
    if not any(c in text for c in BIDI_CONTROLS):
        return []
    out: list[Diagnostic] = []
    lines = text.split("\n")
    hidden = 0
    for number, line in enumerate(lines, 1):
        found = [(i, c) for i, c in enumerate(line) if c in BIDI_CONTROLS]
        if not found:
            continue
        if len(out) >= cap:
            hidden += 1
            continue
        col, char = found[0]
        names = ", ".join(dict.fromkeys(f"U+{ord(c):04X} {unicodedata.name(c, '')}" for _, c in found))
        span = Span(file, number, col + 1, number, col + 2, source=text)
        out.append(Diagnostic(
            "bidi-character", f"this line holds {len(found)} invisible text-direction control"
            f"{'s' if len(found) > 1 else ''} ({names})", "warning", span,
            notes=("such characters make the line display in a different order from how it is read "
                   "(the trojan-source attack); they are shown escaped here",),
            hint="delete them; if they are wanted in a comment, write the text without them"))
    if hidden:
        out.append(Diagnostic("bidi-character", f"{file}: {hidden} more line{'s' if hidden > 1 else ''} "
                              "hold text-direction controls", "warning"))
    return out


def cap_repeated(diagnostics: list[Diagnostic], *, cap: int = MAX_SAME_WARNING) -> list[Diagnostic]:
    """Keep the first `cap` warnings of each code; the last one shown says how many more there are.

    Errors are kept (the interpreter caps them itself, `Limits.errors`)."""
    counts: dict[str, int] = {}
    last: dict[str, int] = {}
    out: list[Diagnostic] = []
    for d in diagnostics:
        if d.severity != "warning":
            out.append(d)
            continue
        counts[d.code] = counts.get(d.code, 0) + 1
        if counts[d.code] <= cap:
            last[d.code] = len(out)
            out.append(d)
    for code, count in counts.items():
        if count > cap:   # said on the last one shown
            more = count - cap
            shown = out[last[code]]
            out[last[code]] = dataclasses.replace(shown, notes=shown.notes + (
                f"{more:,} more `{code}` warning{'s' if more > 1 else ''} in this file are not shown",))
    return out
