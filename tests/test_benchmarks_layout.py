"""The benchmarks' rooms (benchmarks/__init__.py): `harness/` below `baselines/` below `suites/`, one
suite per file, no suite function over 80 lines. Read with `ast`, as a reader would; nothing is run.
"""
from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.harness.runner import SUITES

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
LONGEST = 80          # lines in one function of a suite file: longer ones split into named helpers
ROOMS = {"harness": 0, "baselines": 1, "suites": 2}


def _imported(path: Path) -> set[str]:
    """The modules under `benchmarks` that `path` imports (module level and inside functions), dotted
    from `benchmarks`: `harness.workloads`, `tune_accuracy` (and each imported name after its module,
    which may be a module too)."""
    package = path.relative_to(BENCHMARKS).parent.parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - (node.level - 1)])
            elif (node.module or "").split(".")[0] == "benchmarks":
                base = []
            else:
                continue
            module = [p for p in (node.module or "").split(".") if p]
            if module[:1] == ["benchmarks"] and not node.level:
                module = module[1:]
            if module:
                out.add(".".join(base + module))
            # a name imported from a package may be a module of it (`from ..harness import probes`)
            out.update(".".join(base + module + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".", 1)[1] for a in node.names
                       if a.name.startswith("benchmarks.") and "." in a.name)
    return out


def _files(room: str) -> list[Path]:
    return sorted((BENCHMARKS / room).glob("*.py"))


def test_each_room_imports_only_the_rooms_below_it():
    # The runner loads suites by name (importlib), not by an import a reader sees.
    wrong = []
    for room, level in ROOMS.items():
        for path in _files(room):
            for module in _imported(path):
                target = module.split(".")[0]
                if target in ROOMS and ROOMS[target] > level:
                    wrong.append(f"{path.relative_to(BENCHMARKS)} imports {module}")
                elif room == "suites" and target == "suites" and module != "suites":
                    wrong.append(f"{path.relative_to(BENCHMARKS)} imports another suite, {module}")
    assert wrong == []


def test_one_suite_per_file():
    files = {p.stem for p in _files("suites")} - {"__init__"}
    assert sorted(s.module for s in SUITES) == sorted(files)
    for s in SUITES:
        assert s.module == s.name.replace("-", "_"), f"suite {s.name} lives in suites/{s.module}.py"


def test_no_suite_function_is_longer_than_80_lines():
    long = [f"suites/{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in _files("suites") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST]
    assert long == []


def test_the_import_reader_sees_imports():
    # The reader itself: a suite's relative imports come back dotted from `benchmarks`.
    seen = _imported(BENCHMARKS / "suites" / "tune.py")
    assert {"harness.machine", "harness.results", "tune_accuracy"} <= seen
    assert "harness.probes" in _imported(BENCHMARKS / "suites" / "memory.py")      # `from ..harness import probes`
