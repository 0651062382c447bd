"""The `piper` command: exit codes, output formats, and the hand-off to analysis and running."""
import json
import sys
import types
from pathlib import Path

import pytest

from piper.cli import main
from piper.diagnostics import Diagnostic, Span

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def script(tmp_path):
    def write(text: str, name: str = "job.pps") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write


def test_clean_files_exit_0(capsys):
    files = [str(p) for p in sorted(FIXTURES.glob("*.pps"))]
    assert main(["check", *files]) == 0
    out = capsys.readouterr()
    # one_f_one_b.pps declares no mesh: its plans cannot be checked, and a note says so.
    assert out.out.count("note[analysis-unavailable]") == 1 and "declares no mesh" in out.out
    assert "all checks passed (3 files); 1 note on what was not checked" in out.err


def test_problems_exit_1_with_file_line_col(script, capsys):
    path = script("mesh dp=2, pp=4\nplace PP=0 on ppp[0]\n")
    assert main(["check", path, "--format", "text"]) == 1
    out = capsys.readouterr()
    assert out.out.startswith(f"{path}:2:15: error[unknown-axis]: the mesh has no axis `ppp`\n")
    assert "1 error in 1 file" in out.err


def test_warnings_alone_exit_1(script, capsys):
    assert main(["check", script("let unused = 1\n"), "--format", "concise"]) == 1
    assert capsys.readouterr().out.endswith(":1:5: warning[unused-let]: `unused` is never used\n")


def test_json_fields(script, capsys):
    path = script("mesh pp=2\nuse one_f_one_b() on pp\n")
    assert main(["check", path, "--format", "json"]) == 1
    (item,) = json.loads(capsys.readouterr().out)
    assert {k: item[k] for k in ("code", "severity", "file", "line", "column", "end_line", "end_column")} == \
        {"code": "missing-parameter", "severity": "error", "file": path, "line": 2, "column": 1, "end_line": 2,
         "end_column": 24}
    assert item["message"] == "strategy `one_f_one_b` needs `microbatches`"
    assert item["hint"].startswith("give it") and item["notes"] == [] and item["trace"] == []
    (label,) = item["labels"]
    assert label["file"].endswith("one_f_one_b.pps") and label["message"] == "`one_f_one_b` is defined here"


def test_every_syntax_error_in_a_file(script, capsys):
    path = script("mesh pp=2\nsplit MB 8\nshard batch dp\nplace PP=0 pp[0]\n")
    assert main(["check", path, "--format", "concise"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1].split("]")[0] for line in lines] == \
        ["error[missing-into", "error[missing-over", "error[missing-on"]


def test_mesh_and_set_flags(script, capsys):
    path = script("let mb = 4\nuse one_f_one_b(microbatches=mb) on pp\n")
    assert main(["check", path, "--mesh", "pp=2", "--set", "mb=0"]) == 1
    assert "value-out-of-range" in capsys.readouterr().out
    assert main(["check", path, "--mesh", "pp=2", "--set", "mbb=3", "--format", "json"]) == 1
    (item,) = json.loads(capsys.readouterr().out)
    assert item["code"] == "unknown-parameter" and item["hint"] == "did you mean `mb`?" and item["line"] is None


@pytest.mark.parametrize("argv", [["check"], ["check", "x.pps", "--format", "xml"], ["nope"],
                                  ["check", "{path}", "--set", "novalue"], ["check", "{path}", "--mesh", "dp=x"],
                                  ["check", "{path}", "--regions", "PP"], ["check", "missing.pps"]])
def test_usage_errors_exit_2(argv, script, capsys):
    path = script("split MB into 2\n")
    assert main([a.replace("{path}", path) for a in argv]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "check" in capsys.readouterr().out


def test_model_checks_without_analysis(script, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "piper.compiler.analysis", None)  # as if the module were missing
    assert main(["check", script("mesh pp=2\nplace PP=0 on pp[0]\n"), "--regions", "PP=2"]) == 0
    assert "note[analysis-unavailable]" in capsys.readouterr().out


def test_model_checks_call_analysis(script, capsys, monkeypatch):
    calls = []

    def analyze(script_, *, mesh, model_spec, regions):
        calls.append((script_.file, str(mesh), model_spec, regions))
        span = Span(script_.file, 2, 1, 2, 6, script_.module.source)
        return [Diagnostic("deadlock", "device 0 waits for itself", span=span)]

    monkeypatch.setitem(sys.modules, "piper.compiler.analysis", types.SimpleNamespace(analyze=analyze))
    path = script("mesh pp=2\nplace PP=0 on pp[0]\n")
    assert main(["check", path, "--regions", "PP=2,EP=4", "--model", "m.py:Net"]) == 1
    assert calls == [(path, "pp=2", "m.py:Net", {"PP": 2, "EP": 4})]
    assert "error[deadlock]: device 0 waits for itself" in capsys.readouterr().out


def test_internal_errors_are_one_line(script, capsys, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("piper.dsl.script.check_and_build", boom)
    assert main(["check", script("split MB into 2\n")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal-error" in err and "RuntimeError: boom" in err


def test_run_dispatches_to_cli_run(script, monkeypatch):
    seen = {}

    def run(args):
        seen.update(script=args.script, steps=args.steps, overrides=args.overrides, model=args.model)
        return 0

    monkeypatch.setitem(sys.modules, "piper.cli_run", types.SimpleNamespace(run=run))
    path = script("split MB into 2\n")
    assert main(["run", path, "--model", "m.py:Net", "--set", "mb=4", "--steps", "3"]) == 0
    assert seen == {"script": path, "steps": 3, "overrides": {"mb": "4"}, "model": "m.py:Net"}


def test_run_without_cli_run(script, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "piper.cli_run", None)
    assert main(["run", script("split MB into 2\n")]) == 2
    assert "not available" in capsys.readouterr().err


def test_rich_output_is_coloured(script, capsys):
    assert main(["check", script("let x = 1\n"), "--format", "rich"]) == 1
    out = capsys.readouterr().out
    assert "\x1b[" in out and "unused-let" in out
