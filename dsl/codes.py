"""Every diagnostic code the language, the checker and the CLI emit, with a one-line summary.

`piper explain CODE` prints the page docs/codes/CODE.md; this table is what it
falls back to when the pages are not installed, and what the tests hold every
page against.
"""
from __future__ import annotations

from pathlib import Path

SYNTAX = {
    "syntax-error": "the parser expected something else here (the message says what)",
    "missing-colon": "a line that opens a block does not end with `:`",
    "unclosed-bracket": "a `(` or `[` is not closed on its line",
    "bad-indent": "a line is indented where no block starts, or a block is not indented",
    "unexpected-token-in-selector": "a selector holds something other than NAME=VALUE tags",
    "missing-into": "`split` without `into`",
    "missing-over": "`shard` without `over`",
    "missing-on": "`place` (or `use ... on`) without `on`",
    "missing-expression": "a value is missing, e.g. after `=` or `into`",
    "bad-range": "a `for` loop without a `START..END` range",
    "missing-separator": "two items without `;` (slots) or `,` (lists) between them",
    "bad-import": "`import` without a quoted path relative to the script",
    "misplaced-statement": "a statement where it may not appear (mesh in a block, place in an order block)",
    "unknown-statement": "a line that does not start with a statement keyword",
    "unexpected-character": "a character that is not part of the language",
    "unterminated-string": "a string without its closing quote",
    "nesting-limit": "blocks or expressions nested too deeply",
}
NAMES_AND_TYPES = {
    "unknown-name": "a name that is not bound (no let, parameter or loop variable)",
    "unknown-axis": "an axis the mesh does not have",
    "unknown-strategy": "`use` names a strategy that is not defined, imported or in the standard library",
    "unknown-parameter": "an argument, `on` or `--set` names a parameter that does not exist",
    "unknown-pass": "an order item names a pass other than F, B, BI, BW, UPD",
    "unknown-type": "a parameter type other than int, bool or axis",
    "missing-parameter": "a `use` leaves a parameter without a default unset",
    "wrong-type": "a value of the wrong kind (an axis where a number is needed, ...)",
    "wrong-arity": "too many or too few arguments",
    "duplicate-name": "one name defined twice (strategy, parameter, argument, tag, mesh axis)",
    "ambiguous-axis": "`use ... on X` when the strategy has several axis parameters",
    "ambiguous-strategy": "a file defines several strategies and uses none, so none can run",
}
VALUES = {
    "value-out-of-range": "a number outside what it may be (microbatches < 1, an index outside its axis)",
    "division-by-zero": "`//` or `%` by zero",
    "bad-split": "`split` of something other than MB (into a count) or B (into BI, BW)",
    "bad-shard": "`shard` of something other than batch, optimizer, grads, params",
    "loop-limit": "the script takes more than 1,000,000 steps",
    "recursion-limit": "`use` or `import` nested more than 64 levels deep",
}
FILES = {
    "import-not-found": "an imported file cannot be read",
    "import-cycle": "files import each other in a circle",
    "mesh-mismatch": "the script's `mesh` line differs from the mesh it is run on",
    "file-not-found": "the script file cannot be read",
}
WARNINGS = {
    "unused-let": "a `let` that nothing reads (warning)",
    "shadowed-name": "a name that hides a parameter, variable or mesh axis (warning)",
}
TOOLS = {
    "analysis-unavailable": "model checks were asked for but cannot run here (note)",
    "internal-error": "a bug in Piper itself, not in the script",
    "bad-mesh": "a mesh given as NAME=SIZE pairs cannot be read",
}
# Emitted by the Python API's modules (selectors, mesh, strategy); documented with the rest.
PYTHON_API = {
    "bad-selector": "a selector string that cannot be read",
    "device-out-of-mesh": "`mesh[axis][index]` with an index outside the axis",
    "bad-place": "`place` given something other than a device group",
    "bad-strategy": "something that is not a strategy passed as one",
}

CODES: dict[str, str] = {**SYNTAX, **NAMES_AND_TYPES, **VALUES, **FILES, **WARNINGS, **TOOLS, **PYTHON_API}


def docs_dir() -> Path:
    """docs/codes in the source tree this package runs from."""
    return Path(__file__).resolve().parent.parent / "docs" / "codes"


def page(code: str) -> str | None:
    """The docs page for `code`, or its one-line summary when pages are not installed, or None."""
    path = docs_dir() / f"{code}.md"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if code in CODES:
        return f"# {code}\n\n{CODES[code]}.\n\n(The full page is docs/codes/{code}.md in the Piper repository.)\n"
    return None


def known_codes() -> list[str]:
    """Codes with a page or a summary, for "did you mean"."""
    pages = [p.stem for p in docs_dir().glob("*.md")] if docs_dir().is_dir() else []
    return sorted(set(pages) | set(CODES))
