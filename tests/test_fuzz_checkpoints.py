"""A short run of the checkpoint-folder fuzz (benchmarks/fuzz_checkpoints.py): a small checkpoint
with its piper.json mutated, files swapped in from another checkpoint, cut, grown or flipped (and
re-signed), replaced by special files, or saved with hostile `piper.*` entries, through
`verify_checkpoint` in a worker held under a 2 GiB address-space limit. Every case ends in a
PiperError, or passes where the edits left the checkpoint whole; never another exception, a
MemoryError or a lost worker. The benchmark run (`python -m benchmarks.fuzz_checkpoints --cases
100000`) holds cases to 5 s of CPU."""
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_checkpoints import Worker, case


@pytest.fixture(scope="module")
def worker():
    runner = Worker(hang_seconds=300.0, case_seconds=60.0)
    yield runner
    runner.close()


def test_a_case_is_repeatable():
    assert [case(random.Random(s)) for s in range(20)] == [case(random.Random(s)) for s in range(20)]


@pytest.mark.parametrize("edits, outcome, code", [
    ([], "accepted", None),
    ([{"op": "special", "name": "piper.json", "kind": "fifo"}], "ok", "unreadable-file"),
    ([{"op": "swap", "name": "__0_0.distcp", "entry": "copy_with_id"}], "ok", "checkpoint-corrupt"),
    ([{"op": "piper", "key": "step", "value": -3}], "ok", "not-a-checkpoint"),
])
def test_the_worker_reports_each_kind_of_case(worker, edits, outcome, code):
    result = worker.run("case", json.dumps(edits))
    assert result["outcome"] == outcome and result["codes"] == ([code] if code else []), result


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_mutated_checkpoints_end_in_diagnostics(worker, rng):
    edits = case(rng)
    result = worker.run("case", json.dumps(edits))
    assert result["outcome"] in ("ok", "accepted"), (result, edits)
