"""The interpreter: .pps scripts build exactly the directives the Python API builds."""
from pathlib import Path

import pytest

import piper
from piper.diagnostics import PiperError
from piper.frontend.directives import Order, Place, Shard, Split
from piper.dsl import Limits, load_strategy
from piper.mesh import Mesh
from piper.frontend.selectors import Selector, parse_selector

from .util import strip_spans

FIXTURES = Path(__file__).parent / "fixtures"


@piper.strategy
def one_f_one_b(s, microbatches, axis="pp"):
    """The fixture one_f_one_b.pps, written with the Python API."""
    p = s.size(axis)
    s.split("MB", microbatches)
    for stage in range(p):
        s.place(f"PP={stage}", s.mesh[axis][stage])
    for stage in range(p):
        warm = min(p - stage - 1, microbatches)
        items = [f"F(MB={m})" for m in range(warm)]
        for m in range(microbatches - warm):
            items += [f"F(MB={m + warm})", f"B(MB={m})"]
        items += [f"B(MB={m})" for m in range(microbatches - warm, microbatches)]
        s.order(f"PP={stage}", items)


@piper.strategy
def zero3(s, axis="dp"):
    s.shard("batch", over=axis)
    s.shard("optimizer", "grads", "params", over=axis)


@pytest.mark.parametrize("mesh, microbatches", [("pp=2", 4), ("dp=2,pp=4", 8), ("pp=4", 2), ("pp=1", 1)])
def test_one_f_one_b_matches_python(mesh, microbatches):
    mesh = Mesh.of(mesh)
    script = load_strategy(FIXTURES / "one_f_one_b.pps").bind(microbatches=microbatches)
    _, from_script = script.build(mesh)
    _, from_python = one_f_one_b.bind(microbatches=microbatches).build(mesh)
    assert strip_spans(from_script) == strip_spans(from_python)


def test_zero3_matches_python():
    mesh = Mesh.of("dp=4")
    assert strip_spans(load_strategy(str(FIXTURES / "zero3.pps")).build(mesh)[1]) == \
        strip_spans(zero3.build(mesh)[1])


def test_composed_example_uses_its_own_mesh():
    mesh, directives = load_strategy(FIXTURES / "gpt_zero3_1f1b.pps").build(None)
    assert mesh == Mesh.of("dp=2,pp=2")
    expected = one_f_one_b.bind(microbatches=8).build(mesh)[1] + zero3.build(mesh)[1]
    assert strip_spans(directives) == strip_spans(expected)
    assert [type(d) for d in directives] == [Split, Place, Place, Order, Order, Shard, Shard]


def test_spans_point_into_the_script():
    _, directives = load_strategy(FIXTURES / "gpt_zero3_1f1b.pps").build(None)
    split, place, _, order = directives[:4]
    assert split.span.file.endswith("one_f_one_b.pps") and (split.span.line, split.span.column) == (5, 5)
    line = split.span.source.split("\n")[split.span.line - 1]
    assert line[split.span.column - 1:split.span.end_column - 1] == "split MB into microbatches"
    assert (place.span.line, place.span.column) == (7, 9)
    assert place.group == Mesh.of("dp=2,pp=2")["pp"][0]
    assert order.span.line == 10 and order.selector == Selector(None, (("PP", 0),))
    assert len(order.item_spans) == len(order.slots)
    first = order.item_spans[0][0]
    assert first.source.split("\n")[first.line - 1][first.column - 1:first.end_column - 1] == "F(MB=m)"


def test_slots_groups_and_inline_order():
    script = load_strategy("mesh pp=1\norder PP=0 EP=*: F(MB=0); [F(MB=1), B(MB=0)]; B(MB=1);\n")
    (order,) = script.build()[1]
    assert order.selector == Selector(None, (("PP", 0), ("EP", "*")))
    assert [[str(item) for item in slot] for slot in order.slots] == \
        [["F(MB=0)"], ["F(MB=1)", "B(MB=0)"], ["B(MB=1)"]]


def test_order_block_with_for_if_let():
    text = """mesh pp=1
order PP=0:
    let n = 3
    for m in 0..n:
        if m % 2 == 0 and not (m == 2):
            F(MB=m)
        else:
            B(MB=m); BW(PP=0, MB=m)
    UPD
"""
    (order,) = load_strategy(text).build()[1]
    assert [[str(i) for i in slot] for slot in order.slots] == \
        [["F(MB=0)"], ["B(MB=1)"], ["BW(PP=0, MB=1)"], ["B(MB=2)"], ["BW(PP=0, MB=2)"], ["UPD"]]


def test_arithmetic_is_integer_and_python_like():
    text = "mesh pp=8\nlet a = -7 // 2\nlet b = -7 % 3\nlet c = 2 + 3 * 4 - (1 - 2)\nplace PP=0 on pp[a + 4]\n" \
           "place PP=1 on pp[b]\nplace PP=2 on pp[c - 8]\nplace PP=3 on pp[max(1, min(7, size(pp)), 2)]\n"
    groups = [d.group.fixed for d in load_strategy(text).build()[1]]
    assert groups == [(("pp", 0),), (("pp", 2),), (("pp", 7),), (("pp", 7),)]


def test_split_backward_and_docstring():
    text = 'strategy zb(mb: int):\n    """Zero bubble: split backward."""\n    split MB into mb\n' \
           '    split B into BI, BW\nuse zb(4)\n'
    assert load_strategy(text).build()[1] == (Split("MB", 4, load_strategy(text).build()[1][0].span),
                                              Split("B", None, load_strategy(text).build()[1][1].span))


def test_use_on_binds_the_only_axis_parameter():
    text = "mesh dp=2, pp=2\nstrategy dp_only(data: axis):\n    shard batch over data\nuse dp_only() on pp\n"
    (shard,) = load_strategy(text).build()[1]
    assert shard.over == "pp"


def test_set_overrides_a_top_level_let_and_parameters():
    text = "mesh dp=2, pp=2\nlet mb = 4\nuse one_f_one_b(microbatches=mb) on pp\nuse zero3() on dp\n"
    script = load_strategy(text)
    assert script.build()[1][0].count == 4
    assert script.bind(mb=6).build()[1][0].count == 6
    assert script.bind(microbatches=3).build()[1][0].count == 3
    assert script.bind(**{"one_f_one_b.microbatches": "5"}).build()[1][0].count == 5
    assert script.bind(axis="pp").build()[1][-1].over == "pp"  # both strategies' `axis`
    assert load_strategy(text, overrides={"mb": "2"}).build()[1][0].count == 2
    with pytest.raises(PiperError) as err:
        script.bind(microbatch=3)
    assert err.value.code == "unknown-parameter" and "did you mean `microbatches`?" in err.value.diagnostics[0].hint


def test_set_with_the_wrong_type():
    script = load_strategy(FIXTURES / "one_f_one_b.pps").bind(microbatches="many")
    with pytest.raises(PiperError) as err:
        script.build("pp=2")
    assert err.value.code == "wrong-type"


def test_strategy_file_needs_its_parameters():
    with pytest.raises(PiperError) as err:
        load_strategy(FIXTURES / "one_f_one_b.pps").build("pp=2")
    assert err.value.code == "missing-parameter"


def test_mesh_mismatch_and_default_mesh():
    script = load_strategy(FIXTURES / "gpt_zero3_1f1b.pps")
    assert script.mesh == Mesh.of("dp=2,pp=2")
    assert script.build({"pp": 2, "dp": 2})[0] == Mesh.of("pp=2,dp=2")
    with pytest.raises(PiperError) as err:
        script.build(Mesh.of("dp=4,pp=2"))
    assert err.value.code == "mesh-mismatch"
    assert load_strategy("split MB into 2\n").build()[0] == Mesh(())


def test_every_error_is_reported():
    text = "mesh pp=2\nplace PP=0 on ppp[0]\nsplit MB into 0\nshard weights over pp\n"
    with pytest.raises(PiperError) as err:
        load_strategy(text).build()
    assert [d.code for d in err.value.diagnostics] == ["unknown-axis", "value-out-of-range", "bad-shard"]


def test_errors_inside_a_used_strategy_carry_the_use_site():
    script = load_strategy("mesh pp=2\nuse one_f_one_b(microbatches=0) on pp\n", file="job.pps")
    with pytest.raises(PiperError) as err:
        script.build()
    (diagnostic,) = err.value.diagnostics
    assert diagnostic.code == "value-out-of-range"
    assert diagnostic.span.file.endswith("one_f_one_b.pps")
    assert [(s.file, s.line) for s in diagnostic.trace] == [("job.pps", 2)]


def test_negative_microbatch_in_a_schedule():
    text = "mesh pp=1\norder PP=0:\n    for m in 0..2: [F(MB=m), B(MB=m - 1)]\n"
    with pytest.raises(PiperError) as err:
        load_strategy(text).build()
    assert err.value.code == "value-out-of-range" and "MB=-1" in err.value.diagnostics[0].message


@pytest.mark.parametrize("text, code, limits", [
    ("mesh pp=1\nfor i in 0..100000000000:\n    split MB into 1\n", "loop-limit", Limits()),
    ("strategy r(n: int):\n    use r(n + 1)\nuse r(0)\n", "recursion-limit", Limits()),
    ("strategy two(n: int):\n    if n < 40:\n        use two(n + 1)\n        use two(n + 1)\nuse two(0)\n",
     "loop-limit", Limits(steps=20_000)),
    ("mesh pp=1\nfor i in 0..1000:\n    for j in 0..1000:\n        order PP=0: F(MB=i)\n", "loop-limit",
     Limits(steps=20_000)),
])
def test_hostile_scripts_end_with_an_error(text, code, limits):
    """The default limit is 400,000 steps (about 2 s); smaller ones keep the test quick.
    The limits count steps, not seconds, so the code says the run was cut short by them."""
    with pytest.raises(PiperError) as err:
        load_strategy(text, limits=limits).build()
    assert err.value.code == code


def test_imports_are_relative_to_the_script(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mine.pps").write_text("strategy mine(axis = dp):\n    shard batch, grads over axis\n")
    (tmp_path / "job.pps").write_text('mesh dp=2\nimport "lib/mine.pps"\nuse mine() on dp\n')
    (shard,) = load_strategy(tmp_path / "job.pps").build()[1]
    assert shard.what == ("batch", "grads")


@pytest.mark.parametrize("path, code", [('"/etc/passwd.pps"', "bad-import"), ('"notes.txt"', "bad-import"),
                                        ('"missing.pps"', "import-not-found")])
def test_scripts_read_nothing_but_pps_files(tmp_path, path, code):
    (tmp_path / "job.pps").write_text(f"import {path}\n")
    with pytest.raises(PiperError) as err:
        load_strategy(tmp_path / "job.pps")
    assert err.value.code == code


def test_a_missing_script():
    with pytest.raises(PiperError) as err:
        load_strategy("no/such/file.pps")
    assert err.value.code == "file-not-found"


def test_a_library_file_cannot_run():
    text = "strategy a(axis = dp):\n    shard batch over axis\nstrategy b(axis = dp):\n    shard grads over axis\n"
    with pytest.raises(PiperError) as err:
        load_strategy(text).build("dp=2")
    assert err.value.code == "ambiguous-strategy"


def test_python_strategies_can_use_scripts():
    @piper.strategy
    def hybrid(s):
        s.use(str(FIXTURES / "zero3.pps"), axis="dp")

    mesh = Mesh.of("dp=2")
    assert strip_spans(hybrid.build(mesh)[1]) == strip_spans(zero3.build(mesh)[1])
    assert piper.strategy.__module__ == "piper.frontend.strategy"


@pytest.mark.parametrize("region, item", [("PP=1", "F(MB=0)"), ("PP=1 EP=*", "BW(PP=2, MB=3)"),
                                          ("EP=0", "UPD"), ("PP=0 EP=2", "BI(MB=7)")])
def test_selectors_read_as_in_the_python_api(region, item):
    (order,) = load_strategy(f"mesh pp=1\norder {region}: {item}\n").build()[1]
    assert order.selector == parse_selector(region)
    assert order.slots == ((parse_selector(item),),)
