"""A loop over one slot line runs without the general interpreter (`piper.dsl.slot_loops`):
the directives, the steps counted and the errors are the general way's."""
from __future__ import annotations

import pytest

import piper.dsl.control_flow as control_flow
from piper.diagnostics import PiperError
from piper.dsl import load_strategy

STDLIB = ["gpipe", "one_f_one_b", "zero_bubble", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"]


def _run(text: str, general: bool, monkeypatch):
    """The script's directives (or its errors), the general way or not."""
    with monkeypatch.context() as m:
        if general:
            m.setattr(control_flow, "run_slot_loop", lambda *args: False)
        try:
            return repr(load_strategy(text, file="case.pps").build(None)[1])
        except PiperError as err:
            return [(d.code, d.message, repr(d.span)) for d in err.diagnostics]


@pytest.mark.parametrize("schedule", STDLIB)
@pytest.mark.parametrize("microbatches", [1, 5, 12])
def test_a_stdlib_schedule_records_what_the_general_way_records(schedule, microbatches, monkeypatch):
    text = f"mesh dp=2, pp=4\nuse {schedule}(microbatches={microbatches}) on pp\nuse zero3() on dp\n"
    assert _run(text, False, monkeypatch) == _run(text, True, monkeypatch)
    taken = []
    fast = control_flow.run_slot_loop
    monkeypatch.setattr(control_flow, "run_slot_loop", lambda *args: taken.append(fast(*args)) or taken[-1])
    _run(text, False, monkeypatch)
    assert any(taken)          # the loops did go this way


@pytest.mark.parametrize("line,why", [
    ("for m in 0..6: F(MB=m - 2)", "a negative index"),
    ("for m in 0..6: F(MB=m * 4611686018427387904)", "a number too large"),
    ("for m in 0..6: F(MB=m // (m - 3))", "a division by zero"),
    ("for m in 0..6: F(MB=n)", "an unknown name"),
    ("for m in 0..6:\n        let k = m > 2\n        F(MB=m)", "a `let` of a comparison"),
    ("for m in 0..6:\n        F(MB=m)\n        let k = m", "a `let` after the slot line"),
    ("for m in 0..6: F(MB=m, MB=m)", "a tag twice"),
    ("for m in 0..6: F(PP=0, MB=m)", "two tags, covered"),
    ("for m in 0..6: F(PP=*, MB=m)", "a tag without a value, covered"),
    ("for m in 0..6:\n        let k = m // 2 * 2 + m % 2\n        let m = k\n        F(MB=m)", "lets, covered"),
])
def test_what_it_does_not_cover_goes_the_general_way(line, why, monkeypatch):
    text = f"mesh pp=2\nsplit MB into 6\norder PP=0:\n    {line}\n"
    fast, general = _run(text, False, monkeypatch), _run(text, True, monkeypatch)
    assert fast == general, why


def test_it_counts_the_steps_the_general_way_counts(monkeypatch):
    text = "mesh pp=2\nsplit MB into 6\norder PP=0:\n    for m in 0..6: F(MB=m); B(MB=m)\n"
    script = load_strategy(text, file="case.pps")
    steps = {}
    for general in (False, True):
        with monkeypatch.context() as m:
            if general:
                m.setattr(control_flow, "run_slot_loop", lambda *args: False)
            from piper.dsl import interpreter

            made = []
            original = interpreter.Interpreter.__init__

            def keep(self, *args, **kwargs):
                original(self, *args, **kwargs)
                made.append(self)

            m.setattr(interpreter.Interpreter, "__init__", keep)
            script.build(None)
            steps[general] = made[-1].steps
    assert steps[False] == steps[True] > 12
