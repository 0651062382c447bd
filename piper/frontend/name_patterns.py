"""Dotted-name patterns (`"**.bias"`, `"blocks.*.attn.q"`): the one matcher behind `shard ... of`,
`piper.annotate_modules`, `piper.param_groups(no_decay=...)`, `piper.per_group` and `--no-decay`.

    match_names("**.ln_*.weight", ["ln_f.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias"])
        == ["ln_f.weight", "blocks.0.ln_1.weight"]

`*` matches within one dotted part, `**` across parts, a leading `**.` also matches no part, and
`?` and `[...]` are fnmatch's. The matcher runs the pattern as a set of positions advanced one
character of the name at a time (a bit per position), never backtracking: time linear in the name
(times the pattern's length over 64), where a backtracking regex took exponential time on many
stars (`"*" * 60 + "x"` ran past two minutes). A pattern is at most `MAX_PATTERN` characters.
Nothing here imports torch (`piper check` bounds a script's patterns through `pattern_problem`).
"""
from __future__ import annotations

import fnmatch
import re

from ..diagnostics import Diagnostic, PiperError, Span, clip

# Far past any module path (a Hugging Face name is under 100 characters), and small enough that
# a pattern's set of positions is at most 16 machine words.
MAX_PATTERN = 1000
STEPS = 1 << 14       # the states and steps of one pattern's automaton kept (dictionary entries)

_STARS = re.compile(r"(\A\*\*\.|\*\*|\*)")     # a leading `**.`, then `**` before `*`, as always
_NOT_NEWLINE = re.compile(".")                  # `**` and `?` are regex `.`: all but a newline
_NOT_DOT = re.compile("[^.]")                   # `*`: all but a dot (a newline too, as `[^.]` does)
_DOT = re.compile(r"\.")


def pattern_problem(pattern: str, span: Span | None = None) -> Diagnostic | None:
    """The `pattern-too-long` error for a pattern past `MAX_PATTERN` characters, else None.

        >>> pattern_problem("**.bias") is None
        True
        >>> pattern_problem("*" * 2000 + "x").code
        'pattern-too-long'
    """
    if len(pattern) <= MAX_PATTERN:
        return None
    return Diagnostic("pattern-too-long", f"the name pattern `{clip(pattern)}` is over the {MAX_PATTERN:,} characters "
                      "a pattern may be", "error", span,
                      hint="name the modules or parameters with a shorter pattern: `*` matches within one "
                           "dotted part, `**` across parts")


def match_names(pattern: str, names) -> list[str]:
    """The dotted `names` that `pattern` matches, in their order (see the module's docstring);
    raises `pattern-too-long` for a pattern past `MAX_PATTERN` characters."""
    names = list(names)
    problem = pattern_problem(pattern)
    if problem is not None:
        raise PiperError(problem)
    if not any(c in pattern for c in "*?["):
        return [pattern] if pattern in names else []
    matcher = _Matcher.of(pattern)
    return [n for n in names if matcher.matches(n)]


class _Matcher:
    """A pattern as `atoms`, each a character class matched once or repeated (a star), run as a
    set of positions: bit i of a state means the first i atoms can match the name read so far.

    Each state met gets a row, {character: the next state's row, None: the state}: the automaton
    made deterministic as the names need it, so a character costs one dictionary lookup once its
    step is known, and a step not known yet a few operations on integers of the pattern's length
    in bits. At most `STEPS` rows and steps are kept, whatever the names."""

    def __init__(self, atoms: list[tuple[re.Pattern | str, bool]], optional_prefix: bool):
        self.atoms = atoms
        self.accept = 1 << len(atoms)
        self.stars = sum(1 << i for i, (_, star) in enumerate(atoms) if star)
        self.ones = sum(1 << i for i, (_, star) in enumerate(atoms) if not star)
        self.classes: dict[str, int] = {}      # character -> the atoms it satisfies
        self.rows: dict[int, dict] = {}
        self.kept = 0
        self.dead = self._row(0)
        # A leading `**.` is atoms 0 (any run) and 1 (a dot), or none of them: start at 0 and at 2.
        self.start = self._row(self._close(0b101 if optional_prefix else 0b1))

    @classmethod
    def of(cls, pattern: str) -> "_Matcher":
        atoms: list[tuple[re.Pattern | str, bool]] = []
        parts = [p for p in _STARS.split(pattern) if p]
        for part in parts:
            if part == "**.":
                atoms += [(_NOT_NEWLINE, True), (_DOT, False)]
            elif part in ("**", "*"):
                star = _NOT_NEWLINE if part == "**" else _NOT_DOT
                if not (atoms and atoms[-1] == (star, True)):     # `.*.*` is `.*`: one star
                    atoms.append((star, True))
            else:
                atoms += [(one, False) for one in _fnmatch_atoms(part)]
        return cls(atoms, optional_prefix=bool(parts) and parts[0] == "**.")

    def matches(self, name: str) -> bool:
        row, dead = self.start, self.dead
        for char in name:
            row = row.get(char) or self._learn(row, char)
            if row is dead:
                return False
        return bool(row[None] & self.accept)

    def _learn(self, row: dict, char: str) -> dict:
        """The row after `row` on `char`, kept in `row` while fewer than `STEPS` are."""
        state = row[None]
        fits = state & self._class(char)
        after = self._row(self._close(((fits & self.ones) << 1) | (fits & self.stars)))
        if self.kept < STEPS:
            row[char] = after
            self.kept += 1
        return after

    def _row(self, state: int) -> dict:
        row = self.rows.get(state)
        if row is None:
            row = {None: state}
            if self.kept < STEPS:
                self.rows[state] = row
                self.kept += 1
        return row

    def _close(self, state: int) -> int:
        """`state` with the positions after each star it holds (a star may match nothing)."""
        while True:
            wider = state | ((state & self.stars) << 1)
            if wider == state:
                return state
            state = wider

    def _class(self, char: str) -> int:
        """The atoms `char` satisfies, as bits (worked out once per character the names hold)."""
        found = self.classes.get(char)
        if found is None:
            found = sum(1 << i for i, (test, _) in enumerate(self.atoms)
                        if (test == char if isinstance(test, str) else test.fullmatch(char) is not None))
            if len(self.classes) < STEPS:
                self.classes[char] = found
        return found


def _fnmatch_atoms(part: str) -> list[re.Pattern | str]:
    """The one-character atoms of a star-free `part`, as fnmatch reads it: a character, `?` (any
    but a newline) or a `[...]` set (the set's own regex, from `fnmatch.translate`)."""
    atoms: list[re.Pattern | str] = []
    i, n = 0, len(part)
    while i < n:
        c = part[i]
        if c == "?":
            atoms.append(_NOT_NEWLINE)
            i += 1
            continue
        if c != "[":
            atoms.append(c)
            i += 1
            continue
        j = i + 1                  # where the set closes, found as fnmatch.translate finds it
        if j < n and part[j] == "!":
            j += 1
        if j < n and part[j] == "]":
            j += 1
        while j < n and part[j] != "]":
            j += 1
        if j >= n:                 # never closed: a plain `[`
            atoms.append("[")
            i += 1
            continue
        atoms.append(re.compile(fnmatch.translate(part[i:j + 1])[4:-3]))
        i = j + 1
    return atoms
