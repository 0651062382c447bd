"""`piper check`'s limits sit at real use: the README's and RESULTS.md's headline size (64 stages x
512 microbatches x dp 8) checks, while what is past it is refused before the work begins; and the
loops with `if`s of ZBV and DualPipeV run the fast way (`dsl/slot_loops.py`) with what the general
way records, counts and reports."""
from __future__ import annotations

import pytest

import piper.dsl.control_flow as control_flow
from piper.cli import main
from piper.diagnostics import PiperError
from piper.dsl import interpreter, load_strategy
from piper.dsl import nodes as n
from piper.ir.size import MAX_COMPUTES

HEADLINE = "mesh dp=8, pp=64\nuse one_f_one_b(microbatches=512) on pp\nuse zero3() on dp\n"


def test_the_headline_size_checks(tmp_path, capsys):
    path = tmp_path / "pp64_mb512_dp8.pps"
    path.write_text(HEADLINE)
    assert main(["check", str(path), "--regions", "PP=64"]) == 0, capsys.readouterr()
    assert MAX_COMPUTES >= 64 * 512


def test_twice_the_headline_is_refused_before_planning(tmp_path, capsys):
    path = tmp_path / "too_big.pps"
    path.write_text(HEADLINE.replace("512", "1024"))
    assert main(["check", str(path), "--regions", "PP=64"]) == 1
    assert "plan-too-large" in capsys.readouterr().out


def _run(text: str, general: bool, monkeypatch):
    """(the directives or the errors, the steps and terms counted), the general way or not."""
    made = []
    with monkeypatch.context() as m:
        if general:
            m.setattr(control_flow, "run_slot_loop", lambda *args: False)
        original = interpreter.Interpreter.__init__

        def keep(self, *args, **kwargs):
            original(self, *args, **kwargs)
            made.append(self)

        m.setattr(interpreter.Interpreter, "__init__", keep)
        try:
            out = repr(load_strategy(text, file="case.pps").build(None)[1])
        except PiperError as err:
            out = [(d.code, d.message, repr(d.span)) for d in err.diagnostics]
    return out, made[-1].steps, made[-1].work


@pytest.mark.parametrize("body,why", [
    ("for i in 0..6:\n        if i < 3: F(MB=i)\n        if i >= 3: F(MB=i); B(MB=i - 3)", "two ifs"),
    ("for i in 0..6:\n        if i % 2 == 0: F(MB=i)\n        else: B(MB=i)", "an else"),
    ("for i in 0..6:\n        let k = i // 2\n        if not (k > 1) and i != 5 or i == 0: F(MB=i)",
     "a let, not, and, or"),
    ("for i in 0..6:\n        if i > 9: F(MB=i // 0)\n        F(MB=i)", "a division by zero in an arm not taken"),
    ("for i in 0..6:\n        if i > 4: F(MB=i // 0)\n        F(MB=i)", "a division by zero in an arm taken"),
    ("for i in 0..6:\n        if i > 4: F(MB=i - 9)", "a negative index in an arm taken"),
    ("for i in 0..6:\n        if true: F(MB=i)", "a literal condition"),
    ("for i in 0..6:\n        if i: F(MB=i)", "an int as a condition: the general way's error"),
    ("for i in 0..6:\n        if i < 3:\n            if i < 1: F(MB=i)", "an if in an if: the general way"),
])
def test_a_loop_with_ifs_records_and_counts_what_the_general_way_does(body, why, monkeypatch):
    text = f"mesh pp=2\nsplit MB into 6\norder PP=0:\n    {body}\n"
    assert _run(text, False, monkeypatch) == _run(text, True, monkeypatch), why


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_split_backward_schedules_take_the_fast_way(schedule, monkeypatch):
    """The `if`s that run the general way do not grow with the microbatches: the loops over
    microbatches take the fast way (DualPipeV's phase 7 nests an `if` in an `else`, once per stage)."""
    general, exec_if = [], interpreter._EXEC[n.If]
    counts = []
    for microbatches in (12, 48):
        text = f"mesh dp=2, pp=4\nuse {schedule}(microbatches={microbatches}) on pp\nuse zero3() on dp\n"
        assert _run(text, False, monkeypatch) == _run(text, True, monkeypatch)
        with monkeypatch.context() as m:
            m.setitem(interpreter._EXEC, n.If, lambda self, *args: general.append(1) or exec_if(self, *args))
            general.clear()
            _run(text, False, monkeypatch)
        counts.append(len(general))
    assert counts[0] == counts[1], counts


def test_a_loop_whose_ifs_could_pass_the_step_limit_goes_the_general_way(monkeypatch):
    """The fast way takes a loop only if it fits with every `if` taken; the general way then
    stops it where it passes the limit, with the same message."""
    text = ("mesh pp=2\nsplit MB into 6\norder PP=0:\n    for i in 0..150000:\n"
            "        if i < 0: F(MB=0)\n        if i < 0: F(MB=0)\n")
    fast, general = _run(text, False, monkeypatch), _run(text, True, monkeypatch)
    assert fast == general and "loop-limit" in repr(fast[0])


def test_a_schedule_far_longer_than_the_model_names_the_missing_regions_as_a_range(tmp_path, capsys):
    """4,096 stages on a model of 64 regions listed 4,032 names (30 KB in one message)."""
    path = tmp_path / "long.pps"
    path.write_text("mesh pp=4096\nuse gpipe(microbatches=8) on pp\n")
    assert main(["check", "--format", "json", str(path), "--regions", "PP=64"]) == 1
    import json

    found = json.loads(capsys.readouterr().out)
    assert found[0]["code"] == "unknown-region" and len(found[0]["message"]) < 200, found[0]["message"]
    assert "PP=64..4095 (4,032 regions) do not exist" in found[0]["message"]
