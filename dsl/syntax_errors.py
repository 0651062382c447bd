"""Syntax errors with names: lark's parser state -> a code, a message in words, a hint.

The table `EXAMPLES` lists bad snippets under the code they should produce.
As in lark's `UnexpectedInput.match_examples`, an error is matched to the
example that fails in the same parser state (and, first, on the same kind of
token); the table is parsed once and kept, so naming an error costs a lookup.
Errors no example covers fall to a few rules on what the parser expected, and
last to `syntax-error`, which still says what was expected and what was found.
"""
from __future__ import annotations

import functools
import re

from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from piper.diagnostics import Diagnostic, Label, Span, did_you_mean

from .parser import KEYWORDS, BadDedent, raw_parse


EXAMPLES: dict[str, list[str]] = {
    "missing-colon": [
        "strategy s()\n    let x = 1\n",
        "for i in 0..3\n    let x = 1\n",
        "if 1 < 2\n    let x = 1\n",
        "if 1 < 2: let x = 1\nelse\n    let x = 1\n",
        "order PP=0\n    F(MB=0)\n",
        "order PP=0:\n    for m in 0..2\n        F(MB=m)\n",
        "order PP=0:\n    if 1 < 2\n        F\n",
    ],
    "unclosed-bracket": [
        "order PP=0: F(MB=0\n",
        "order PP=0: F(MB=0, PP=1\n",
        "order PP=0: [F(MB=0), B(MB=0)\n",
        "use s(a=1\n",
        "use s(\n",
        "let x = min(1, 2\n",
        "let x = (1 + 2\n",
        "place PP=0 on pp[0\n",
        "strategy s(a: int\n",
    ],
    "unexpected-token-in-selector": [
        "place PP 0 on pp[0]\n",
        "place PP: 0 on pp[0]\n",
        "place 0 on pp[0]\n",
        "place PP=0, EP=1 on pp[0]\n",
        "order PP=0 EP: F\n",
        "order PP=0: F(MB 0)\n",
        "order PP=0: F(MB=0 PP=1)\n",
        "order PP=0: F(0)\n",
        "order 3: F\n",
        "recompute F(MB=0)\n",
        "recompute PP\n",
        "recompute 0\n",
        "recompute\n",
    ],
    "missing-into": ["split MB 8\n", "split MB\n", "split MB in 8\n", "split B BI, BW\n"],
    "missing-over": ["shard batch dp\n", "shard batch\n", "shard batch on dp\n", "shard batch, grads dp\n",
                     'shard columns of "a" tp\n', 'shard columns of "a"\n'],
    "missing-of": ['shard columns "a" over tp\n', 'shard columns, "a" over tp\n'],
    "missing-pattern": ["shard columns of over tp\n", "shard columns of a over tp\n", 'shard rows of "a", over tp\n',
                        'shard rows of "a", b over tp\n', "shard vocab of\n"],
    "missing-on": ["place PP=0 pp[0]\n", "place PP=0\n", "place PP=0 onn pp[0]\n", "use s() dp\n",
                   "use s() over dp\n"],
    "missing-expression": [
        "let x =\n",
        "split MB into\n",
        "for i in 0..:\n",
        "for i in ..3:\n",
        "let x = 1 +\n",
        "place PP= on pp[0]\n",
        "use s(a=)\n",
        "if :\n",
    ],
    "bad-range": ["for i in 3:\n", "for i in range(3):\n", "for i in 0, 3:\n"],
    "missing-separator": [
        "order PP=0: F(MB=0) B(MB=0)\n",
        "order PP=0: F(MB=0), B(MB=0)\n",
        "order PP=0: [F(MB=0) B(MB=0)]\n",
        "mesh dp=2 pp=2\n",
        "use s(a=1 b=2)\n",
        "let x = min(1 2)\n",
        'shard columns of "a" "b" over tp\n',
    ],
    "bad-import": ["import zero3\n", "import\n"],
    "misplaced-statement": [
        "strategy s():\n    mesh dp=2\n",
        "strategy s():\n    import \"a.pps\"\n",
        "strategy s():\n    strategy t():\n",
        "else:\n",
        "order PP=0:\n    place PP=0 on pp[0]\n",
        "order PP=0:\n    split MB into 2\n",
        "for i in 0..2: order PP=0: F\n",
    ],
    "unknown-statement": ["palce PP=0 on pp[0]\n", "strategy s():\n    palce PP=0\n", "x = 1\n"],
}

_STATEMENT_WORDS = {"MESH", "IMPORT", "STRATEGY", "LET", "SPLIT", "PLACE", "SHARD", "USE", "FOR", "IF",
                    "ORDER", "ELSE", "RECOMPUTE"}
_EXPRESSION_START = {"INT", "NAME", "LPAR", "MINUS", "NOT", "TRUE", "FALSE"}
_LINE_END = {"_NL", "$END", "<EOF>", "_DEDENT"}
_WORDS = {
    "COLON": "`:`", "COMMA": "`,`", "EQUAL": "`=`", "SEMICOLON": "`;`", "LPAR": "`(`", "RPAR": "`)`",
    "LSQB": "`[`", "RSQB": "`]`", "RANGE": "`..`", "STAR": "`*`", "PLUS": "`+`", "MINUS": "`-`",
    "FLOORDIV": "`//`", "PERCENT": "`%`", "COMPARE": "a comparison", "NAME": "a name", "INT": "a number",
    "STRING": "a quoted string", "_NL": "the end of the line", "$END": "the end of the file",
    "<EOF>": "the end of the file", "_INDENT": "an indented block", "_DEDENT": "the end of the block",
}
_OPENERS = {"(": ")", "[": "]"}


def _word(kind: str) -> str:
    return _WORDS.get(kind) or f"`{kind.lower()}`"


def _found(token) -> str:
    kind = token.type
    if kind in ("_NL", "$END", "<EOF>", "_INDENT", "_DEDENT"):
        return {"_INDENT": "an indented line"}.get(kind, _word(kind))
    text = str(token)
    if "\n" in text or len(text) > 24:
        text = text.split("\n", 1)[0][:20] + "..."
    return f"`{text}`"


_OPERATORS = {"PLUS", "MINUS", "STAR", "FLOORDIV", "PERCENT", "COMPARE", "AND", "OR"}


def _expected(kinds) -> str:
    kinds = set(kinds) - {"COMMENT"}
    if kinds - _OPERATORS - {"_NL"}:  # an operator could always continue an expression: not news
        kinds -= _OPERATORS
    if len(kinds & _EXPRESSION_START) >= 3:
        kinds = (kinds - _EXPRESSION_START) | {"a value"}
    if len(kinds & _STATEMENT_WORDS) >= 3:
        kinds = (kinds - _STATEMENT_WORDS) | {"a statement"}
    words = sorted(k if k in ("a value", "a statement") else _word(k) for k in kinds)
    if not words:
        return "something else"
    if len(words) > 5:
        words = words[:5] + ["..."]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


@functools.cache
def _table() -> tuple[dict, dict]:
    """Parse every example once: (state, token type) -> code, and state -> code when unanimous.

    A state is the parser's automaton state with the set of tokens it would
    accept there (LALR merges states that accept different tokens).
    """
    by_token: dict = {}
    by_state: dict = {}
    for code, examples in EXAMPLES.items():
        for example in examples:
            try:
                raw_parse(example)
            except UnexpectedInput as err:
                state = _state(err)
                by_token.setdefault((state, _token_type(err)), code)
                by_state.setdefault(state, set()).add(code)
            except BadDedent:
                continue
    unanimous = {state: next(iter(codes)) for state, codes in by_state.items() if len(codes) == 1}
    return by_token, unanimous


def _state(err: UnexpectedInput):
    state = getattr(err, "state", None)
    return getattr(state, "position", state), frozenset(_accepts(err))


def _token_type(err: UnexpectedInput) -> str:
    if isinstance(err, UnexpectedCharacters):
        return f"char:{err.char}"
    return err.token.type


def _accepts(err: UnexpectedInput) -> set[str]:
    if isinstance(err, UnexpectedCharacters):
        return set(err.allowed or ())
    accepts = getattr(err, "accepts", None) or getattr(err, "expected", None) or set()
    return set(accepts) - {"COMMENT", "__IGNORE_0"}


def match(err: UnexpectedInput) -> str | None:
    """The code of the example that failed the same way, or None."""
    by_token, by_state = _table()
    state = _state(err)
    return by_token.get((state, _token_type(err))) or by_state.get(state)


class _Where:
    """Helpers over the text being parsed (1-based lines and columns)."""

    def __init__(self, text: str, file: str, source: str):
        self.lines = text.split("\n")
        self.file = file
        self.source = source

    def line(self, number: int) -> str:
        return self.lines[number - 1] if 0 < number <= len(self.lines) else ""

    def span(self, line: int, column: int, width: int = 1) -> Span:
        return Span(self.file, line, column, line, column + max(width, 1), self.source)

    def end_of_code(self, line: int) -> Span:
        """Just after the last character of code on `line` (before any comment)."""
        text = self.line(line).split("#", 1)[0].rstrip()
        return self.span(line, len(text) + 1)

    def last_code_line(self, before: int) -> int:
        for number in range(min(before, len(self.lines)) - 1, 0, -1):
            stripped = self.line(number).strip()
            if stripped and not stripped.startswith("#"):
                return number
        return max(1, min(before, len(self.lines)))

    def open_bracket(self, line: int, column: int) -> Span | None:
        """The last bracket on `line` before `column` that is not closed."""
        stack = []
        for i, ch in enumerate(self.line(line)[: max(column - 1, 0)]):
            if ch in _OPENERS:
                stack.append(i)
            elif ch in ")]" and stack:
                stack.pop()
        return self.span(line, stack[-1] + 1) if stack else None


def describe(err: Exception, text: str, file: str, source: str) -> tuple[Diagnostic, int, str]:
    """Name a lark error: (diagnostic, line to blank out, blanking mode for recovery)."""
    where = _Where(text, file, source)
    if isinstance(err, BadDedent):
        width = len(where.line(err.line).strip()) or 1
        if err.first_line:
            return (Diagnostic("bad-indent", "unexpected indent: the first line of a script starts at column 1",
                               span=where.span(err.line, err.column, width),
                               hint="remove the spaces before it"), err.line, "indent")
        return (Diagnostic("bad-indent", "this line is indented less than the block it is in, but more than "
                           "the block around it", span=where.span(err.line, err.column, width),
                           hint="indent it exactly as far as one of the lines above it"), err.line, "indent")
    if isinstance(err, UnexpectedCharacters):
        return _characters(err, where), err.line, "statement"
    assert isinstance(err, (UnexpectedToken, UnexpectedEOF)), type(err)
    return _token(err, where)


def _characters(err: UnexpectedCharacters, where: _Where) -> Diagnostic:
    span = where.span(err.line, err.column)
    if err.char == '"':
        rest = where.line(err.line)[err.column:]
        if '"' not in rest:
            return Diagnostic("unterminated-string", "this string has no closing `\"`", span=span,
                              hint="end the string with `\"` on the same line, or use `\"\"\"` for several lines")
    if err.char == "/":
        return Diagnostic("unexpected-character", "`/` is not an operator here", span=span,
                          hint="integers divide with `//` (floor division), e.g. `microbatches // 2`")
    shown = err.char if err.char.isprintable() else repr(err.char)
    return Diagnostic("unexpected-character", f"the character `{shown}` cannot appear here", span=span,
                      notes=(f"expected {_expected(err.allowed or ())}",),
                      hint="remove it; comments start with `#`")


def _token(err, where: _Where) -> tuple[Diagnostic, int, str]:
    token = err.token
    kind = token.type
    accepts = _accepts(err)
    line = getattr(token, "line", None) or len(where.lines)
    column = getattr(token, "column", None) or 1
    at_end = kind in _LINE_END
    if kind == "_NL":
        span = where.end_of_code(line)
    elif at_end or getattr(token, "end_line", None) is None:
        span = where.span(line, column)
    else:
        span = Span(where.file, line, column, token.end_line, token.end_column, where.source)

    if kind == "_INDENT":
        return (Diagnostic("bad-indent", "unexpected indent: this line is indented more than the line before it",
                           span=where.span(line, column, len(where.line(line).strip())),
                           hint="indent a line only after a line ending with `:`; otherwise line it up with "
                                "the line above"), line, "indent")
    if "_INDENT" in accepts:
        header = line if kind in ("$END", "<EOF>") else where.last_code_line(line)
        return (Diagnostic("bad-indent", "expected an indented block after this line",
                           span=where.end_of_code(header),
                           hint="indent the lines of the block under the line that ends with `:`"),
                header, "statement")

    code = match(err) or _rule_of_thumb(kind, accepts, where.open_bracket(span.line, span.column))
    maker = _MESSAGES.get(code, _generic)
    message, hint, labels, *moved = maker(token, accepts, where, span)
    span = moved[0] if moved else span
    return Diagnostic(code, message, span=span, hint=hint, labels=tuple(labels)), line, "statement"


def _rule_of_thumb(kind: str, accepts: set[str], opened: Span | None) -> str:
    """Name errors that no example matched, from what the parser would have accepted."""
    if kind in _STATEMENT_WORDS and accepts & _STATEMENT_WORDS:
        return "misplaced-statement"
    if kind == "NAME" and accepts & _STATEMENT_WORDS and "NAME" not in accepts:
        return "unknown-statement"
    if kind in _LINE_END and "COLON" in accepts:
        return "missing-colon"
    if accepts & {"RPAR", "RSQB"} and (kind in _LINE_END or (opened is not None and kind not in _EXPRESSION_START)):
        return "unclosed-bracket"
    if len(accepts & _EXPRESSION_START) >= 3 and (kind in _LINE_END or kind not in _EXPRESSION_START):
        return "missing-expression"
    return "syntax-error"


# ---- one message maker per code: (token, accepts, where, span) -> (message, hint, labels)


_GENERIC_HINTS = {
    "LPAR": "a strategy takes parentheses, even when empty: `use zero3()`",
    "LSQB": "name a device group with an index along the axis, e.g. `pp[0]`",
    "INT": "write a whole number, e.g. `2`",
    "EQUAL": "write `NAME = VALUE`",
    "NAME": "write a name here",
}


def _generic(token, accepts, where, span):
    shown = set(accepts) - _OPERATORS if set(accepts) - _OPERATORS - {"_NL"} else set(accepts)
    hint = _GENERIC_HINTS.get(next(iter(shown))) if len(shown) == 1 else None
    if str(token) in KEYWORDS and "NAME" in accepts:
        hint = f"`{token}` is a keyword and cannot be used as a name"
    elif token.type == "NAME":
        words = [k.lower() for k in accepts if k.lower() in KEYWORDS]
        hint = did_you_mean(str(token), words) or hint
    return f"expected {_expected(accepts)}, found {_found(token)}", hint, []


def _missing_colon(token, accepts, where, span):
    return (f"expected `:` at the end of this line, found {_found(token)}",
            "a line that opens a block (strategy, for, if, else, order) ends with `:`", [])


def _unclosed(token, accepts, where, span):
    opened = where.open_bracket(span.line, span.column)
    if opened is None:
        closer, labels = (")" if "RPAR" in accepts else "]"), []
    else:
        closer = _OPENERS[where.line(opened.line)[opened.column - 1]]
        labels = [Label(opened, "opened here")]
    return (f"expected `{closer}` to close the bracket, found {_found(token)}",
            f"close it with `{closer}` on the same line", labels)


def _selector(token, accepts, where, span):
    hint = "write tags as NAME=VALUE or NAME=*, e.g. `PP=1 EP=*` for regions or `F(MB=0)` for compute"
    if token.type == "COMMA" and "EQUAL" not in accepts:
        hint = "separate region tags with spaces, `PP=0 EP=1`; commas go inside a pass, `F(PP=0, MB=1)`"
    elif token.type == "NAME" and "COMMA" in accepts:
        hint = "separate the tags inside a pass with `,`, e.g. `F(PP=0, MB=1)`"
    return f"expected {_expected(accepts)} in this selector, found {_found(token)}", hint, []


def _keyword_missing(word: str, example: str):
    def make(token, accepts, where, span):
        before = where.line(span.line)[: span.column - 1]
        if word == "on" and before.lstrip().startswith("use"):
            example_ = "use zero3() on dp"
        else:
            example_ = example
        hint = f"write it as `{example_}`"
        previous = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", before)
        if token.type == "NAME" and did_you_mean(str(token), [word]):
            hint = did_you_mean(str(token), [word])
        elif previous and previous[-1] != word and did_you_mean(previous[-1], [word]):
            start = before.rindex(previous[-1]) + 1
            return (f"expected `{word}` before {_found(token)}, found `{previous[-1]}`",
                    did_you_mean(previous[-1], [word]), [], where.span(span.line, start, len(previous[-1])))
        return f"expected `{word}` here, found {_found(token)}", hint, []
    return make


def _missing_pattern(token, accepts, where, span):
    return (f"`of` takes quoted module path patterns, found {_found(token)}",
            'write e.g. `shard columns of "blocks.*.attn.q", "blocks.*.attn.k" over tp`', [])


def _missing_expression(token, accepts, where, span):
    return (f"expected a value here, found {_found(token)}",
            "write a number, a name, or an expression such as `p - 1`", [])


def _bad_range(token, accepts, where, span):
    return (f"a `for` loop needs a range `START..END`, found {_found(token)}",
            "write `for i in 0..n:`, which runs i = 0, 1, ..., n-1", [])


def _missing_separator(token, accepts, where, span):
    if "SEMICOLON" in accepts:
        return (f"expected `;` between slots, found {_found(token)}",
                "`a; b` runs a then b; `[a, b]` is one slot whose items may overlap", [])
    return f"expected `,` before {_found(token)}", "separate the items of a list with `,`", []


def _bad_import(token, accepts, where, span):
    return (f"`import` takes a quoted path, found {_found(token)}",
            "write `import \"common.pps\"`; a standard-library strategy needs no import: `use zero3()`", [])


def _misplaced(token, accepts, where, span):
    word = str(token)
    if token.type == "ELSE":
        return ("`else` without an `if` before it",
                "put `else:` right after the `if` block, at the same indentation as `if`", [])
    if token.type in ("MESH", "IMPORT", "STRATEGY"):
        return (f"`{word}` may only appear at the top level of a script, not inside a block",
                f"move the `{word}` line to the top of the file, unindented", [])
    if "LSQB" in accepts or "NAME" in accepts:
        return (f"`{word}` cannot appear inside an `order` block",
                "an order block holds slots such as `F(MB=0); B(MB=0)`, with `for`, `if` and `let`; "
                f"move the `{word}` above the `order`", [])
    return (f"`{word}` cannot follow `:` on the same line",
            f"start a new, indented line for the `{word}` block", [])


def _unknown_statement(token, accepts, where, span):
    words = [k.lower() for k in accepts & _STATEMENT_WORDS]
    rest = where.line(span.line)[span.end_column - 1:].lstrip()
    if rest.startswith("=") and not rest.startswith("=="):
        hint = f"bind a name with `let`: `let {token} {rest.split('#', 1)[0].strip()}`"
    else:
        hint = did_you_mean(str(token), words) or ("a statement starts with one of: " + ", ".join(sorted(words)))
    return f"`{token}` does not start a statement", hint, []


_MESSAGES = {
    "missing-colon": _missing_colon,
    "unclosed-bracket": _unclosed,
    "unexpected-token-in-selector": _selector,
    "missing-into": _keyword_missing("into", "split MB into 8"),
    "missing-over": _keyword_missing("over", "shard batch over dp"),
    "missing-of": _keyword_missing("of", 'shard columns of "blocks.*.attn.q" over tp'),
    "missing-pattern": _missing_pattern,
    "missing-on": _keyword_missing("on", "place PP=0 on pp[0]"),
    "missing-expression": _missing_expression,
    "bad-range": _bad_range,
    "missing-separator": _missing_separator,
    "bad-import": _bad_import,
    "misplaced-statement": _misplaced,
    "unknown-statement": _unknown_statement,
}
