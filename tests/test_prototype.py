"""`piper import FILE.json`: the Piper prototype's directive programs become .pps scripts
that compile to the same per-device plans as the stdlib strategies they express."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from piper.frontend.capture import Program
from piper.cli import main
from piper.diagnostics import PiperError
from piper.dsl import load_strategy
from piper.frontend.interop import compute_slots
from piper.job import plan
from piper.frontend.prototype import program_of, program_to_pps

DATA = Path(__file__).resolve().parent / "data" / "prototype"
# fixture -> (the stdlib script it expresses, the regions)
EQUIVALENT = {
    "one_f_one_b": ("mesh pp=4\nuse one_f_one_b(microbatches=8) on pp\n", "PP=4"),
    "zero_bubble": ("mesh pp=4\nuse zero_bubble(microbatches=8) on pp\n", "PP=4"),
    "interleaved_1f1b": ("mesh pp=2\nuse interleaved_1f1b(microbatches=4) on pp\n", "PP=4"),
    "dualpipev": ("mesh pp=4\nuse dualpipev(microbatches=8) on pp\n", "PP=8"),
    "dp_1f1b": ("mesh dp=2, pp=2\nuse one_f_one_b(microbatches=4) on pp\nuse dp() on dp\n", "PP=2"),
    "zero2_1f1b": ("mesh dp=2, pp=2\nuse one_f_one_b(microbatches=4) on pp\nuse zero2() on dp\n", "PP=2"),
    "zero3_1f1b": ("mesh dp=2, pp=2\nuse one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n", "PP=2"),
}


def _same_plans(a, b):
    assert a.ir.mesh == b.ir.mesh and a.zero == b.zero
    for rank in range(a.ir.mesh.world_size):
        assert a.plans[rank] == b.plans[rank], rank
    assert compute_slots(a) == compute_slots(b)       # overlapped slots and whole backwards too


@pytest.mark.parametrize("name", sorted(EQUIVALENT))
def test_imported_program_compiles_to_the_stdlib_plans(name, tmp_path):
    script, regions = EQUIVALENT[name]
    out = tmp_path / f"{name}.pps"
    assert main(["import", str(DATA / f"{name}.json"), "-o", str(out)]) == 0
    imported = plan(load_strategy(out), program=Program.chain(regions))
    _same_plans(imported, plan(load_strategy(script), program=Program.chain(regions)))


@pytest.mark.parametrize("script,regions,m", [
    ("mesh pp=2\nuse gpipe(microbatches=4) on pp\n", "PP=2", 4),
    ("mesh pp=2\nuse zbv(microbatches=4) on pp\n", "PP=4", 4),
    ("mesh pp=2\nuse interleaved_zero_bubble(microbatches=4) on pp\n", "PP=4", 4),
    ("mesh dp=2\nuse zero3() on dp\nsplit MB into 2\n", "PP=2", 2),
    ("mesh dp=2, pp=2\nuse dualpipev(microbatches=4) on pp\nuse zero1() on dp\n", "PP=4", 4),
])
def test_program_of_round_trips(script, regions, m):
    compiled = plan(load_strategy(script), program=Program.chain(regions))
    text, warnings = program_to_pps(json.loads(json.dumps(program_of(compiled, microbatches=m))))
    assert not warnings
    _same_plans(plan(load_strategy(text), program=Program.chain(regions)), compiled)


BAD = [
    ([{"op": "plaec", "filter": {"PP": 0}, "devices": [0]}], "[0].op", "did you mean `place`"),
    ([{"op": "split", "dim": "MB", "parts": 2}, {"op": "place", "filter": {"PP": 0}, "devices": [0]},
      {"op": "place", "filter": {"PP": 1}, "devices": [1]},
      {"op": "replicate", "filter": {"PP": 1}, "devices": [0, 1]}], "[3].filter", "whole model"),
    ([{"op": "shard", "filter": {"EP": "*"}, "over": "ep"}], "[0].filter", "expert"),
    ([{"op": "place", "filter": {"PP": 0}, "devices": [0]}, {"op": "place", "filter": {"PP": 1}, "devices": [1]},
      {"op": "replicate", "devices": [0, 1], "shard_params": True}], "[2].shard_params", "ZeRO-3"),
    ({"mesh": {"dp": 2, "pp": 2}, "directives": [{"op": "place", "filter": {"PP": 0}, "devices": [0, 3]}]},
     "[0].devices", "not the devices of one index"),
    ([{"op": "order", "filter": {"PP": 0}, "schedule": [{"PASS": "X", "MB": 0}]}], "[0].schedule[0].PASS", "unknown pass"),
    ([{"op": "split", "dim": "seq", "parts": 2}], "[0].dim", "no equivalent"),
    ({"directives": 3}, "(top)", "JSON list"),
]


@pytest.mark.parametrize("program,path,words", BAD)
def test_what_has_no_equivalent_is_a_diagnostic_naming_the_json_path(program, path, words, tmp_path, capsys):
    with pytest.raises(PiperError) as err:
        program_to_pps(program, file="p.json")
    messages = [d.message + " " + (d.hint or "") for d in err.value.diagnostics]
    assert any(f"p.json {path}:" in m and words in m for m in messages), messages
    # the command prints the same, exit 1, no traceback
    file = tmp_path / "p.json"
    file.write_text(json.dumps(program))
    assert main(["import", str(file)]) == 1
    assert path in capsys.readouterr().err


def test_streams_are_dropped_with_a_warning(capsys, tmp_path):
    program = json.loads((DATA / "one_f_one_b.json").read_text())
    program[-1]["stream"] = "compute"
    program[-1]["schedule"][0]["stream"] = "comm"
    file = tmp_path / "s.json"
    file.write_text(json.dumps(program))
    assert main(["import", str(file)]) == 0
    captured = capsys.readouterr()
    assert "[8].stream" in captured.err and "[8].schedule[0].stream" in captured.err
    imported = plan(load_strategy(captured.out), program=Program.chain("PP=4"))
    _same_plans(imported, plan(load_strategy(EQUIVALENT["one_f_one_b"][0]), program=Program.chain("PP=4")))


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
