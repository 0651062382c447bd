"""Every command the README and docs/ show, and every link between the pages, holds as written.

A command is a line of a ```bash block, or an inline `code` span that is a whole command (no
placeholder such as SCRIPT, N or `[--flag]`). Each is run in one of three ways, by what it costs:
- `piper check/show/simulate/explain/import/export`: run in-process, exit 0.
- `piper run SCRIPT --model M ...`: its script and model are checked together (`piper check --model`);
  a training run takes a minute, so the run itself is left to the trainer's own tests.
- `python examples/X.py ...` and `python -m benchmarks...`: run in a process from the repository root
  with `--help` appended, so an import error (a module path the example cannot find), a missing file
  or a flag the program lacks fails here; training or benchmarking as written takes minutes to an hour,
  which is why these do not run in the default suite (`PIPER_FULL=1` runs the examples as written).
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from piper.cli import main

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`((?:\.venv/bin/)?python3? (?:-m benchmarks|examples/)[^`]*|piper [a-z]+ [^`]+)`")
PLACEHOLDER = re.compile(r"\.\.\.|[\[\]|<>]|(?<![\w.:/-])[A-Z][A-Z_.]*(?![\w.:/-])")
IN_PROCESS = {"check", "show", "simulate", "explain", "import", "export"}


def _split_prose(text: str) -> tuple[list[str], str]:
    """(the lines of every ```bash block, the prose outside every fenced block)."""
    lines = [line for kind, body in FENCE.findall(text) if kind == "bash" for line in body.splitlines()]
    return lines, FENCE.sub("", text)


def _files(argv) -> list[str]:
    """The files a command names (scripts, model files, programs, schedules)."""
    return [a.split(":")[0] for a in argv[1:] if re.search(r"\.(pps|py|json|csv)(:\w+)?$", a)]


def commands():
    seen = set()
    for page in PAGES:
        lines, prose = _split_prose(page.read_text(encoding="utf-8"))
        found = [line.split("  #")[0].strip() for line in lines] + INLINE.findall(prose)
        for command in (" ".join(c.split()) for c in found):
            if not command or PLACEHOLDER.search(command) or "&&" in command:
                continue                # a synopsis, or the install line tests/test_docs_facts.py holds
            argv = shlex.split(command)
            if argv[0] not in ("piper", "python", "python3", ".venv/bin/python") or argv[1:3] == ["-m", "pytest"]:
                continue                # another program's command (`ray start`), or the suite itself
            if argv[0] == "piper" and argv[1] != "explain" and not _files(argv):
                continue                # `piper run --resume`: a flag named in a sentence
            if not all((REPO / f).is_file() for f in _files(argv)):
                continue                # the reader's own files (`piper run my.pps ...`)
            if (page.name, command) not in seen:
                seen.add((page.name, command))
                yield pytest.param(argv, id=f"{page.relative_to(REPO)}:{command[:60]}")


COMMANDS = list(commands())


def test_the_pages_show_commands_of_every_kind():
    kinds = {argv[1] if argv[0] == "piper" else argv[1] if argv[1] == "-m" else "example"
             for argv in (p.values[0] for p in COMMANDS)}
    assert {"check", "run", "-m", "example"} <= kinds, kinds


@pytest.mark.parametrize("argv", COMMANDS)
def test_each_command_in_the_pages_works(argv, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO)
    if argv[0] == "piper" and argv[1] in IN_PROCESS:
        if argv[1] in ("import", "export") and "-o" in argv:     # write into the test's folder
            argv = [*argv[:argv.index("-o") + 1], str(tmp_path / Path(argv[argv.index("-o") + 1]).name)]
        assert main(argv[1:]) == 0, capsys.readouterr()
    elif argv[0] == "piper":                                      # piper run SCRIPT --model M ...
        script = next(a for a in argv[2:] if a.endswith(".pps"))
        model = argv[argv.index("--model") + 1]
        assert main(["check", script, "--model", model]) == 0, capsys.readouterr()
    else:
        full = bool(os.environ.get("PIPER_FULL")) and "examples/" in " ".join(argv)
        args = argv[1:] if full else [*argv[1:], "--help"]
        done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=3600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


# Links: [text](target) outside code, relative targets resolved from the page's folder, and a
# `#fragment` one of the target page's headings as GitHub spells its anchors.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    prose = FENCE.sub("", page.read_text(encoding="utf-8"))
    heads = re.findall(r"^#{1,6} (.+)$", prose, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def links():
    for page in [*PAGES, *sorted((REPO / "docs" / "codes").glob("*.md"))]:
        prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text(encoding="utf-8")))
        for match in LINK.finditer(prose):
            target = match.group(1) or match.group(2)
            if not re.match(r"[a-z]+:", target):
                yield pytest.param(page, target, id=f"{page.relative_to(REPO)}->{target}")


@pytest.mark.parametrize("page,target", list(links()))
def test_each_link_between_the_pages_resolves(page, target):
    path, _, fragment = target.partition("#")
    goal = (page.parent / path).resolve() if path else page
    assert goal.exists(), f"{page.relative_to(REPO)} links to {target}, which does not exist"
    if fragment:
        assert fragment in _anchors(goal), f"{page.relative_to(REPO)} links to #{fragment}, no such heading in {goal.name}"
