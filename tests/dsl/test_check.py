"""check_source: every error and warning in a file, without running it and without raising."""
from pathlib import Path

import pytest

from piper.dsl import check_source

from .util import codes

FIXTURES = Path(__file__).parent / "fixtures"


def check(text, **kwargs):
    return codes(check_source(text, "t.pps", **kwargs))


@pytest.mark.parametrize("mesh", [None, "pp=8", "dp=2"])
def test_strategy_files_check_clean(mesh):
    for path in FIXTURES.glob("*.pps"):
        if path.name == "gpt_zero3_1f1b.pps" and mesh is not None:
            continue  # it declares its own mesh
        assert check_source(path.read_text(), str(path), mesh=mesh) == []


def test_lines_a_run_would_skip_are_checked():
    text = "strategy s(n: int):\n    if n > 100:\n        split MB into nn\n    for i in 0..0:\n" \
           "        order PP=0: G(MB=i)\n    split MB into n\n"
    assert check(text) == ["unknown-name", "unknown-pass"]


def test_a_use_that_leaves_a_parameter_unset_needs_no_mesh():
    assert check("use one_f_one_b() on pp\n") == ["missing-parameter"]
    assert check("use one_f_one_b(microbatches=4) on pp\n") == []


def test_values_are_checked_when_a_mesh_is_known():
    text = "use one_f_one_b(microbatches=0) on pp\n"
    assert check(text) == []
    assert check(text, mesh="pp=2") == ["value-out-of-range"]
    assert check("mesh pp=2\n" + text) == ["value-out-of-range"]


def test_an_error_in_a_loop_is_reported_once():
    assert check("mesh pp=1\norder PP=0:\n    for m in 0..50: B(MB=m - 10)\n") == ["value-out-of-range"]


def test_unused_and_shadowed():
    text = "mesh pp=2\nlet a = 1\nlet _b = 2\nlet pp = 3\nstrategy s(n: int):\n    for n in 0..2:\n" \
           "        let m = n\n        split MB into m\n"
    found = check_source(text, "t.pps")
    assert [(d.code, d.span.line) for d in found] == [
        ("unused-let", 2), ("shadowed-name", 4), ("unused-let", 4), ("shadowed-name", 6)]
    assert found[1].message == "this let `pp` hides the mesh axis of the same name"
    assert found[3].labels[0].message == "the parameter `n`"


def test_types_and_arity():
    assert check("strategy s(n: int = pp, flag: bool = 3):\n    split MB into n\n") == ["unknown-name", "wrong-type"]
    assert check("strategy s(n: int = pp):\n    split MB into n\n", mesh="pp=2") == ["wrong-type"]
    assert check("mesh pp=2\nuse one_f_one_b(1, 2, 3)\n") == ["wrong-arity"]
    assert check("mesh pp=2\nuse one_f_one_b(microbatches=2, 3) on pp\n") == ["wrong-arity"]
    assert check("mesh pp=2\nuse one_f_one_b(4, microbatches=2) on pp\n") == ["duplicate-name"]
    assert check("mesh pp=2\nuse one_f_one_b(4, axis=pp) on pp\n") == ["duplicate-name"]
    assert check("mesh pp=2\nlet t = pp == 1\nif t: split MB into 1\n") == ["wrong-type"]
    assert check("mesh dp=2\nuse one_f_one_b(microbatches=2, axis=4)\n") == ["wrong-type"]


def test_axes():
    assert check("mesh dp=2\nuse zero3() on ppp\n") == ["unknown-axis"]
    assert check("place PP=0 on pp[0]\n", mesh="dp=2") == ["unknown-axis"]
    assert check("use zero3() on dp\n", mesh=None) == []
    hint = check_source("mesh pp=2\nshard batch over dp\n", "t.pps")[0].hint
    assert hint == "the axes are pp; add `dp` to the mesh"


def test_mesh_problems():
    assert check("mesh dp=0, dp=2\nmesh pp=2\n") == ["value-out-of-range", "duplicate-name", "duplicate-name"]
    assert check("mesh dp=2\n", mesh="dp=4") == ["mesh-mismatch"]
    assert check("split MB into 2\n", mesh="dp=x") == ["bad-mesh"]
    assert check("mesh dp=1000000, pp=1000000\n") == ["value-out-of-range"]


def test_overrides():
    text = "mesh pp=2\nlet mb = 4\nuse one_f_one_b(microbatches=mb) on pp\n"
    assert check(text, overrides={"mb": "8"}) == []
    assert check(text, overrides={"one_f_one_b.axis": "pp", "microbatches": 3}) == []
    assert check(text, overrides={"mb": "0"}) == ["value-out-of-range"]
    (d,) = check_source(text, "t.pps", overrides={"microbatchs": "8"})
    assert d.code == "unknown-parameter" and d.hint == "did you mean `microbatches`?" and d.span is None


def test_strategies_defined_twice_and_imports(tmp_path):
    (tmp_path / "lib.pps").write_text("strategy zero3(axis = dp):\n    shard batch over axis\n")
    (tmp_path / "broken.pps").write_text("strategy b():\n    split MB 2\n")
    main = tmp_path / "main.pps"
    found = check_source('import "lib.pps"\nimport "broken.pps"\nstrategy zero3():\n    split MB into 2\n',
                         str(main))
    assert [d.code for d in found] == ["duplicate-name", "missing-into"]
    assert found[1].span.file == str(tmp_path / "broken.pps")
    assert found[1].labels[-1].message == "imported here" and found[1].labels[-1].span.line == 2


def test_unknown_strategy_suggests_the_standard_library():
    (d,) = check_source("use zero_3() on dp\n", "t.pps")
    assert d.code == "unknown-strategy" and d.hint == "did you mean `zero3`?"


def test_diagnostics_come_in_file_order():
    text = "mesh pp=2\nlet a = 1\nplace PP=0 on qq[0]\nlet b = 2\nsplit MB into 0\n"
    assert [d.span.line for d in check_source(text, "t.pps")] == [2, 3, 4, 5]
