"""Parsing: spans on every node, named syntax errors, and every error in a file reported."""
import pytest

from piper.diagnostics import PiperError
from piper.dsl import nodes as n
from piper.dsl import parse
from piper.dsl.syntax import MAX_SYNTAX_ERRORS, parse_recovering
from piper.dsl.syntax_errors import EXAMPLES

from .util import codes


def text_of(span) -> str:
    lines = span.source.split("\n")
    if span.line == span.end_line:
        return lines[span.line - 1][span.column - 1:span.end_column - 1]
    return "\n".join([lines[span.line - 1][span.column - 1:], *lines[span.line:span.end_line - 1],
                      lines[span.end_line - 1][:span.end_column - 1]])


def test_every_node_knows_its_text():
    module = parse("mesh dp=2, pp=4\nstrategy s(mb: int, axis = pp):\n    for i in 0..size(axis) - 1:\n"
                   "        place PP=i EP=* on axis[i + 1]\n", file="s.pps")
    mesh, strategy = module.items
    assert text_of(mesh.span) == "mesh dp=2, pp=4"
    assert text_of(mesh.axes[1].span) == "pp=4"
    assert text_of(strategy.span) == "strategy s" and strategy.name.name == "s"
    assert [text_of(p.span) for p in strategy.params] == ["mb: int", "axis = pp"]
    (loop,) = strategy.body
    assert text_of(loop.span) == "for i in 0..size(axis) - 1"
    assert text_of(loop.stop.span) == "size(axis) - 1" and isinstance(loop.stop, n.Binary)
    (place,) = loop.body
    assert text_of(place.span) == "place PP=i EP=* on axis[i + 1]"
    assert [text_of(t.span) for t in place.selector.tags] == ["PP=i", "EP=*"]
    assert place.selector.tags[1].value is None
    assert text_of(place.index.span) == "i + 1" and place.span.file == "s.pps"


def test_precedence():
    (let,) = parse("let x = 1 + 2 * 3 - -4 // 2 < 5 and not 1 == 2 or true\n").items
    e = let.value
    assert e.op == "or" and e.left.op == "and" and e.left.right.op == "not"
    compare = e.left.left
    assert compare.op == "<" and compare.left.op == "-" and compare.left.left.right.op == "*"
    assert compare.left.right.op == "//" and compare.left.right.left.op == "-"


def test_comments_blank_lines_crlf_tabs_and_no_final_newline():
    text = "# top\r\n\r\nmesh pp=2  # trailing\r\nstrategy s():\r\n\t# inside\r\n\tsplit MB into 2\r\n\r\nuse s()"
    module = parse(text)
    assert [type(item) for item in module.items] == [n.Mesh, n.Strategy, n.Use]


def test_docstrings():
    (strategy,) = parse('strategy s():\n    """One line,\n    and another."""\n    split MB into 2\n').items
    assert strategy.doc == "One line,\n    and another." and len(strategy.body) == 1
    (strategy,) = parse('strategy s():\n    "Only a docstring."\n').items
    assert strategy.doc == "Only a docstring." and strategy.body == ()


def test_keywords_are_reserved():
    _, diagnostics = parse_recovering("let order = 3\n")
    assert diagnostics[0].hint == "`order` is a keyword and cannot be used as a name"


@pytest.mark.parametrize("code, example", [(code, ex) for code, examples in EXAMPLES.items() for ex in examples])
def test_each_example_gets_its_name(code, example):
    module, diagnostics = parse_recovering(example)
    assert module is None and diagnostics[0].code == code


@pytest.mark.parametrize("text, code, where", [
    ("for i in 0..3:\nlet x = 1\n", "bad-indent", (1, 15)),
    ("strategy s():\n    split MB into 2\n  split MB into 3\n", "bad-indent", (3, 3)),
    ("  split MB into 2\n", "bad-indent", (1, 3)),
    ("let x = 4 / 2\n", "unexpected-character", (1, 11)),
    ('import "a.pps\n', "unterminated-string", (1, 8)),
    ("let x = 1 ? 2\n", "unexpected-character", (1, 11)),
    ("use zero3 on dp\n", "syntax-error", (1, 11)),
    ("order PP=0: F(MB=0; B(MB=0)\n", "unclosed-bracket", (1, 19)),
])
def test_named_errors(text, code, where):
    _, diagnostics = parse_recovering(text, "x.pps")
    assert diagnostics[0].code == code
    assert (diagnostics[0].span.line, diagnostics[0].span.column) == where


def test_every_syntax_error_is_reported():
    text = "mesh pp=2\nsplit MB 8\nstrategy s(\n    place PP=0 on pp[0]\nshard batch dp\nlet = 3\n"
    _, diagnostics = parse_recovering(text)
    assert codes(diagnostics) == ["missing-into", "unclosed-bracket", "missing-over", "syntax-error"]
    with pytest.raises(PiperError) as err:
        parse(text)
    assert len(err.value.diagnostics) == 4


def test_recovery_stops_at_the_limit():
    _, diagnostics = parse_recovering("split MB 8\n" * 50)
    assert len(diagnostics) == MAX_SYNTAX_ERRORS


def test_deep_nesting_is_refused_not_crashed():
    for text in ["let x = " + "+".join(["1"] * 5000) + "\n", "let x = " + "-" * 3000 + "1\n",
                 "let x = " + "not " * 3000 + "true\n",
                 "".join("    " * i + "if true:\n" for i in range(150)) + "    " * 150 + "split MB into 1\n"]:
        _, diagnostics = parse_recovering(text)
        assert codes(diagnostics) == ["nesting-limit"]


def test_parenthesised_depth_is_fine():
    module = parse("let x = " + "(" * 300 + "1" + ")" * 300 + "\n")
    assert isinstance(module.items[0].value, n.Int)
