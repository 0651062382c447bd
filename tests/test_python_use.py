"""Standard strategies from Python (`s.use("one_f_one_b", ..., on="pp")`), `piper explain --list`,
and `piper export` on the script's own mesh."""
import pytest

import piper
from piper.frontend.capture import Program
from piper.cli import main
from piper.dsl import load_strategy
from piper.dsl.codes import CODES
from piper.job import build_strategy, plan


def plans_of(strategy, mesh, regions):
    compiled = plan(strategy, mesh=mesh, program=Program.chain(f"PP={regions}"))
    return {rank: [a.key for a in actions] for rank, actions in compiled.plans.items()}, compiled.ir


@pytest.mark.parametrize("schedule, pps, regions", [
    ('s.use("one_f_one_b", microbatches=8, on="pp")', "use one_f_one_b(microbatches=8) on pp", 2),
    ('s.use("interleaved_1f1b", microbatches=4, virtual=2, on="pp")',
     "use interleaved_1f1b(microbatches=4, virtual=2) on pp", 4),
    ('s.use("zbv", microbatches=4, on="pp")', "use zbv(microbatches=4) on pp", 4),
])
def test_a_named_strategy_composes_as_use_does_in_a_script(schedule, pps, regions):
    namespace = {}
    exec(f"def composed(s):\n    {schedule}\n    s.use(\"zero3\", on=\"dp\")\n", namespace)
    from_python = piper.strategy(namespace["composed"])
    from_script = load_strategy(f"{pps}\nuse zero3() on dp\n")
    mesh = {"dp": 2, "pp": 2}
    assert build_strategy(from_python, mesh)[1] == build_strategy(from_script, mesh)[1]
    py_plans, py_ir = plans_of(from_python, mesh, regions)
    pps_plans, pps_ir = plans_of(from_script, mesh, regions)
    assert py_plans == pps_plans and py_ir == pps_ir


def test_on_binds_the_axis_of_a_python_strategy_too():
    @piper.strategy
    def shard_it(s, axis="dp"):
        s.shard("batch", over=axis)

    assert build_strategy(piper.strategy(lambda s: s.use(shard_it, on="x")), {"x": 2})[1][0].over == "x"


def test_errors_of_a_named_strategy_say_where_in_python():
    @piper.strategy
    def bad(s):
        s.use("one_f_one_b", microbatches=0, on="pp")

    with pytest.raises(piper.PiperError) as err:
        build_strategy(bad, {"pp": 2})
    d = err.value.diagnostics[0]
    assert d.code == "value-out-of-range" and "test_python_use.py" in str(d.trace[0])


@pytest.mark.parametrize("call, code", [
    ('s.use("no_such_schedule", on="pp")', "unknown-strategy"),
    ('s.use("one_f_one_b", microbatches=2.5, on="pp")', "wrong-type"),
    ('s.use("one_f_one_b", microbatches=2, on="p p")', "wrong-type"),
    ('s.use("one_f_one_b", microbatches=2, on="dp")', "unknown-axis"),
])
def test_bad_named_uses_are_diagnosed(call, code):
    namespace = {}
    exec(f"def f(s):\n    {call}\n", namespace)
    with pytest.raises(piper.PiperError) as err:
        build_strategy(piper.strategy(namespace["f"]), {"pp": 2})
    assert err.value.code == code


def test_explain_list_shows_every_code_with_its_summary(capsys):
    assert main(["explain", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(CODES)
    assert any(line.split()[0] == "unknown-axis" and line.endswith(CODES["unknown-axis"]) for line in lines)


def test_explain_without_a_code_is_a_usage_error(capsys):
    assert main(["explain"]) == 2
    assert "--list" in capsys.readouterr().err


def test_export_falls_back_to_the_scripts_mesh(capsys):
    assert main(["export", "examples/gpt_zero3_1f1b.pps", "--regions", "PP=2"]) == 0
    own = capsys.readouterr().out
    assert main(["export", "examples/gpt_zero3_1f1b.pps", "--regions", "PP=2", "--mesh", "dp=2,pp=2"]) == 0
    assert capsys.readouterr().out == own and len(own.splitlines()) == 2
