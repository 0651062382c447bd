"""A short run of the `piper check --model` fuzz (benchmarks/fuzz_model_check.py): meshes,
strategies and TP lines against examples/llama_tp.py's model, each checked in a worker under a
2 GiB address-space limit. Every case must end in diagnostics: no exception but the project's own,
no MemoryError, no worker lost. The time bounds only detect hangs (60 s of CPU a case); the
benchmark run holds cases to 5 s."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_model_check import PLAN, ModelWorker, case


@pytest.fixture(scope="module")
def worker():
    runner = ModelWorker(hang_seconds=300.0, case_seconds=60.0)
    yield runner
    runner.close()


@pytest.mark.parametrize("text, code", [
    ("mesh dp=8193, tp=2\nuse dp()\nuse dp()\nuse dp()\n" + PLAN, "sharded-twice"),
    ("mesh dp=2, tp=2\nfor q in 0..8192: use dp() on dp\n" + PLAN, "sharded-twice"),
    ("mesh dp=65536, tp=2\nuse dp()\nuse dp()\n" + PLAN, "sharded-twice"),
    ("mesh tp=3\n" + PLAN, "tp-indivisible"),
])
def test_the_worker_reports_a_hostile_mesh_as_diagnostics(worker, text, code):
    result = worker.run("model.pps", text)
    assert result["outcome"] == "ok" and code in result["codes"], result


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_model_checks_end_in_diagnostics(worker, rng):
    name, text = case(rng)
    result = worker.run(name, text)
    assert result["outcome"] == "ok", (result, name, text)
