"""Golden tests: what `piper check` prints for each diagnostic code, compared exactly.

Each tests/dsl/golden/CODE.pps is a tiny bad script; CODE.txt is its plain-text
output. A first line `# args: ...` adds flags. Regenerate with
    .venv/bin/python -m pytest tests/dsl --update-golden
"""
import shlex
from pathlib import Path

import pytest

from piper.cli import main

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
CASES = sorted(p.stem for p in GOLDEN.glob("*.pps"))


def run_check(name: str, capsys) -> tuple[int, str]:
    first = (GOLDEN / f"{name}.pps").read_text().split("\n", 1)[0]
    extra = shlex.split(first[len("# args:"):]) if first.startswith("# args:") else []
    code = main(["check", "--format", "text", f"golden/{name}.pps", *extra])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", CASES)
def test_golden(name, capsys, monkeypatch, update_golden):
    monkeypatch.chdir(HERE)
    code, out = run_check(name, capsys)
    expected_file = GOLDEN / f"{name}.txt"
    if update_golden:
        expected_file.write_text(out)
    assert code == 1, out
    assert f"[{name}]" in out, f"golden/{name}.pps should produce a `{name}` diagnostic"
    assert out == expected_file.read_text()
