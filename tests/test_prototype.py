"""`piper import FILE.json`: the Piper prototype's own programs become .pps scripts that check clean
and give the per-device schedules its builder wrote.

tests/data/prototype/ holds the prototype's examples/base-schedules/*.json as it ships them and,
under built/, those bases with the split and orders its examples/build_schedule.py appends
(tests/data/prototype/README.md says how they were made). The expected per-device order is read
from each program's own `order` filters: the builder's output is the reference.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from piper.cli import main
from piper.diagnostics import PiperError
from piper.dsl import load_strategy
from piper.frontend.capture import Program
from piper.frontend.interop import compute_slots
from piper.frontend.prototype import program_of, program_to_pps
from piper.job import plan

DATA = Path(__file__).resolve().parent / "data" / "prototype"
BASES = sorted((DATA / "base-schedules").glob("*.json"))
BUILT = sorted((DATA / "built").glob("*.json"))
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _load(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def _stage_devices(program: list[dict]) -> dict[int, tuple[int, ...]]:
    """PP index -> its place's devices, as the prototype's harness reads them."""
    return {d["filter"]["PP"]: tuple(sorted(d["devices"])) for d in program if d["op"] == "place"}


def _import(path: Path, tmp_path: Path) -> Path:
    out = tmp_path / f"{path.stem}.pps"
    assert main(["import", str(path), "-o", str(out)]) == 0
    return out


def _rows(compiled, rank: int) -> list[list[tuple[int, str, int]]]:
    """`rank`'s compute slots as (region, pass, microbatch) lists, a whole backward (BI and BW of one item) as B."""
    index = compiled.ir.index()
    rows = []
    for slot in compute_slots(compiled, rank):
        nodes = [index[k] for k in slot]
        whole = {(n.region, n.mb) for n in nodes if n.op == "BI"} & {(n.region, n.mb) for n in nodes if n.op == "BW"}
        rows.append([(n.region, "B" if (n.region, n.mb) in whole else n.op, n.mb) for n in nodes
                     if not ((n.region, n.mb) in whole and n.op == "BW")])
    return rows


@pytest.mark.parametrize("path", BASES + BUILT, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_prototype_program_imports_and_checks_clean(path, tmp_path, capsys):
    out = _import(path, tmp_path)
    capsys.readouterr()
    regions = f"PP={len(_stage_devices(_load(path)))}"
    assert main(["check", str(out), "--regions", regions, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == []          # no errors, no warnings


def test_the_shipped_programs_are_the_prototypes_examples():
    names = {p.name for p in BASES}
    assert names == {"dp2.json", "pp2_dp2_ep2.json", "pp2_dp2_ep2_bucket100.json", "pp2_dp2_ep2_custom_order.json",
                     "pp2_dp2_ep2_zero2.json", "pp2_dp2_ep2_zero3.json", "pp4_dp2_ep2_interleaved.json",
                     "pp4_dp2_ep2_v_placement.json"}
    families = {re.search(r"__(\w+?)_pp\d", p.stem).group(1) for p in BUILT}
    assert families == {"1f1b", "zerobubble", "interleaved_1f1b", "dualpipev"}


@pytest.mark.parametrize("path", BUILT + [DATA / "base-schedules" / "pp2_dp2_ep2_custom_order.json"],
                         ids=lambda p: p.stem)
def test_per_device_schedules_are_the_builders(path, tmp_path):
    program = _load(path)
    stages = _stage_devices(program)
    compiled = plan(load_strategy(_import(path, tmp_path)), program=Program.chain(f"PP={len(stages)}"))
    orders = [d for d in program if d["op"] == "order"]
    assert orders
    for order in orders:
        # the items of one slot may run in any order (the prototype interleaves them; Piper runs them in lanes)
        expected = [sorted((f["PP"], f["PASS"], f["MB"]) for f in slot) for slot in order["filters"]]
        for device in stages[order["filters"][0][0]["PP"]]:     # every data-parallel replica of the stage
            assert [sorted(slot) for slot in _rows(compiled, device)] == expected, (path.name, device)


# the builder's programs on one device per stage -> the stdlib strategy of the same family
STDLIB = {
    "pp4__1f1b_pp4_mbs8": "use one_f_one_b(microbatches=8) on pp",
    "pp4__zerobubble_pp4_mbs8": "use zero_bubble(microbatches=8) on pp",
    "pp4_v2__interleaved_1f1b_pp4_mbs8": "use interleaved_1f1b(microbatches=8) on pp",
    "pp4_v__dualpipev_pp4_mbs8": "use dualpipev(microbatches=8) on pp",
    "pp2_dp2_ep2_zero3__1f1b_pp2_mbs4": "use one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n"
                                        "use expert_parallel() on dp",
}


@pytest.mark.parametrize("name", sorted(STDLIB))
def test_builder_programs_compile_to_the_stdlib_plans(name, tmp_path):
    path = DATA / "built" / f"{name}.json"
    regions = Program.chain(f"PP={len(_stage_devices(_load(path)))}")
    imported = plan(load_strategy(_import(path, tmp_path)), program=regions)
    mesh = ", ".join(f"{a}={n}" for a, n in imported.ir.mesh.axes)
    stdlib = plan(load_strategy(f"mesh {mesh}\n{STDLIB[name]}\n"), program=regions)
    assert imported.zero == stdlib.zero
    for rank in range(imported.ir.mesh.world_size):
        assert imported.plans[rank] == stdlib.plans[rank], rank


def test_an_expert_parallel_program_checks_against_a_moe_model(tmp_path):
    out = _import(DATA / "built" / "pp2_dp2_ep2_zero3__1f1b_pp2_mbs4.json", tmp_path)
    assert "shard experts over dp" in out.read_text()
    assert main(["check", str(out), "--model", "examples/moe.py:moe_two_regions", "--format", "concise"]) == 0


def test_the_zero_level_comes_from_the_flags(tmp_path):
    lines = {p.stem: _import(p, tmp_path).read_text().splitlines() for p in BASES}
    assert "shard optimizer, grads over dp" in lines["pp2_dp2_ep2_zero2"]
    assert "shard optimizer, grads, params over dp" in lines["pp2_dp2_ep2_zero3"]
    assert not any(line.startswith("shard optimizer") for line in lines["pp2_dp2_ep2"])
    assert lines["dp2"][1:] == ["mesh dp=2", "shard batch over dp"]


def test_stages_outer_is_the_other_mesh_order():
    # the prototype's test_piper_schedule.py places PP=0 on [0, 1] and PP=1 on [2, 3] (pp_outer)
    program = [{"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
               {"op": "place", "filter": {"PP": 1}, "devices": [2, 3]},
               {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1]},
               {"op": "replicate", "filter": {"PP": 1}, "devices": [2, 3]}]
    text, _ = program_to_pps(program)
    assert "mesh pp=2, dp=2" in text and "place PP=1 on pp[1]" in text
    compiled = plan(load_strategy(text + "split MB into 2\n"), program=Program.chain("PP=2"))
    assert compiled.ir.devices_of(1) == (2, 3)


@pytest.mark.parametrize("script,regions,m", [
    ("mesh pp=2\nuse gpipe(microbatches=4) on pp\n", "PP=2", 4),
    ("mesh pp=2\nuse zbv(microbatches=4) on pp\n", "PP=4", 4),
    ("mesh pp=2\nuse interleaved_zero_bubble(microbatches=4) on pp\n", "PP=4", 4),
    ("mesh dp=2\nuse zero3() on dp\nsplit MB into 2\n", "PP=2", 2),
    ("mesh dp=2, pp=2\nuse dualpipev(microbatches=4) on pp\nuse zero2() on dp\n", "PP=4", 4),
])
def test_program_of_round_trips(script, regions, m):
    compiled = plan(load_strategy(script), program=Program.chain(regions))
    text, warnings = program_to_pps(json.loads(json.dumps(program_of(compiled, microbatches=m))))
    assert not warnings
    imported = plan(load_strategy(text), program=Program.chain(regions))
    assert imported.zero == compiled.zero
    for rank in range(compiled.ir.mesh.world_size):
        assert imported.plans[rank] == compiled.plans[rank], rank


def test_zero1_has_no_prototype_spelling():
    compiled = plan(load_strategy("mesh dp=2\nuse zero1() on dp\nsplit MB into 2\n"), program=Program.chain("PP=1"))
    with pytest.raises(ValueError, match="ZeRO-1"):
        program_of(compiled, microbatches=2)


PLACES = [{"op": "place", "filter": {"PP": 0}, "devices": [0, 2]},
          {"op": "place", "filter": {"PP": 1}, "devices": [1, 3]}]
REPLICATES = [{"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2]},
              {"op": "replicate", "filter": {"PP": 1}, "devices": [1, 3]}]
SPLIT = {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2}
BAD = [   # program, code, JSON path, words of the message or hint
    ([{"op": "plaec", "filter": {"PP": 0}, "devices": [0]}], "bad-program-json", "[0].op", "did you mean `place`"),
    ([{"op": "place", "filter": {"PP": 0}, "devices": [0, 3]}, {"op": "place", "filter": {"PP": 1}, "devices": [1, 2]}],
     "prototype-unsupported", "[0].devices", "not one stage"),
    ([PLACES[0], {"op": "place", "filter": {"PP": 1}, "devices": [1]}], "prototype-unsupported", "[1].devices",
     "one size"),
    ([{"op": "place", "filter": {"PP": 0}, "devices": [0, 1]}, {"op": "place", "filter": {"PP": 1}, "devices": [1, 2]}],
     "prototype-unsupported", "[1].devices", "overlapping"),
    ([{"op": "place", "filter": {"PP": 0}, "devices": [0]}, {"op": "place", "filter": {"PP": 1}, "devices": [5]}],
     "prototype-unsupported", "[1].devices", "leave out device 1"),
    (PLACES, "prototype-unsupported", "[0].devices", "never replicated"),
    (PLACES + REPLICATES[:1], "prototype-unsupported", "[1].filter", "not replicated"),
    (PLACES + [REPLICATES[0], {**REPLICATES[1], "devices": [0, 2]}], "prototype-unsupported", "[3].devices",
     "stage's own"),
    (PLACES + [REPLICATES[0], {**REPLICATES[1], "shard_grads": True}], "prototype-unsupported", "[3]",
     "same way on every stage"),
    (PLACES + REPLICATES + [{"op": "shard", "filter": {"PP": 0, "TP": "*"}, "devices": [0, 2]}],
     "prototype-unsupported", "[4].filter", "only the experts"),
    (PLACES + REPLICATES + [{"op": "shard", "filter": {"PP": 0, "EP": 1}, "devices": [0, 2]}],
     "prototype-unsupported", "[4].filter.EP", "one expert region"),
    (PLACES + REPLICATES + [{"op": "shard", "filter": {"EP": "*"}, "devices": [0, 2]}],
     "prototype-unsupported", "[4].filter", "whole model"),
    ([{**SPLIT, "filter": {"PP": 0}}], "prototype-unsupported", "[0].filter", "part of the model"),
    ([SPLIT, {**SPLIT, "dim_name": "SEQ"}], "prototype-unsupported", "[1]", "second split"),
    ([SPLIT, {"op": "order", "filters": [[{"MB": 0, "PASS": "F"}], [{"MB": 0, "PASS": "B"}]]}],
     "prototype-unsupported", "[1].filters", "names a region"),
    ([{"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "X"}]]}], "bad-program-json", "[0].filters[0][0].PASS",
     "unknown pass"),
    ([{"op": "order", "filters": [{"PP": 0, "MB": 0, "PASS": "F"}]}], "bad-program-json", "[0].filters[0]",
     "list of one"),
    ([{"op": "place", "filter": {"PP": 0}, "devices": [[0]]}], "bad-program-json", "[0].devices[0]",
     "device is a number"),
    ([{"op": "place", "filter": {"PP": 0}, "devices": [0, 0]}], "bad-program-json", "[0].devices", "twice"),
    ([{"op": "place", "filter": {"PP": 0}, "devices": [0], "stream": 3}], "bad-program-json", "[0].stream", "name"),
    ([{"op": "replicate", "filter": {}, "devices": [0, 1], "shard_grads": "yes"}], "bad-program-json",
     "[0].shard_grads", "true or false"),
    ([{"op": "replicate", "filter": {}, "devices": [0, 1], "stream": "s"}], "bad-program-json", "[0].stream",
     "replicate has no field"),
    ([{"op": "split", "dim": "MB", "parts": 4}], "bad-program-json", "[0].dim", "dim_name"),
    ([{"op": "order", "filter": {"PP": 0}, "schedule": []}], "bad-program-json", "[0].filter", "order has no field"),
    ({"mesh": {"dp": 2}, "directives": []}, "bad-program-json", "(top)", "no longer read"),
    ([{"op": "place", "filter": {"PP": -1}, "devices": [0]}], "bad-program-json", "[0].filter.PP", "tag index"),
    ([{"op": "place", "filter": {"PP": 0, "PASS": "F"}, "devices": [0]}], "prototype-unsupported",
     "[0].filter.PASS", "only an order"),
    ([{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 0}], "bad-program-json",
     "[0].num_microbatches", ">= 1"),
]


@pytest.mark.parametrize("program,code,path,words", BAD, ids=lambda v: v if isinstance(v, str) else None)
def test_what_has_no_equivalent_is_a_diagnostic_naming_the_json_path(program, code, path, words, tmp_path, capsys):
    with pytest.raises(PiperError) as err:
        program_to_pps(program, file="p.json")
    found = [(d.code, d.message + " " + (d.hint or "")) for d in err.value.diagnostics]
    assert any(c == code and f"p.json {path}:" in m and words in m for c, m in found), found
    file = tmp_path / "p.json"
    file.write_text(json.dumps(program))
    assert main(["import", str(file)]) == 1                  # the command: the same, exit 1, no traceback
    err = capsys.readouterr().err
    assert f"[{code}]" in err and path in err and "Traceback" not in err


def test_streams_and_buckets_are_one_warning(tmp_path, capsys):
    out = _import(DATA / "base-schedules" / "pp2_dp2_ep2_bucket100.json", tmp_path)
    err = capsys.readouterr().err
    assert err.count("prototype-dropped") == 1 and "[2].bucket_size" in err and "[0].stream" in err
    assert "stream" not in out.read_text()


def test_experts_of_some_stages_are_widened_with_a_warning():
    text, warnings = program_to_pps(PLACES + REPLICATES + [{"op": "shard", "filter": {"PP": 0, "EP": "*"},
                                                             "devices": [0, 2]}], file="p.json")
    assert "shard experts over dp" in text
    assert [(w.code, w.message.split(":")[0]) for w in warnings] == [("prototype-widened", "p.json [1].filter")]


def test_a_split_dimension_of_another_name_is_the_microbatch():
    text, _ = program_to_pps([{"op": "place", "filter": {"PP": 0}, "devices": [0]},
                              {"op": "split", "filter": {}, "dim_name": "mb", "num_microbatches": 2},
                              {"op": "order", "filters": [[{"PP": 0, "mb": 0, "PASS": "F"}], [{"PP": 0, "mb": 1}]]}])
    assert "split MB into 2" in text and "F(PP=0, MB=0); F(PP=0, MB=1); B(PP=0, MB=1)" in text


_PAGE_JSON = re.compile(r"## (Example|Fix)\n\n```json\n(.*?)```", re.S)


@pytest.mark.parametrize("code", ["bad-program-json", "prototype-unsupported", "prototype-dropped",
                                  "prototype-widened", "program-too-large"])
def test_code_pages_examples_do_what_they_say(code, tmp_path, capsys):
    (example, bad), (fix, good) = _PAGE_JSON.findall((DOCS / "codes" / f"{code}.md").read_text())
    assert (example, fix) == ("Example", "Fix")
    for text, wanted in ((bad, True), (good, False)):
        file = tmp_path / "p.json"
        file.write_text(text)
        status = main(["import", str(file)])
        err = capsys.readouterr().err
        assert (f"[{code}]" in err) == wanted, err
        assert status == (1 if wanted and code not in ("prototype-dropped", "prototype-widened") else 0), err


def test_not_json_is_a_diagnostic(tmp_path, capsys):
    file = tmp_path / "broken.json"
    file.write_text('[{"op": "split",')
    assert main(["import", str(file)]) == 1
    assert "bad-program-json" in capsys.readouterr().err


def test_torch_csv_still_imports(tmp_path, capsys):
    file = tmp_path / "s.csv"
    file.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert main(["import", str(file)]) == 0
    assert "order" in capsys.readouterr().out
