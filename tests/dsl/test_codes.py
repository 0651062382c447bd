"""Every diagnostic code has a docs page whose fix checks clean, and every code emitted is registered."""
import re
from pathlib import Path

import pytest

from piper.cli import main
from piper.dsl import check_source
from piper.dsl.codes import CODES, docs_dir, page
from piper.dsl.syntax_errors import EXAMPLES

ROOT = Path(__file__).parents[2]
GOLDEN = Path(__file__).parent / "golden"
SOURCES = [*sorted((ROOT / "dsl").glob("*.py")), ROOT / "piper" / "cli.py", ROOT / "piper" / "render.py"]
_EMIT = re.compile(r'(?:Diagnostic|fail|_note)\(\s*"([a-z]+(?:-[a-z]+)*)"|return "([a-z]+(?:-[a-z]+)+)"')


def emitted_codes() -> set[str]:
    """Codes named where diagnostics are made, in the language's and the CLI's sources."""
    codes = set(EXAMPLES) | {"internal-error"}
    for source in SOURCES:
        for a, b in _EMIT.findall(source.read_text()):
            codes.add(a or b)
    return codes


def test_emitted_codes_are_registered():
    assert emitted_codes() - set(CODES) == set()


def test_golden_files_cover_the_language_codes():
    tested_elsewhere = {"ambiguous-strategy", "file-not-found", "analysis-unavailable", "internal-error",
                        "bad-mesh", "script-too-large"}  # script-too-large: tests/dsl/test_hardening.py
    golden = {p.stem for p in GOLDEN.glob("*.pps")}
    assert emitted_codes() - golden - tested_elsewhere == set()


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_code_has_a_page(code):
    path = docs_dir() / f"{code}.md"
    assert path.is_file(), f"write docs/codes/{code}.md"
    text = path.read_text()
    assert text.startswith(f"# {code}\n")
    assert "## Example" in text and "## Fix" in text
    assert page(code) == text


def _fix_block(text: str) -> str | None:
    match = re.search(r"## Fix\n\n```pps\n(.*?)```", text, re.S)
    return match.group(1) if match else None


@pytest.mark.parametrize("code", sorted(CODES))
def test_fixes_check_clean(code, monkeypatch):
    fix = _fix_block((docs_dir() / f"{code}.md").read_text())
    if fix is None:
        pytest.skip("the fix is Python or a command line")
    monkeypatch.chdir(GOLDEN.parent)
    problems = [d for d in check_source(fix, "golden/fix.pps") if d.severity in ("error", "warning")]
    assert problems == []


def test_explain_prints_the_page(capsys):
    assert main(["explain", "unknown-axis"]) == 0
    assert capsys.readouterr().out == (docs_dir() / "unknown-axis.md").read_text()


def test_explain_unknown_code_suggests(capsys):
    assert main(["explain", "unknown-axes"]) == 2
    assert "did you mean `unknown-axis`?" in capsys.readouterr().err


def test_explain_falls_back_to_the_summary(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("piper.dsl.codes.docs_dir", lambda: tmp_path)
    assert main(["explain", "loop-limit"]) == 0
    assert CODES["loop-limit"] in capsys.readouterr().out
