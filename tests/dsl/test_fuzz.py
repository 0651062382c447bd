"""Fuzzing the checker: whatever the text, `check_source` returns diagnostics inside the file.

Three sources of bad scripts, 2,100 examples in all (about 15 s on two cores):
random token sequences from the language's vocabulary, random edits (delete,
insert, duplicate, swap characters and lines) of the fixture scripts, and
random text. Each example has a deadline, so a hang fails the test.
"""
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piper.diagnostics import Diagnostic
from piper.dsl import check_source

FIXTURES = Path(__file__).parent / "fixtures"
SCRIPTS = [(p.name, p.read_text()) for p in sorted(FIXTURES.glob("*.pps"))] + [
    ("inline.pps", "mesh dp=2, pp=2\nlet mb = 4\norder PP=0 EP=*: F(MB=0); [F(MB=1), B(MB=0)]; B(MB=1)\n"
                   "if mb > 2 and not false:\n    split MB into mb\nelse:\n    split B into BI, BW\n"
                   "use zero3() on dp\nuse one_f_one_b(microbatches=mb // 2 + 1) on pp\n"),
]
VOCABULARY = [
    "mesh", "import", "strategy", "let", "split", "into", "place", "on", "shard", "over", "use", "for",
    "in", "if", "else", "order", "and", "or", "not", "true", "false", "batch", "optimizer", "grads", "params",
    "MB", "B", "BI", "BW", "F", "UPD", "PP", "EP", "pp", "dp", "axis", "size", "min", "max", "s", "m",
    "microbatches", "zero3", "one_f_one_b", "0", "1", "2", "8", "1000000", "=", "==", "<", "+", "-", "*",
    "//", "%", "(", ")", "[", "]", ":", ";", ",", "..", '"a.pps"', '"""doc"""', "# c", "\n", "\n    ",
    "\n        ", "\t", "/", "$",
]
SETTINGS = dict(deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def assert_inside(diagnostics, text: str, file: str) -> None:
    """Every span of every diagnostic lies inside the text it points into."""
    assert isinstance(diagnostics, list)
    for d in diagnostics:
        assert isinstance(d, Diagnostic), d
        spans = [d.span, *(label.span for label in d.labels), *d.trace]
        for span in filter(None, spans):
            source = text if span.file == file else span.source
            assert source is not None, d
            lines = source.split("\n")
            assert 1 <= span.line <= span.end_line <= len(lines), (d, span)
            assert 1 <= span.column <= len(lines[span.line - 1]) + 1, (d, span)
            assert 1 <= span.end_column <= len(lines[span.end_line - 1]) + 2, (d, span)
            if span.line == span.end_line:
                assert span.column <= span.end_column, (d, span)


@pytest.mark.fuzz
@settings(max_examples=800, **SETTINGS)
@given(st.lists(st.sampled_from(VOCABULARY), max_size=40))
def test_token_soup(tokens):
    text = " ".join(tokens)
    assert_inside(check_source(text, "soup.pps"), text, "soup.pps")


@st.composite
def edited(draw):
    name, text = draw(st.sampled_from(SCRIPTS))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["delete", "insert", "duplicate", "swap", "swap-lines", "dup-line"]))
        i = draw(st.integers(0, max(len(text) - 1, 0)))
        if kind == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 8)):]
        elif kind == "insert":
            text = text[:i] + draw(st.sampled_from(VOCABULARY + list("(:)[]=;,. \n\t#\"'"))) + text[i:]
        elif kind == "duplicate":
            text = text[:i] + text[i:i + 4] + text[i:]
        elif kind == "swap" and len(text) > i + 1:
            text = text[:i] + text[i + 1] + text[i] + text[i + 2:]
        else:
            lines = text.split("\n")
            a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            if kind == "swap-lines":
                lines[a], lines[b] = lines[b], lines[a]
            else:
                lines.insert(b, lines[a])
            text = "\n".join(lines)
    return name, text


@pytest.mark.fuzz
@settings(max_examples=1000, **SETTINGS)
@given(edited())
def test_edited_scripts(case):
    name, text = case
    file = str(FIXTURES / f"edited_{name}")  # imports resolve next to the fixtures
    assert_inside(check_source(text, file), text, file)


@pytest.mark.fuzz
@settings(max_examples=300, **SETTINGS)
@given(st.text(max_size=80))
def test_random_text(text):
    assert_inside(check_source(text, "text.pps"), text, "text.pps")


@pytest.mark.fuzz
@settings(max_examples=100, **SETTINGS)
@given(edited(), st.sampled_from([None, "dp=2,pp=2", "pp=4", {"dp": 1}]))
def test_edited_scripts_on_a_mesh(case, mesh):
    name, text = case
    file = str(FIXTURES / f"edited_{name}")
    assert_inside(check_source(text, file, mesh=mesh, overrides={"microbatches": "3"}), text, file)
