"""Smoke test of the benchmark harness: a --quick run of the cheap suites completes
and writes a report with numbers. No timing assertions: this machine's speed is
not under test, only that the harness runs end to end."""
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import Table, fit_exponent, fmt
from benchmarks.runner import SUITES, markdown

REPO = Path(__file__).resolve().parent.parent


def run_harness(*args, timeout=480):
    """`python -m benchmarks ARGS` in its own session, so a hang can be stopped with everything it started."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"python -m benchmarks {' '.join(args)} did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def test_quick_run_of_cheap_suites_writes_numbers(tmp_path):
    report, metrics = tmp_path / "RESULTS.md", tmp_path / "metrics.json"
    code, out = run_harness("--suite", "compiler", "overhead", "cost-model", "--quick",
                            "--out", str(report), "--json", str(metrics))
    assert code == 0, out[-3000:]
    text = report.read_text()
    assert "## 6. `compiler`" in text and "## 7. `overhead`" in text
    assert "## 8. `cost-model`" in text and "Not implemented yet." in text
    assert "--suite compiler --quick" in text          # each suite says how to reproduce it
    assert "torch:" in text and "cores:" in text         # the machine header
    numbers = json.loads(metrics.read_text())
    compiler, overhead = numbers["compiler"], numbers["overhead"]
    assert any(k.endswith(".seconds") for k in compiler) and any(k.endswith(".nodes_per_s") for k in compiler)
    assert "dev1.rank0.us_per_action_end_to_end" in overhead
    assert "dev2.rank1.us_per_action_executor" in overhead
    for value in [*compiler.values(), *overhead.values()]:
        assert isinstance(value, (int, float)) and math.isfinite(value)
    assert numbers["cost-model"] == {}


def test_stub_suites_say_not_implemented():
    stubs = {s.name for s in SUITES if s.module is None}
    assert stubs == {"batch-composition", "overlap", "cost-model"}
    code, out = run_harness("--suite", "overlap", timeout=120)
    assert code == 0 and "not implemented yet" in out


def test_fit_exponent_and_formatting():
    assert fit_exponent([1, 10, 100], [2, 20, 200]) == pytest.approx(1.0)
    assert fit_exponent([1, 10, 100], [1, 100, 10000]) == pytest.approx(2.0)
    assert fit_exponent([5], [1]) is None
    assert fmt(None) == "—" and fmt(0.012345) == "0.0123" and fmt(123456.0) == "123,456" and fmt(3) == "3"
    t = Table("t", ["a", "b|c"])
    t.add(1.5, None)
    from benchmarks.harness import SuiteResult

    md = markdown([SuiteResult("x", 9, "X", "cmd", tables=[t])], command="cmd", started=__import__("datetime").datetime.now(),
                  info={"cores": "2"})
    assert "| a | b\\|c |" in md and "| 1.5 | — |" in md
