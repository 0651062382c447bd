"""Fuzzing `piper import` with hypothesis: mutated prototype programs give a diagnostic or a script that parses.

The mutations are benchmarks/fuzz_prototype.py's (its seeds are the programs under
tests/data/prototype/), drawn here by hypothesis so a failure shrinks to a small case;
`python -m benchmarks.fuzz_prototype` runs 100,000 of them and counts the outcomes.
No deadline: the machines are noisy, and the bounds are tested in test_prototype_hostile.py.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_prototype import case, outcome


class HypothesisDraws:
    """The benchmark's choices, drawn by hypothesis."""

    def __init__(self, data):
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_mutated_programs_are_diagnostics_or_scripts(data):
    text = case(HypothesisDraws(data))
    result = outcome(text)
    assert not result.startswith("internal"), (result, text[:500])


def test_the_fuzz_can_fail(monkeypatch):
    # an outcome other than a diagnostic or a script that parses is reported as internal
    import piper.frontend.prototype as prototype

    assert outcome('[{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2}]') == "ok"
    assert outcome("[") == "bad-program-json"
    monkeypatch.setattr(prototype, "program_to_pps", lambda data, file: ("order PP=0: F(\n", []))
    assert outcome("[]").startswith("internal: the script does not parse")
    monkeypatch.setattr(prototype, "program_to_pps", lambda data, file: 1 / 0)
    assert outcome("[]").startswith("internal: ZeroDivisionError")
