"""Golden tests: what `piper check` prints for each diagnostic code, compared exactly.

Each tests/dsl/golden/CODE.pps is a tiny bad script; CODE.txt is its plain-text
output. A first line `# args: ...` adds flags to `piper check`; with
`# args: --regions PP=2` the script is also compiled against an abstract chain
of two regions (on the script's mesh, or `--mesh`), which is how the compiler's
codes (placed-twice, deadlock, ...) get their goldens. Regenerate with
    .venv/bin/python -m pytest tests/dsl --update-golden
"""
import json
import re
import shlex
from pathlib import Path

import pytest

from piper.cli import main

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
CASES = sorted(p.stem for p in GOLDEN.glob("*.pps"))


def flags(name: str) -> list[str]:
    first = (GOLDEN / f"{name}.pps").read_text().split("\n", 1)[0]
    return shlex.split(first[len("# args:"):]) if first.startswith("# args:") else []


def run_check(name: str, capsys, fmt: str = "text") -> tuple[int, str]:
    code = main(["check", "--format", fmt, f"golden/{name}.pps", *flags(name)])
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


# ---- the compiler's codes, checked against an abstract chain of regions

# The statement each code points at: the span's text starts with this keyword, or is an order item.
STATEMENT = {
    "unknown-region": "place", "placed-twice": "place", "undivided-work": "place", "batch-not-covered": "place",
    "split-twice": "split", "order-before-split": "split",
    "sharded-twice": "shard", "shard-without-batch": "shard", "incomplete-zero": "shard",
    "unsupported-sharding": "shard",
    "order-across-devices": "order", "order-cycle": "order", "deadlock": "order",
    "bad-order-item": "item", "unknown-node": "item", "ordered-twice": "item",
}
# A region that no statement mentions has no statement to point at.
NO_SPAN = {"unplaced-region"}
REGION_CASES = [name for name in CASES if "--regions" in flags(name)]
ITEM = re.compile(r"(F|B|BI|BW|UPD)\b")


def test_the_compiler_codes_have_goldens():
    assert set(STATEMENT) | NO_SPAN <= set(REGION_CASES)


def _text(lines: list[str], where: dict) -> str:
    """The text a span covers (to the end of its first line), after checking it lies in `lines`."""
    assert 1 <= where["line"] <= where["end_line"] <= len(lines), where
    line = lines[where["line"] - 1]
    end = where["end_column"] - 1 if where["end_line"] == where["line"] else len(line)
    assert 1 <= where["column"] <= end + 1 <= len(line) + 1, where
    return line[where["column"] - 1:end]


@pytest.mark.parametrize("name", REGION_CASES)
def test_compiler_codes_point_at_the_statement(name, capsys, monkeypatch):
    """Every diagnostic's span (and label) lies in the script, on the statement that caused it."""
    monkeypatch.chdir(HERE)
    lines = (GOLDEN / f"{name}.pps").read_text().splitlines()
    _, out = run_check(name, capsys, "json")
    found = json.loads(out)
    assert [d["code"] for d in found] == [name]
    for d in found:
        if d["code"] in NO_SPAN:
            assert d.get("file") is None and d["labels"] == []
            continue
        assert d["file"] == f"golden/{name}.pps"
        text = _text(lines, d)
        kind = STATEMENT[d["code"]]
        assert ITEM.match(text) if kind == "item" else text.startswith(kind + " "), (d["code"], text)
        for label in d["labels"]:
            assert label["file"] == d["file"]
            _text(lines, label)


# ---- other things a user reads: golden/cases/NAME.pps (any name; a `# args:` line as above)

USER_CASES = sorted(p.stem for p in (GOLDEN / "cases").glob("*.pps"))


@pytest.mark.parametrize("name", USER_CASES)
def test_golden_case(name, capsys, monkeypatch, update_golden):
    monkeypatch.chdir(HERE)
    first = (GOLDEN / "cases" / f"{name}.pps").read_text().split("\n", 1)[0]
    args = shlex.split(first[len("# args:"):]) if first.startswith("# args:") else []
    main(["check", "--format", "text", f"golden/cases/{name}.pps", *[a.replace("cases/", "golden/cases/", 1)
                                                                      for a in args]])
    out = capsys.readouterr().out
    expected_file = GOLDEN / "cases" / f"{name}.txt"
    if update_golden:
        expected_file.write_text(out)
    assert out == expected_file.read_text()


def test_shard_over_an_axis_of_size_one_warns(tmp_path, capsys):
    path = tmp_path / "job.pps"
    path.write_text("mesh dp=1, pp=2\nshard batch over dp\nplace PP=0 on pp[0]\nplace PP=1 on pp[1]\n")
    main(["check", "--format", "concise", str(path), "--regions", "PP=2"])
    out = capsys.readouterr().out
    assert "warning[shard-size-one]" in out and "error" not in out
