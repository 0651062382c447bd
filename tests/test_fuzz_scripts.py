"""A short run of the `piper check` fuzz (benchmarks/fuzz_scripts.py): mutated standard-library and
example scripts, each through `piper check` in a worker held under a 2 GiB address-space limit.
Every case must end in diagnostics: no exception but the project's own, no MemoryError, no worker
lost. The time bounds only detect hangs (60 s of CPU a case, 5 minutes of wall time); the
benchmark run (`python -m benchmarks.fuzz_scripts --cases 100000`) holds cases to 5 s."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_scripts import Worker, case, mutate, seeds


@pytest.fixture(scope="module")
def worker():
    runner = Worker(hang_seconds=300.0, case_seconds=60.0)
    yield runner
    runner.close()


def test_the_seeds_are_every_stdlib_and_example_script():
    names = {name for name, _ in seeds()}
    assert {"one_f_one_b.pps", "dualpipev.pps", "zero3.pps", "gpt_zbv.pps", "moe_dualpipev_ep.pps"} <= names


def test_a_mutation_changes_the_text_and_is_repeatable():
    text = "mesh pp=2\nuse one_f_one_b(microbatches=8) on pp\n"
    once = [mutate(text, random.Random(seed)) for seed in range(20)]
    assert once == [mutate(text, random.Random(seed)) for seed in range(20)]
    assert sum(m != text for m in once) >= 15


@pytest.mark.parametrize("text, code", [
    ("mesh pp=2\nsplit MB into 4000000\nplace PP=0 on pp[0]\n", "value-out-of-range"),
    ("mesh pp=2\nfor q in 0..4611686018427387904:\n    split MB into 2\n", "loop-limit"),
])
def test_the_worker_reports_a_hostile_case_as_diagnostics(worker, text, code):
    result = worker.run("hostile.pps", text)
    assert result["outcome"] == "ok" and code in result["codes"], result


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_mutated_scripts_end_in_diagnostics(worker, rng):
    name, text = case(rng)
    result = worker.run(name, text)
    assert result["outcome"] == "ok", (result, name, text)


# ---- tensor-parallel scripts (benchmarks/fuzz_tp_scripts.py): hostile patterns, meshes and kinds


@pytest.mark.parametrize("text", [
    'mesh tp=2\nshard columns of "' + "*" * 60 + 'x" over tp\n',
    'mesh tp=65536, dp=65536\nshard columns of "**.q_proj" over tp\nshard rows of "**.o_proj" over tp\n',
    'mesh tp=2\nshard vocab of "", "\u202e", "a' + "." * 300 + '" over tp\n',
    'mesh dp=2, pp=2, tp=2\nuse one_f_one_b(microbatches=64) on pp\nuse zero3() on dp\n'
    'use llama_tensor_parallel(sequence=true) on tp\nshard sequence over tp\n',
])
def test_the_worker_reports_a_hostile_tp_case_as_diagnostics(worker, text):
    result = worker.run("tp.pps", text)
    assert result["outcome"] == "ok", result


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_tp_scripts_end_in_diagnostics(worker, rng):
    from benchmarks.fuzz_tp_scripts import case as tp_case

    name, text = tp_case(rng)
    result = worker.run(name, text)
    assert result["outcome"] == "ok", (result, name, text)
