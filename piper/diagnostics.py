"""Diagnostics as data: what went wrong, where, and what to do about it.

Every user-facing error in Piper is a `Diagnostic` (stable kebab-case code,
severity, message, spans, notes, hint). Rendering lives elsewhere
(`piper.render`): the same diagnostic prints with rich, as plain text or JSON.
User mistakes raise `PiperError`; internal invariants use `assert`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Severity = Literal["error", "warning", "note"]


@dataclass(frozen=True)
class Span:
    """A region of a source file, 1-based lines and columns, end exclusive.

    `source` is the text of the whole file when known, so a renderer can show
    the user's own line without reading the file again.
    """

    file: str
    line: int
    column: int
    end_line: int
    end_column: int
    source: str | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Label:
    """A secondary span with a short message ("first placed here")."""

    span: Span
    message: str


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    severity: Severity = "error"
    span: Span | None = None
    labels: tuple[Label, ...] = ()
    notes: tuple[str, ...] = ()
    hint: str | None = None
    # Where the failing statement was reached from: `use` sites, outermost first.
    trace: tuple[Span, ...] = ()

    def __post_init__(self):
        # A word of a user's text (a 60,000-character name in a script, a path) is quoted short
        # wherever a message was built without `clip`: each run of over MAX_WORD non-blanks.
        for name in ("message", "hint"):
            text = getattr(self, name)
            if text is not None and len(text) > MAX_WORD:
                object.__setattr__(self, name, bounded(text))
        if any(len(note) > MAX_WORD for note in self.notes):
            object.__setattr__(self, "notes", tuple(map(bounded, self.notes)))

    def with_span(self, span: Span | None) -> "Diagnostic":
        """The same diagnostic pointed at `span` (kept if `span` is None)."""
        if span is None:
            return self
        return Diagnostic(self.code, self.message, self.severity, span, self.labels,
                          self.notes, self.hint, self.trace)

    def __str__(self) -> str:
        where = f"{self.span}: " if self.span else ""
        text = f"{where}{self.severity}[{self.code}]: {self.message}"
        for note in self.notes:
            text += f"\n  note: {note}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class PiperError(Exception):
    """A user mistake, carrying one or more diagnostics.

    `str(err)` is readable on its own; tools render `err.diagnostics`.
    """

    def __init__(self, *diagnostics: Diagnostic):
        assert diagnostics, "PiperError needs at least one diagnostic"
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(str(d) for d in self.diagnostics))

    @property
    def code(self) -> str:
        return self.diagnostics[0].code


class PiperWarning(UserWarning):
    """A diagnostic of severity "warning" raised through Python's `warnings` (`.diagnostic`)."""

    def __init__(self, diagnostic: Diagnostic):
        self.diagnostic = diagnostic
        super().__init__(str(diagnostic))

    @property
    def code(self) -> str:
        return self.diagnostic.code


def error(code: str, message: str, *, span: Span | None = None, hint: str | None = None,
          notes: tuple[str, ...] | list[str] = (), labels: tuple[Label, ...] = ()) -> PiperError:
    """Build a one-diagnostic `PiperError`; the caller raises it."""
    return PiperError(Diagnostic(code, message, "error", span, tuple(labels), tuple(notes), hint))


MAX_SHOWN = 60      # characters of a user's value (a --set word, a name) that a message quotes
MAX_WORD = 200      # a run of non-blanks in a message past this is a user's value: `bounded` clips it
_LONG_WORD = re.compile(r"\S{%d,}" % (MAX_WORD + 1))
_CLOSING = "`'\")]:;,."
_OPENING = "`'\"(["


def clip(text, limit: int = MAX_SHOWN) -> str:
    """`text` as a message quotes it: whole up to `limit` characters, else its start and its length,
    so a 5,000-character `--set` value or name does not fill the terminal.

    >>> clip("pp"), clip("9" * 5000)[-23:]
    ('pp', '9... (5,000 characters)')
    """
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def bounded(text: str) -> str:
    """`text` with every run of over MAX_WORD non-blank characters clipped (its closing quote or
    punctuation kept), so no message quotes a user's value whole.

    >>> bounded("no strategy is called `" + "z" * 500 + "`").endswith("zz... (500 characters)`")
    True
    """
    def cut(match) -> str:
        word = match.group(0)
        end = len(word.rstrip(_CLOSING))
        start = len(word) - len(word.lstrip(_OPENING))
        return word[:start] + clip(word[start:end]) + word[end:]

    return _LONG_WORD.sub(cut, text)


def did_you_mean(name: str, choices) -> str | None:
    """The closest of `choices` to `name`, phrased as a hint, or None."""
    import difflib

    if len(str(name)) > 4 * MAX_SHOWN:    # nothing so long is close to a name (and difflib is quadratic)
        return None
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


class UsageError(Exception):
    """A bad flag value: printed as `piper <command>: error: ...`, exit 2. Here, below the command line,
    so the commands' own modules (`piper tune`'s search) raise it without importing `piper.cli`."""
