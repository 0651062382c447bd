"""Rendering: the same diagnostic as plain text, rich colour, or JSON."""
import io
import json

from piper.diagnostics import Diagnostic, Label, Span
from piper.render import print_diagnostics, render, summary

SOURCE = "mesh dp=2, pp=4\nstrategy s():\n\tplace PP=0 on ppp[0]\n"
OTHER = "strategy zero3(axis = dp):\n    shard batch over axis\n"


def span(line, column, end_column, source=SOURCE, file="a.pps", end_line=None):
    return Span(file, line, column, end_line or line, end_column, source)


def test_text_with_labels_notes_trace_and_hint():
    d = Diagnostic("unknown-axis", "the mesh has no axis `ppp`", span=span(3, 16, 19),
                   labels=(Label(span(1, 1, 16), "the mesh"), Label(span(1, 10, 15, OTHER, "z.pps"), "here")),
                   notes=("the mesh is dp=2, pp=4",), hint="did you mean `pp`?", trace=(span(2, 1, 11),))
    assert render([d]) == """\
a.pps:3:16: error[unknown-axis]: the mesh has no axis `ppp`
  |
3 |     place PP=0 on ppp[0]
  |                   ^^^
  |
1 | mesh dp=2, pp=4
  | --------------- the mesh
 ::: z.pps:1:10
  |
1 | strategy zero3(axis = dp):
  |          ----- here
  = note: the mesh is dp=2, pp=4
  = note: used from a.pps:2:1
  = hint: did you mean `pp`?
"""


def test_no_span_and_long_trace():
    site = span(2, 1, 11)
    d = Diagnostic("loop-limit", "too many steps", trace=tuple(site for _ in range(10)))
    out = render([d], format="text")
    assert out.startswith("error[loop-limit]: too many steps\n")
    assert out.count("used from") == 6 and "= note: ... 4 more" in out


def test_multi_line_span_underlines_to_the_end_of_its_first_line():
    out = render([Diagnostic("x", "m", span=span(2, 1, 3, end_line=3))])
    assert "2 | strategy s():\n  | ^^^^^^^^^^^^^\n" in out


def test_two_diagnostics_are_separated_by_a_blank_line_and_sorted_as_given():
    a = Diagnostic("unused-let", "a", "warning", span(1, 1, 2))
    b = Diagnostic("unused-let", "b", "warning", span(2, 1, 2))
    out = render([a, b])
    assert out.index("warning[unused-let]: a") < out.index("\n\na.pps:2:1: warning[unused-let]: b")
    assert render([a, b], format="concise") == "a.pps:1:1: warning[unused-let]: a\na.pps:2:1: warning[unused-let]: b\n"


def test_json():
    d = Diagnostic("unknown-axis", "m", span=span(3, 16, 19), labels=(Label(span(1, 1, 5), "l"),),
                   notes=("n",), hint="h", trace=(span(2, 1, 3),))
    (item,) = json.loads(render([d], format="json"))
    assert item == {"code": "unknown-axis", "severity": "error", "message": "m", "file": "a.pps", "line": 3,
                    "column": 16, "end_line": 3, "end_column": 19, "hint": "h", "notes": ["n"],
                    "labels": [{"file": "a.pps", "line": 1, "column": 1, "end_line": 1, "end_column": 5,
                                "message": "l"}],
                    "trace": [{"file": "a.pps", "line": 2, "column": 1, "end_line": 2, "end_column": 3}]}
    assert json.loads(render([], format="json")) == []


def test_rich_and_print_diagnostics():
    d = Diagnostic("unused-let", "m", "warning", span(1, 1, 5))
    assert "\x1b[" in render([d], format="rich")
    assert "\x1b[" not in render([d], format="rich", color=False)
    plain = io.StringIO()
    print_diagnostics([d], file=plain)
    assert plain.getvalue() == render([d])

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    print_diagnostics([d], file=terminal)
    assert "\x1b[" in terminal.getvalue()


def test_python_api_spans_read_the_file(tmp_path):
    path = tmp_path / "strategy.py"
    path.write_text("import piper\ns.shard('weights', over='dp')\n")
    d = Diagnostic("bad-shard", "cannot shard `weights`", span=Span(str(path), 2, 9, 2, 18))
    assert "2 | s.shard('weights', over='dp')\n  |         ^^^^^^^^^" in render([d])


def test_summary():
    assert summary([]) == "no problems"
    errors = [Diagnostic("a", "m"), Diagnostic("b", "m"), Diagnostic("c", "m", "warning")]
    assert summary(errors) == "2 errors, 1 warning"
