"""The lark parser for the language and its indenter: text -> lark tree, raising lark's errors or `BadDedent`.

    tree = raw_parse("mesh dp=2\n")      # a lark Tree; `syntax.parse` turns it into `nodes`

Below both `syntax` (which converts the tree) and `syntax_errors` (which parses its examples to name errors).
"""
from __future__ import annotations

import functools
from importlib import resources

from lark import Lark, Token, Tree
from lark.indenter import Indenter

# Reserved: the lexer would read them as names where no keyword fits; the indenter retypes them.
KEYWORDS = frozenset({"mesh", "import", "strategy", "let", "split", "into", "place", "on", "shard", "of", "over",
                      "recompute", "use", "for", "in", "if", "else", "order", "and", "or", "not", "true", "false"})

class BadDedent(Exception):
    """A line dedents to a column no enclosing block starts at, or the first line is indented.

    Raised by the indenter, which has no parser state to give.
    """

    def __init__(self, line: int, column: int, *, first_line: bool = False):
        super().__init__(f"bad indentation at {line}:{column}")
        self.line = line
        self.column = column
        self.first_line = first_line



class _Indenter(Indenter):
    """Python-style blocks: emits _INDENT/_DEDENT after each _NL.

    Unlike lark's own, the tokens sit where the next line's code starts, and a
    dedent to an unknown level raises `BadDedent` with that position.
    """

    NL_type = "_NL"
    OPEN_PAREN_types: list = []
    CLOSE_PAREN_types: list = []
    INDENT_type = "_INDENT"
    DEDENT_type = "_DEDENT"
    tab_len = 8

    def handle_NL(self, token: Token):
        yield token
        if "\n" not in token:
            return
        indent_str = token.rsplit("\n", 1)[1]
        indent = indent_str.count(" ") + indent_str.count("\f") + indent_str.count("\t") * self.tab_len
        where = dict(start_pos=token.end_pos, line=token.end_line, column=token.end_column,
                     end_line=token.end_line, end_column=token.end_column, end_pos=token.end_pos)
        if indent > self.indent_level[-1]:
            self.indent_level.append(indent)
            yield Token(self.INDENT_type, indent_str, **where)
            return
        while indent < self.indent_level[-1]:
            self.indent_level.pop()
            yield Token(self.DEDENT_type, indent_str, **where)
        if indent != self.indent_level[-1]:
            raise BadDedent(token.end_line, token.end_column)

    def process(self, stream):
        """Also: reserve the keywords, and refuse an indented first line."""
        first = True
        for token in super().process(stream):
            if first and token.type != self.NL_type and token.column > 1:
                raise BadDedent(token.line, token.column, first_line=True)
            first = False
            if token.type == "NAME" and token in KEYWORDS:
                token = Token(token.upper(), str(token), token.start_pos, token.line, token.column,
                              token.end_line, token.end_column, token.end_pos)
            yield token


@functools.cache
def parser() -> Lark:
    """The LALR parser for the language, built once per process from the grammar and never read
    from disk: a table cache would be a file Piper runs (lark's cache is a pickle, unpickled
    before its hash is compared, so a file planted in the cache folder ran code on the next
    `piper check`). Measured on the 2-core development machine (Python 3.11, lark 1.3.1):
    building the tables takes 45 ms (median of 10, in-process), loading lark's pickle 5 ms and
    loading them as JSON data 13 ms before any validation; `piper check examples/gpt_zero3_1f1b.pps`
    takes 228 ms without a cache against 178 ms with the pickle (medians of 6). About 30 ms a
    check for JSON is not worth a validator of lark's private table format."""
    grammar = resources.files(__package__).joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", postlex=_Indenter(), propagate_positions=True,
                maybe_placeholders=False)


def raw_parse(text: str) -> Tree:
    """Parse `text` with lark; raises lark's errors (used by the error-example table)."""
    return parser().parse(text if text.endswith("\n") else text + "\n")
