"""Every diagnostic code Piper can raise has a page, and `piper explain CODE` prints it.

tests/dsl/test_codes.py holds the language's sources to this; here the scan
covers everything that makes diagnostics: piper/, piper/runtime/ and dsl/.
A code is whatever string literal is the first argument of `error(...)`,
`Diagnostic(...)`, `fail(...)` or `_note(...)`, a code a syntax error is
classified as, or an `error[CODE]` printed directly.
"""
import ast
import re
from pathlib import Path

import pytest

from piper.cli import main
from piper.dsl import codes
from piper.dsl.codes import CODES, docs_dir, page
from piper.dsl.syntax_errors import EXAMPLES

ROOT = Path(__file__).parents[1]
SOURCES = sorted(p for folder in ("piper", "dsl") for p in (ROOT / folder).rglob("*.py"))
MAKERS = {"error", "Diagnostic", "fail", "_note"}
CODE = re.compile(r"[a-z]+(?:-[a-z]+)*\Z")
PRINTED = re.compile(r"(?:error|warning|note)\[([a-z]+(?:-[a-z]+)*)\]")
# Functions that pass a code on rather than name one; each is called with literals elsewhere.
# (Copying a diagnostic, `Diagnostic(d.code, ...)`, names no new code and is not counted.)
FORWARDERS = {
    ("piper/diagnostics.py", "error"),        # error(code, ...) -> Diagnostic(code, ...)
    ("piper/cli.py", "_note"),                # _note(code, ...) -> Diagnostic(code, ...)
    ("dsl/outcomes.py", "fail"),              # self.fail(code, ...) -> Diagnostic(code, ...)
    ("dsl/syntax_errors.py", "_token"),       # code = match(...) or _rule_of_thumb(...): EXAMPLES' keys
    ("piper/user_files.py", "diagnostic"),    # Refused(code, ...).diagnostic(...) -> error(code, ...)
}


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def scan(path: Path) -> tuple[set[str], set[tuple[str, str]]]:
    """(codes named in `path`, (file, function) of each maker called with a code that is not a literal)."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    indirect: set[tuple[str, str]] = set()

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and _name(node.func) in MAKERS:
            first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "code"), None)
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and CODE.match(first.value):
                found.add(first.value)
            elif first is not None and not (isinstance(first, ast.Attribute) and first.attr == "code"):
                indirect.add((rel, function))
        if (rel == "dsl/syntax_errors.py" and isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str) and CODE.match(node.value.value)):
            found.add(node.value.value)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(PRINTED.findall(node.value))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found, indirect


def raised_codes() -> set[str]:
    out = set(EXAMPLES)
    for path in SOURCES:
        out |= scan(path)[0]
    return out


RAISED = sorted(raised_codes())


def test_the_scan_reaches_every_layer():
    # One code from each place diagnostics are made, so a broken scan cannot pass quietly.
    assert {"missing-colon", "unknown-name", "internal-error", "analysis-unavailable", "bad-mesh", "unknown-region",
            "unplaced-region", "order-cycle", "deadlock", "graph-break", "model-not-found", "worker-died",
            "bad-schedule-csv", "bad-ir"} <= set(RAISED)


def test_codes_are_named_where_diagnostics_are_made():
    indirect = set().union(*(scan(path)[1] for path in SOURCES))
    assert indirect <= FORWARDERS, "name the code as a string literal, so this scan (and a reader) can find it"


def test_every_registered_code_is_raised_somewhere():
    assert set(CODES) - set(RAISED) == set(), "a code nothing raises any more: drop it and its page"


def test_every_page_is_a_registered_code():
    pages = {p.name[:-3] for p in docs_dir().iterdir() if p.name.endswith(".md")}
    assert pages - set(CODES) == set()


@pytest.mark.parametrize("code", RAISED)
def test_code_has_a_page_that_explain_prints(code, capsys):
    assert code in CODES, f"register `{code}` in dsl/codes.py"
    path = docs_dir() / f"{code}.md"
    assert path.is_file(), f"write docs/codes/{code}.md"
    text = path.read_text(encoding="utf-8")
    assert text.startswith(f"# {code}\n\n*") and "## Example" in text and "## Fix" in text
    assert main(["explain", code]) == 0
    assert capsys.readouterr().out == text


# ---- the pages' own examples, for the codes the compiler finds against an abstract chain of regions

_CHECK = re.compile(r"## (Example|Fix)\n\n```pps\n# piper check \S+ (--regions [^\n]*)\n(.*?)```", re.S)


def _examples():
    for code in sorted(CODES):
        text = (docs_dir() / f"{code}.md").read_text(encoding="utf-8")
        for kind, flags, script in _CHECK.findall(text):
            if not script.strip():
                continue          # a command line alone, e.g. analysis-unavailable's
            yield pytest.param(code, kind, flags.split(), script, id=f"{code}-{kind.lower()}")


@pytest.mark.parametrize("code, kind, flags, script", list(_examples()))
def test_page_examples_do_what_they_say(code, kind, flags, script, tmp_path, capsys):
    """A page whose example opens with `# piper check job.pps --regions ...` gets that code; its fix checks clean."""
    path = tmp_path / "job.pps"
    path.write_text(script)
    status = main(["check", "--format", "concise", str(path), *flags])
    out = capsys.readouterr().out
    if kind == "Example":
        assert f"[{code}]" in out and status == 1
    else:
        assert status == 0, out


# ---- installed pages


def test_pages_come_from_the_installed_package_first(tmp_path, monkeypatch):
    (tmp_path / "codes").mkdir()
    (tmp_path / "codes" / "deadlock.md").write_text("# deadlock\n\ninstalled\n")
    monkeypatch.setattr(codes.resources, "files", lambda package: tmp_path if package == "piper.docs" else None)
    assert docs_dir() == tmp_path / "codes"
    assert page("deadlock") == "# deadlock\n\ninstalled\n"


def test_pages_fall_back_to_the_source_tree(monkeypatch):
    def missing(package):
        raise ModuleNotFoundError(package)

    monkeypatch.setattr(codes.resources, "files", missing)
    assert docs_dir() == ROOT / "docs" / "codes"
    assert page("deadlock") == (ROOT / "docs" / "codes" / "deadlock.md").read_text(encoding="utf-8")


def test_the_package_ships_the_pages():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '"piper.docs" = "docs"' in text and '"piper.docs" = ["codes/*.md"]' in text
    assert '"piper.docs"' in re.search(r"packages = \[(.*?)\]", text).group(1)
    assert (ROOT / "docs" / "__init__.py").is_file()
