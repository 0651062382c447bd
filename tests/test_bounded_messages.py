"""Values a user passes (`--set`, `--mesh`, `--regions`, import paths) are quoted short in every message:
a 5,000-character value shows its start and its length (`piper.diagnostics.clip`), never the whole."""
from __future__ import annotations

import json

import pytest

from piper.cli import main
from piper.diagnostics import MAX_SHOWN, PiperError, clip, did_you_mean
from piper.dsl import load_strategy

SCRIPT = "mesh pp=2\nstrategy s(microbatches: int, axis = pp):\n    split MB into microbatches\n" \
         "    place PP=0 on axis[0]\nuse s(microbatches=4) on pp\n"
LONG = 5000


def test_clip_keeps_short_text_and_cuts_long_text_saying_its_length():
    assert clip("microbatches") == "microbatches"
    shown = clip("9" * LONG)
    assert shown == "9" * MAX_SHOWN + "... (5,000 characters)"
    assert did_you_mean("x" * LONG, ["x"]) is None      # no quadratic comparison of a huge word


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "s.pps"
    path.write_text(SCRIPT)
    return str(path)


def _check(capsys, *args) -> tuple[int, str]:
    rc = main(["check", *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("setting", [f"microbatches={'9' * LONG}",      # a number too long to be one
                                     f"axis={'b' * LONG}",              # an axis the mesh does not have
                                     f"{'c' * LONG}=1",                 # a name the script does not have
                                     "d" * LONG])                       # no `=` at all
def test_a_long_set_value_or_name_is_quoted_short(script, capsys, setting):
    rc, text = _check(capsys, script, "--set", setting)
    assert rc in (1, 2) and "Traceback" not in text and "internal-error" not in text
    assert "(5,000 characters)" in text and len(text) < 1500, text[:300]


def test_a_long_set_value_in_json_output_is_quoted_short(script, capsys):
    rc, text = _check(capsys, "--format", "json", script, "--set", f"microbatches={'9' * LONG}")
    found = json.loads(text)
    assert rc == 1 and found[0]["code"] == "wrong-type"
    assert len(found[0]["message"]) < 200 and "(5,000 characters)" in found[0]["message"]


def test_bind_with_a_long_word_is_a_short_wrong_type():
    with pytest.raises(PiperError) as err:
        load_strategy(SCRIPT).bind(microbatches="9" * LONG).build()
    message = err.value.diagnostics[0].message
    assert err.value.code == "wrong-type" and len(message) < 200 and "(5,000 characters)" in message


@pytest.mark.parametrize("flag,value", [("--mesh", f"{'q' * LONG}=2"), ("--regions", f"{'Q' * LONG}=2")])
def test_long_mesh_and_region_names_are_usage_errors_quoted_short(script, capsys, flag, value):
    rc, text = _check(capsys, script, flag, value)
    assert rc == 2 and len(text) < 400, text[:300]


def test_a_long_import_path_is_quoted_short(tmp_path, capsys):
    path = tmp_path / "i.pps"
    path.write_text(f'import "{"a" * 3000}.pps"\nmesh pp=1\n')
    rc, text = _check(capsys, "--format", "json", str(path))
    found = json.loads(text)
    assert rc == 1 and found[0]["code"] in ("import-not-found", "bad-import")
    assert len(found[0]["message"]) < 700 and "(3,004 characters)" in found[0]["message"], found[0]["message"][:300]


def test_a_long_name_in_a_script_is_quoted_short_and_its_line_shown_around_the_span(tmp_path, capsys):
    name = "z" * 60_000
    path = tmp_path / "long.pps"
    path.write_text(f"mesh pp=2\nuse {name}() on pp\nsplit {name} into 2\n")
    rc, text = _check(capsys, str(path))
    assert rc == 1 and "unknown-strategy" in text and "bad-split" in text
    assert "(60,000 characters)" in text and max(map(len, text.splitlines())) < 300, \
        max(map(len, text.splitlines()))
    rc, text = _check(capsys, "--format", "json", str(path))
    assert all(len(d["message"]) < 300 for d in json.loads(text))


def test_a_long_line_is_shown_as_a_window_with_its_mark_under_the_span():
    from piper.diagnostics import Diagnostic, Span
    from piper.render import MAX_LINE, render

    line = "let a = " + " + ".join(["1"] * 200) + " + qq"
    at = line.index("qq") + 1
    span = Span("w.pps", 1, at, 1, at + 2, source=line + "\n")
    shown = render([Diagnostic("unknown-name", "unknown name `qq`", span=span)], format="text", color=False)
    source, under = [x for x in shown.splitlines() if x.lstrip().startswith(("1 |", "|"))][1:3]
    assert len(source) < MAX_LINE + 20 and source.split("| ", 1)[1].startswith("...")
    column = under.index("^")
    assert source[column:column + 2] == "qq" and under.count("^") == 2
