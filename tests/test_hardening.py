"""Bad inputs get a clear answer: hostile text, odd files, big scripts, bad meshes, flags, schedules."""
import json
import os

import pytest

import piper.render as render_module
from piper.cli import main
from piper.diagnostics import Diagnostic, PiperError, Span
from piper.dsl import check_source, load_strategy
from piper.dsl.source import MAX_SAME_WARNING, MAX_SCRIPT_BYTES
from piper.mesh import Mesh
from piper.render import render

ESCAPES = "# \x1b]0;PWNED\x07\x1b[2J\n"


@pytest.fixture
def script(tmp_path):
    def write(text: str, name: str = "job.pps") -> str:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return str(path)
    return write


# ---- what a script holds never reaches the terminal raw

@pytest.mark.parametrize("fmt", ["text", "rich", "concise", "json"])
def test_control_characters_from_a_script_are_escaped(fmt, script, capsys):
    path = script(f"mesh dp=2\n{ESCAPES}shard batch over dpp  {ESCAPES}")
    assert main(["check", path, "--format", fmt]) == 1
    out = capsys.readouterr()
    for stream in (out.out, out.err):
        assert "\x07" not in stream and "\x1b]" not in stream and "\x1b[2J" not in stream
        if fmt != "rich":       # rich colours with escape sequences of its own
            assert "\x1b" not in stream
    if fmt == "json":
        (item,) = json.loads(out.out)
        assert item["code"] == "unknown-axis"
    elif fmt != "concise":
        assert "\\x1b]0;PWNED\\x07\\x1b[2J" in out.out   # shown, escaped, in the quoted line


def test_the_caret_stays_under_the_span_after_escaping():
    source = "mesh dp=2\n\x1b[2Jshard\n"
    lines = render([Diagnostic("x", "m", span=Span("a.pps", 2, 1, 2, 2, source))]).splitlines()
    assert lines[2:4] == ["2 | \\x1b[2Jshard", "  | ^^^^"]              # the escape, all 4 characters of it
    lines = render([Diagnostic("x", "m", span=Span("a.pps", 2, 5, 2, 10, source))]).splitlines()
    assert lines[3] == "  | " + " " * 7 + "^" * 5                      # under `shard`, past `\x1b[2J`


def test_bidi_overrides_get_a_warning_and_are_shown_escaped():
    text = "mesh dp=2\nshard batch over dp  # \u202e}ignored{\u2066\n"
    (d,) = check_source(text, "a.pps")
    assert (d.code, d.severity, d.span.line, d.span.column) == ("bidi-character", "warning", 2, 24)
    assert "U+202E RIGHT-TO-LEFT OVERRIDE" in d.message and "U+2066" in d.message
    shown = render([d], format="rich", color=False)
    assert "\u202e" not in shown and "\\u{202e}" in shown and "\\u{2066}" in shown


# ---- files that are not scripts

def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "pipe.pps"
    os.mkfifo(fifo)
    assert main(["check", str(fifo)]) == 2    # would block forever if it were opened for reading
    assert "pipe (FIFO), not a regular file" in capsys.readouterr().err
    with pytest.raises(PiperError, match="not a regular file"):
        load_strategy(fifo)


def test_a_link_to_dev_zero_and_a_folder_are_refused(tmp_path, capsys):
    (tmp_path / "zero.pps").symlink_to("/dev/zero")
    (tmp_path / "dir.pps").mkdir()
    assert main(["check", str(tmp_path / "zero.pps"), str(tmp_path / "dir.pps")]) == 2
    err = capsys.readouterr().err
    assert "a character device, not a regular file" in err and "a folder, not a regular file" in err


def test_a_file_name_with_an_escape_is_shown_escaped(tmp_path, capsys):
    assert main(["check", str(tmp_path / "x\x1b[2J.pps")]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "x\\x1b[2J.pps: no such file" in err


def test_imports_are_read_the_same_way(script, tmp_path):
    os.mkfifo(tmp_path / "lib.pps")
    (d,) = check_source('import "lib.pps"\n', str(tmp_path / "job.pps"))
    assert d.code == "import-not-found" and "pipe (FIFO)" in d.message


def test_a_nul_byte_in_an_import_is_a_bad_import(script):
    (d,) = check_source('import "a\x00b.pps"\n', script("") )
    assert d.code == "bad-import" and "control character" in d.message and "\\x00" in d.message
    assert "\x00" not in render([d])


def test_a_50_mb_script_is_refused_after_reading_none_of_it(tmp_path, capsys, monkeypatch):
    big = tmp_path / "big.pps"
    with open(big, "wb") as f:          # sparse: 50 MB on paper, nothing on disk
        f.truncate(50 * 1024 * 1024)
    opened = []
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a) or (_ for _ in ()).throw(AssertionError))
    assert main(["check", str(big), "--format", "concise"]) == 1
    assert opened == []                 # the size is known from stat: the file is never opened
    out = capsys.readouterr().out
    assert "error[script-too-large]" in out and "52,428,800 bytes" in out and f"{MAX_SCRIPT_BYTES:,}" in out


def test_a_file_that_grows_after_stat_is_read_only_to_the_limit(tmp_path, monkeypatch):
    from piper.dsl import source

    path = tmp_path / "grow.pps"
    path.write_text("let x = 1\n" * 100)
    with pytest.raises(source.SourceError) as err:
        source.read_source(path, limit=50)
    assert err.value.code == "script-too-large"


def test_a_byte_order_mark_is_not_part_of_the_script(tmp_path, capsys):
    path = tmp_path / "bom.pps"
    path.write_bytes(b"\xef\xbb\xbfmesh dp=2\nshard batch over dp\n")
    assert main(["check", str(path)]) == 0


def test_script_text_over_the_limit_is_refused_too():
    (d,) = check_source("let x = 1\n" * (MAX_SCRIPT_BYTES // 10 + 1), "gen.pps")
    assert d.code == "script-too-large"


# ---- many diagnostics: capped, and rendered in linear time

def test_repeated_warnings_are_capped_with_a_count():
    found = check_source("".join(f"let x{i} = {i}\n" for i in range(500)), "lets.pps")
    assert [d.code for d in found] == ["unused-let"] * MAX_SAME_WARNING
    assert found[-1].notes[-1] == f"{500 - MAX_SAME_WARNING} more `unused-let` warnings in this file are not shown"


def test_rendering_splits_the_source_once_however_many_diagnostics(monkeypatch):
    """Linear, counted rather than timed: 2,000 diagnostics into one 2,000-line source split it once."""
    source = "".join(f"let x{i} = {i}\n" for i in range(2000))
    spans = [Span("a.pps", i + 1, 5, i + 1, 7, source) for i in range(2000)]
    diagnostics = [Diagnostic("unused-let", "unused", "warning", s) for s in spans]
    splits = []
    real = render_module._split_source.__wrapped__
    render_module._split_source.cache_clear()
    monkeypatch.setattr(render_module, "_split_source",
                        render_module.functools.lru_cache(maxsize=8)(lambda s: splits.append(1) or real(s)))
    out = render(diagnostics)
    assert len(splits) == 1 and out.count("warning[unused-let]") == 2000


# ---- meshes

@pytest.mark.parametrize("value, says", [(2.7, "not a whole number"), (True, "not a number of devices"),
                                         (None, "not a number of devices"), ("0x2", "not a whole number"),
                                         (2.0, "a float"), ([2], "not a whole number")])
def test_mesh_sizes_that_are_not_whole_numbers_are_refused(value, says):
    with pytest.raises(PiperError) as err:
        Mesh.of({"pp": value})
    assert err.value.code == "bad-mesh" and says in str(err.value)


def test_good_mesh_sizes_still_read():
    assert Mesh.of({"dp": 2, "pp": "4"}).axes == (("dp", 2), ("pp", 4))
    with pytest.raises(PiperError, match="cannot read 5 as a mesh"):
        Mesh.of(5)


# ---- `piper check` on the regions a script names

DEADLOCK = """mesh pp=2
split MB into 2
place PP=0 on pp[0]
place PP=1 on pp[1]
order PP=0:
    F(MB=0); B(MB=0); F(MB=1); B(MB=1)
order PP=1:
    F(MB=1); B(MB=1); F(MB=0); B(MB=0)
"""


def test_check_without_model_finds_a_deadlock_among_the_regions_the_script_names(script, capsys):
    assert main(["check", script(DEADLOCK), "--format", "concise"]) == 1
    assert "error[deadlock]" in capsys.readouterr().out


def test_check_without_model_finds_an_order_cycle(script, capsys):
    text = "mesh pp=2\nsplit MB into 2\nplace PP=0 on pp[0]\nplace PP=1 on pp[1]\norder PP=0:\n" \
           "    B(MB=0); F(MB=0); F(MB=1); B(MB=1)\n"
    assert main(["check", script(text), "--format", "concise"]) == 1
    assert "error[order-cycle]" in capsys.readouterr().out


def test_check_says_what_it_could_not_check(script, capsys):
    assert main(["check", script("use one_f_one_b(microbatches=4) on pp\n")]) == 0
    out = capsys.readouterr()
    assert "note[analysis-unavailable]" in out.out and "not checked for deadlocks" in out.out
    assert "1 note on what was not checked" in out.err


def test_check_of_a_clean_pipeline_passes(script, capsys):
    assert main(["check", script("mesh dp=2, pp=2\nuse one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n")]) == 0
    assert "all checks passed (1 file)" in capsys.readouterr().err


def test_regions_with_two_tags_is_a_clear_error(script, capsys):
    path = script("mesh pp=2\nuse one_f_one_b(microbatches=2) on pp\n")
    assert main(["check", path, "--regions", "PP=2,EP=2", "--format", "concise"]) == 1
    out = capsys.readouterr().out
    assert "error[bad-flag]: --regions PP=2,EP=2 names 2 kinds of region" in out and "internal" not in out


def test_a_schedule_for_fewer_stages_than_the_model_names_the_use_line(script, capsys):
    path = script("mesh pp=2\nuse one_f_one_b(microbatches=2) on pp\n")
    assert main(["check", path, "--regions", "PP=4", "--format", "json"]) == 1
    (d,) = json.loads(capsys.readouterr().out)
    assert d["code"] == "unplaced-region" and (d["file"], d["line"]) == (path, 2)
    assert d["message"] == ("the strategy places 2 `PP` regions (`PP=0..1`), and the model has 4: "
                            "PP=2, PP=3 are never placed")
    assert d["labels"][0]["file"].endswith("one_f_one_b.pps")
    assert "pipeline axis 4 devices long" in d["hint"]


def test_a_schedule_for_more_stages_than_the_model_names_the_use_line(script, capsys):
    path = script("mesh pp=2\nuse interleaved_1f1b(microbatches=4, virtual=2) on pp\n")
    assert main(["check", path, "--regions", "PP=2", "--format", "json"]) == 1
    (d,) = json.loads(capsys.readouterr().out)
    assert d["code"] == "unknown-region" and (d["file"], d["line"]) == (path, 2)
    assert d["message"] == ("the strategy places 4 `PP` regions (`PP=0..3`), and the model has 2: "
                            "PP=2, PP=3 do not exist")
    assert main(["check", path, "--regions", "PP=4"]) == 0
