"""The README's and docs' code runs as written: every ```python block is executed, every
```pps block passes `piper check`, and the own-model page's file trains with `piper run`.

Blocks that start workers (`piper.compile(`) use the shared Ray cluster.
"""
import os
import re
import runpy
import shlex
from pathlib import Path

import pytest

from piper.cli import main

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def blocks(lang: str):
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for i, (kind, body) in enumerate(BLOCK.findall(text)):
            if kind == lang:
                trains = "piper.compile(" in body
                # The README's blocks always run; a docs page's training block repeats what its own
                # test file trains (test_checkpoint.py...), so it runs with PIPER_FULL=1.
                marks = [pytest.mark.ray] + ([pytest.mark.full] if page.name != "README.md" else []) if trains else []
                yield pytest.param(body, id=f"{page.relative_to(REPO)}#{i}", marks=marks)


def test_the_pages_exist_and_the_readme_links_them():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name in ("guide.md", "language.md", "plans.md", "own-model.md", "tensor_parallel.md"):
        assert (REPO / "docs" / name).is_file() and f"(docs/{name})" in readme


@pytest.mark.parametrize("code", list(blocks("python")))
def test_python_blocks_run(code, request, monkeypatch, tmp_path):
    """Each block runs and shows what it says: its own asserts, else the check of
    tests/doc_block_checks.py on its globals and what it printed."""
    import zlib

    from tests.doc_block_checks import checks_for

    checks = checks_for(code)
    assert checks or re.search(r"^\s*assert ", code, re.M), (
        "this block asserts nothing: add an assert of what it shows, or a check to tests/doc_block_checks.py")
    if "piper.compile(" in code:
        request.getfixturevalue("ray_cluster")
    monkeypatch.chdir(REPO)
    # A real module, TorchDynamo looks classes up in it, and one name per block: Dynamo keeps the
    # first module of a name, so a later block's globals (`F`) were looked up in an earlier one's.
    name = f"doc_block_{zlib.crc32(code.encode()):08x}"
    path = tmp_path / f"{name}.py"
    path.write_text(code, encoding="utf-8")
    printed = []

    def record(*args, sep=" ", end="\n", **kw):     # the block's own print calls, not piper's progress
        printed.extend(sep.join(map(str, args)).splitlines())
        print(*args, sep=sep, end=end, **kw)
    ns = runpy.run_path(str(path), init_globals={"print": record}, run_name=name)
    for check in checks:
        check(ns, printed)


@pytest.mark.parametrize("script", list(blocks("pps")))
def test_pps_blocks_check_clean(script, tmp_path, capsys):
    first = script.splitlines()[0]
    flags = shlex.split(first[len("# piper check "):])[1:] if first.startswith("# piper check ") else []
    path = tmp_path / "block.pps"
    path.write_text(script, encoding="utf-8")
    status = main(["check", "--format", "concise", str(path), *flags])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "error[" not in out and "warning[" not in out, out


def _own_model_files(tmp_path) -> tuple[Path, Path]:
    text = (REPO / "docs" / "own-model.md").read_text(encoding="utf-8")
    found = dict((body.splitlines()[0][2:].strip(), body) for kind, body in BLOCK.findall(text)
                 if kind in ("python", "pps") and body.startswith("# "))
    model, script = tmp_path / "my_model.py", tmp_path / "two_stages.pps"
    model.write_text(found["my_model.py"])
    script.write_text(found["two_stages.pps"])
    return model, script


def test_own_model_page_checks_against_its_model(tmp_path, capsys):
    model, script = _own_model_files(tmp_path)
    assert main(["check", str(script), "--model", f"{model}:make"]) == 0, capsys.readouterr().out


@pytest.mark.skipif(not os.environ.get("PIPER_FULL"), reason="a second piper run training (tests/test_run_trainer.py "
                    "trains one by default); runs with PIPER_FULL=1")
def test_own_model_page_trains_with_piper_run(ray_cluster, tmp_path, capsys):
    model, script = _own_model_files(tmp_path)
    saved = tmp_path / "trained.pt"
    assert main(["run", str(script), "--model", f"{model}:make", "--steps", "2", "--batch-size", "8",
                 "--device", "cpu", "--save", str(saved)]) == 0
    err = capsys.readouterr().err
    assert "samples/s" in err and "again and again" not in err and saved.is_file()
