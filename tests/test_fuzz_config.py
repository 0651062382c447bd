"""A short run of the `piper run --config` fuzz (benchmarks/fuzz_config.py): mutated configs (hostile
values and keys, deep nesting, bytes that are not UTF-8, special files) through the config check in
a worker held under a 2 GiB address-space limit. Every case must end in a PiperError or flags that
check: no other exception, no MemoryError, no worker lost. The time bounds only detect hangs; the
benchmark run (`python -m benchmarks.fuzz_config --cases 100000`) holds cases to 5 s of CPU."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_config import Worker, case


@pytest.fixture(scope="module")
def worker():
    runner = Worker(hang_seconds=300.0, case_seconds=60.0)
    yield runner
    runner.close()


def test_a_case_is_repeatable_and_mostly_changed():
    once = [case(random.Random(seed)) for seed in range(20)]
    assert once == [case(random.Random(seed)) for seed in range(20)]
    assert len({c["text"] for c in once}) >= 15


@pytest.mark.parametrize("text, code", [
    ("batch_size = inf\n", "bad-config"),
    ("a" + ".a" * 3000 + " = 1\n", "bad-config"),
    ("steps = 3\n", "checked"),
])
def test_the_worker_reports_a_config_as_its_diagnostic(worker, text, code):
    import json

    result = worker.run("case", json.dumps({"text": text, "special": None}))
    assert result["outcome"] == "ok" and result["codes"] == [code], result


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_mutated_configs_end_in_diagnostics(worker, rng):
    import json

    item = case(rng)
    result = worker.run("case", json.dumps(item))
    assert result["outcome"] == "ok", (result, item)
