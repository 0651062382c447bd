"""Diagnostics for people and tools: plain text (ruff/rustc style), rich colour, or JSON.

    examples/bad.pps:3:19: error[unknown-axis]: the mesh has no axis `ppp`
      |
    3 |     place PP=0 on ppp[0]
      |                   ^^^
      = hint: did you mean `pp`?

A `Diagnostic` is data; this module only lays it out. Text and rich share one
layout (`_lines`), so the two never drift apart.
"""
from __future__ import annotations

import functools
import io
import json
import linecache
import re
import sys

from .diagnostics import Diagnostic, Span

# A long `use` chain (say, a recursion-limit) shows its nearest and outermost sites.
MAX_TRACE_SHOWN = 6
_SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "note": "bold cyan"}
_TAB = "    "


# Characters never sent to a terminal as they are: C0/C1 controls (escape sequences start with
# them), and the invisible format characters (direction overrides, zero-width marks).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                     "\u2060-\u206f\ufeff\ufff9-\ufffb]")


def _escape_one(match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{{{code:04x}}}"


def visible(text: str) -> str:
    """`text` with every control or invisible format character written as an escape
    (`\\x1b`, `\\u{202e}`); tabs and newlines stay."""
    return _UNSAFE.sub(_escape_one, text) if not text.isascii() or not text.isprintable() else text


@functools.lru_cache(maxsize=8)
def _split_source(source: str) -> list[str]:
    """A source's lines, split once however many diagnostics point into it."""
    return source.split("\n")


def _source_line(span: Span, number: int) -> str | None:
    if span.source is not None:
        lines = _split_source(span.source)
        return lines[number - 1].rstrip("\r") if 0 < number <= len(lines) else None
    text = linecache.getline(span.file, number)
    return text.rstrip("\r\n") if text else None


MAX_LINE = 160      # characters of a source line a snippet shows: a longer line is shown around its span


def _snippet(span: Span, mark: str, message: str, style: str, width: int) -> list[list[tuple[str, str]]]:
    """Two lines: the source line, and `mark` under the span (to the line's end if it spans lines)."""
    line = _source_line(span, span.line)
    if line is None:
        return []
    start = max(span.column, 1)
    end = span.end_column if span.end_line == span.line else len(line) + 1
    end = max(end, start + 1)
    pad = len(visible(line[: start - 1]).replace("\t", _TAB))
    count = max(len(visible(line[start - 1: end - 1]).replace("\t", _TAB)), 1)
    shown = visible(line).replace("\t", _TAB)
    if len(shown) > MAX_LINE:       # a window of the line at the span, as rustc shows long lines
        left = max(0, pad - MAX_LINE // 4)
        window = shown[left:left + MAX_LINE]
        shown = ("..." if left else "") + window + ("..." if left + MAX_LINE < len(shown) else "")
        count = max(1, min(count, MAX_LINE - (pad - left)))
        pad = pad - left + (3 if left else 0)
    gutter = " " * width
    under = [(f"{gutter} | ", "blue"), (" " * pad, ""), (mark * count, style)]
    if message:
        under.append((" " + message, style))
    return [[(f"{span.line:>{width}} | ", "blue"), (shown, "")], under]


def _lines(d: Diagnostic) -> list[list[tuple[str, str]]]:
    """The layout: a list of lines, each a list of (text, style) pieces, every piece safe to print."""
    return [[(visible(text), style) for text, style in line] for line in _layout(d)]


def _layout(d: Diagnostic) -> list[list[tuple[str, str]]]:
    severity_style = _SEVERITY_STYLE.get(d.severity, "bold")
    head = [(f"{d.span}: ", "bold")] if d.span else []
    head += [(d.severity, severity_style), (f"[{d.code}]", "dim" if d.span else "bold"), (f": {d.message}", "bold")]
    out = [head]
    spans = [s for s in [d.span, *(label.span for label in d.labels)] if s is not None]
    width = max((len(str(s.line)) for s in spans), default=1)
    gutter = " " * width
    if d.span is not None:
        snippet = _snippet(d.span, "^", "", severity_style.replace("bold ", ""), width)
        if snippet:
            out.append([(f"{gutter} |", "blue")])
            out += snippet
    for label in d.labels:
        snippet = _snippet(label.span, "-", label.message, "blue", width)
        if label.span.file != (d.span.file if d.span else None):
            out.append([(f"{gutter}::: {label.span}", "blue")])
        if snippet:
            out.append([(f"{gutter} |", "blue")])
            out += snippet
        elif label.span.file == (d.span.file if d.span else None):
            out.append([(f"{gutter} = ", "blue"), (f"{label.message} ({label.span})", "")])
    for note in d.notes:
        out.append([(f"{gutter} = ", "blue"), ("note", "bold"), (f": {note}", "")])
    trace = list(reversed(d.trace))  # nearest `use` first
    if len(trace) > MAX_TRACE_SHOWN:
        keep = MAX_TRACE_SHOWN // 2
        hidden = len(trace) - 2 * keep
        trace = trace[:keep] + [f"... {hidden} more"] + trace[-keep:]
    for site in trace:
        text = f"used from {site}" if isinstance(site, Span) else site
        out.append([(f"{gutter} = ", "blue"), ("note", "bold"), (f": {text}", "")])
    if d.hint:
        out.append([(f"{gutter} = ", "blue"), ("hint", "bold cyan"), (f": {d.hint}", "")])
    return out


def _text(diagnostics) -> str:
    blocks = []
    for d in diagnostics:
        blocks.append("\n".join("".join(text for text, _ in line).rstrip() for line in _lines(d)))
    return "\n\n".join(blocks) + ("\n" if blocks else "")


def _rich(diagnostics, color: bool) -> str:
    from rich.console import Console
    from rich.text import Text

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=color, no_color=not color, color_system="standard" if color else None,
                      width=100_000, highlight=False, soft_wrap=True, emoji=False, markup=False)
    for i, d in enumerate(diagnostics):
        if i:
            console.print()
        for line in _lines(d):
            text = Text()
            for piece, style in line:
                text.append(piece, style=style or None)
            text.rstrip()
            console.print(text)
    return buffer.getvalue()


def _span_json(span: Span | None) -> dict:
    if span is None:
        return {"file": None, "line": None, "column": None, "end_line": None, "end_column": None}
    return {"file": span.file, "line": span.line, "column": span.column,
            "end_line": span.end_line, "end_column": span.end_column}


def to_json(d: Diagnostic) -> dict:
    """One diagnostic as a JSON object (the `--format json` schema)."""
    return {
        "code": d.code,
        "severity": d.severity,
        "message": d.message,
        **_span_json(d.span),
        "hint": d.hint,
        "notes": list(d.notes),
        "labels": [{**_span_json(label.span), "message": label.message} for label in d.labels],
        "trace": [_span_json(site) for site in d.trace],
    }


def render(diagnostics, *, format: str = "text", color: bool | None = None) -> str:
    """Lay out `diagnostics` as "text", "concise" (one line each), "rich" (ANSI colour unless
    color=False) or "json"."""
    diagnostics = list(diagnostics)
    if format == "json":
        return json.dumps([to_json(d) for d in diagnostics], indent=2) + "\n"
    if format == "rich":
        return _rich(diagnostics, color is not False)
    if format == "text":
        return _text(diagnostics)
    if format == "concise":
        return "".join(_lines(d)[0] and "".join(t for t, _ in _lines(d)[0]) + "\n" for d in diagnostics)
    raise ValueError(f"unknown format {format!r}; use text, concise, rich or json")


def summary(diagnostics) -> str:
    """"2 errors, 1 warning" (or "no problems")."""
    counts = {}
    for d in diagnostics:
        counts[d.severity] = counts.get(d.severity, 0) + 1
    parts = [f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in ("error", "warning", "note") if s in counts]
    return ", ".join(parts) or "no problems"


def print_diagnostics(diagnostics, file=None) -> None:
    """Print to `file` (default stderr): rich colour on a terminal, plain text otherwise."""
    file = file if file is not None else sys.stderr
    isatty = getattr(file, "isatty", None)
    tty = bool(isatty and isatty())
    file.write(render(diagnostics, format="rich" if tty else "text", color=tty))
    file.flush()
