"""Reading a prototype JSON program within fixed bounds (`piper import FILE.json`).

Each bound is checked before work proportional to what it bounds begins, so a
file of any content is answered in well under a second with bounded memory:
the size by reading at most MAX_BYTES + 1 bytes, the nesting by one scan of
the text before `json.loads` recurses into it, a number's length inside the
parser before `int()` converts it. Every failure is a `bad-program-json` or
`program-too-large` diagnostic, never a Python exception.

    >>> parse_program('[{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4}]', "p.json")
    [{'op': 'split', 'filter': {}, 'dim_name': 'MB', 'num_microbatches': 4}]
"""
from __future__ import annotations

import json
import os
import re

from ..diagnostics import error

MAX_BYTES = 1 << 20     # 1 MiB: the largest builder output we know (DualPipeV, p=8, m=64, indented) is ~0.4 MiB
MAX_DEPTH = 32          # arrays and objects inside each other; a real program nests 5 deep
MAX_DIGITS = 19         # digits of one integer literal: 2^62, the .pps language's integer bound, has 19

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")     # deleted by bytes.translate, in C
# A JSON string (escapes included) or one bracket; strings are matched whole so brackets inside them are skipped.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


class _NumberTooLong(ValueError):
    pass


def _position(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    return f"{line}:{offset - (text.rfind(chr(10), 0, offset) + 1) + 1}"


def _first_too_deep(text: str) -> int | None:
    """The offset of the first bracket nested deeper than MAX_DEPTH, by counting (no recursion)."""
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text):
        c = m.group()
        if c == "[" or c == "{":
            depth += 1
            if depth > MAX_DEPTH:
                return m.start()
        elif c == "]" or c == "}":
            depth -= 1
    return None


def _too_deep(text: str) -> int | None:
    """Where `text` nests deeper than MAX_DEPTH, if it does.

    The brackets outside strings lose their innermost pairs once per pass (in C, by
    `str.replace`), which takes at least one level off each time: what is left after
    MAX_DEPTH passes nests deeper, or does not balance. Only then are they counted
    one by one, to find where (or that they only do not balance, for json.loads to say)."""
    brackets = _STRING.sub("", text).encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKET)
    for _ in range(MAX_DEPTH):
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == brackets:         # empty, or brackets that do not balance (counted, to be sure)
            break
        brackets = shorter
    return _first_too_deep(text) if brackets else None


def _int(literal: str) -> int:
    if len(literal) - literal.startswith("-") > MAX_DIGITS:
        raise _NumberTooLong(literal)
    return int(literal)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_program(text: str, file: str):
    """The parsed JSON of a program's `text`; raise `PiperError` past a bound or for text that is not JSON."""
    if len(text) > MAX_BYTES:
        raise error("program-too-large", f"{file} is {len(text):,} characters; a prototype program may have at "
                    f"most {MAX_BYTES:,}", hint="split the program, or write the strategy as a .pps script")
    deep = _too_deep(text)
    if deep is not None:
        raise error("program-too-large", f"{file}:{_position(text, deep)}: arrays and objects nest more than "
                    f"{MAX_DEPTH} deep", hint="a prototype program nests 5 deep: a list of directives, an order's "
                    "filters, a slot, a filter")
    try:
        return json.loads(text, parse_int=_int, parse_constant=_no_constant)
    except _NumberTooLong as err:
        digits = str(err)
        raise error("program-too-large", f"{file}: a number of {len(digits):,} digits ({digits[:12]}...); numbers "
                    f"in a program have at most {MAX_DIGITS} digits", hint="device numbers, tag indices and "
                    "microbatch counts are small integers") from None
    except json.JSONDecodeError as err:
        raise error("bad-program-json", f"{file}:{err.lineno}:{err.colno}: not JSON: {err.msg}",
                    hint="a prototype program is a JSON array of directive objects") from None
    except (ValueError, RecursionError) as err:    # NaN/Infinity, or a nesting the scan let through
        raise error("bad-program-json", f"{file}: not JSON: {str(err)[:80]}",
                    hint="a prototype program is a JSON array of directive objects") from None


def read_program(path: str):
    """The parsed JSON program in the regular file at `path`, read with a bounded size."""
    from ..dsl.source import SourceError, read_prefix
    from .prototype_directives import show

    base = os.path.basename(path)
    name = base if len(base) <= 80 else base[:77] + "..."
    try:        # a regular file only, opened without blocking, read to one byte past the bound
        data = read_prefix(path, MAX_BYTES + 1)
    except SourceError as err:
        raise error("file-not-found", f"cannot read {show(path, 120)}: {err.reason}",
                    hint="name a .json file; the path is relative to the current folder") from None
    if len(data) > MAX_BYTES:
        raise error("program-too-large", f"{name} is larger than {MAX_BYTES:,} bytes, the most a prototype program "
                    "may have", hint="split the program, or write the strategy as a .pps script")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise error("bad-program-json", f"{name}: byte {err.start} is not UTF-8 ({err.reason})",
                    hint="JSON files are UTF-8 text") from None
    return parse_program(text, name)
