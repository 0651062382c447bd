"""Interop with torch.distributed.pipelining's compute-only schedule CSV (piper/frontend/interop.py):
what Piper exports, torch's own `_load_csv` reads back and lowers; what torch
generates, Piper imports as a .pps script that plans the same order; and
export -> import -> export is the identity."""
from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from piper import PiperError  # noqa: E402
from piper.frontend.capture import Program  # noqa: E402
from piper.dsl import load_strategy  # noqa: E402
from piper.cli_export import export_main
from piper.frontend.interop import compute_slots, export_torch_csv, import_main, import_torch_csv, overlapped_slots, read_torch_csv
from piper.job import plan  # noqa: E402

STDLIB = Path(__file__).resolve().parents[1] / "stdlib"
PER_DEVICE = {"gpipe": 1, "one_f_one_b": 1, "zero_bubble": 1, "interleaved_1f1b": 2,
              "interleaved_zero_bubble": 2, "zbv": 2, "dualpipev": 2}


def stdlib_plan(name: str, p: int = 4, m: int = 8, **mesh):
    regions = p * PER_DEVICE[name]
    return plan(load_strategy(STDLIB / f"{name}.pps").bind(microbatches=m), mesh=mesh or {"pp": p},
                program=Program.chain(f"PP={regions}"))


def torch_runtime(p: int, per_device: int, microbatches: int) -> _PipelineScheduleRuntime:
    """A torch schedule runtime on mock stages (as torch's own _schedule_visualizer builds one): no process group."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, p, None
    stage.num_stages = p * per_device
    return _PipelineScheduleRuntime([stage] * per_device, microbatches)


def torch_rows(text: str, p: int, per_device: int, microbatches: int, tmp_path) -> list[list[str]]:
    """Load `text` with torch's `_load_csv(path, "compute_only")`; its actions as strings."""
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    runtime = torch_runtime(p, per_device, microbatches)
    runtime._load_csv(str(path), "compute_only")       # validates, and lowers to send/recv
    assert runtime.pipeline_order_with_comms             # the lowering ran
    return [[str(a) for a in runtime.pipeline_order[r] if a is not None] for r in range(p)]


def test_export_format_is_torch_action_notation():
    text = export_torch_csv(stdlib_plan("one_f_one_b", p=2, m=3))
    assert text == "0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n"
    zb = export_torch_csv(stdlib_plan("zero_bubble", p=2, m=2)).splitlines()
    assert zb[0] == "0F0,0F1,0I0,0W0,0I1,0W1"   # ZB-H1: device s postpones its first s weight passes
    assert zb[1] == "1F0,1I0,1F1,1I1,1W0,1W1"
    dual = export_torch_csv(stdlib_plan("dualpipev", p=2, m=4)).splitlines()[0].split(",")
    assert "(0F3;3B1)OVERLAP_F_B" in dual and "(3F2;0B0)OVERLAP_F_B" in dual


@pytest.mark.parametrize("name", list(PER_DEVICE))
def test_torch_loads_what_piper_exports(name, tmp_path):
    p, m = 4, 8
    text = export_torch_csv(stdlib_plan(name, p, m))
    loaded = torch_rows(text, p, PER_DEVICE[name], m, tmp_path)
    assert loaded == [row.split(",") for row in text.splitlines()]


@pytest.mark.parametrize("schedule,per_device", [("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2),
                                                 ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_import_of_torch_schedule_plans_the_same_order(schedule, per_device, tmp_path):
    p, m = 4, 8
    ops = get_schedule_ops(schedule, p, m, per_device)
    text = "\n".join(",".join(str(a) for a in row if a is not None) for row in ops) + "\n"
    script = import_torch_csv(text, name="from_torch")
    compiled = plan(load_strategy(script), mesh={"pp": p}, program=Program.chain(f"PP={p * per_device}"))
    assert export_torch_csv(compiled) == text
    assert torch_rows(export_torch_csv(compiled), p, per_device, m, tmp_path) == \
        [[str(a) for a in row if a is not None] for row in ops]


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv", "dualpipev"])
def test_export_import_export_round_trips(name):
    compiled = stdlib_plan(name, p=4, m=8)
    text = export_torch_csv(compiled)
    script = import_torch_csv(text, name="again")
    again = plan(load_strategy(script), mesh={"pp": 4}, program=Program.chain(f"PP={4 * PER_DEVICE[name]}"))
    assert export_torch_csv(again) == text
    assert compute_slots(again) == compute_slots(compiled)
    assert overlapped_slots(again) == overlapped_slots(compiled)


def test_imported_script_reads_as_place_and_order():
    script = import_torch_csv("0F0,1F0,(0F1;1B0)OVERLAP_F_B,1F1,1B1,0B0,0B1\n", name="tiny")
    assert "strategy tiny(axis = pp):" in script
    assert "    split MB into 2\n" in script and "split B into" not in script
    assert "    place PP=0 on axis[0]\n    place PP=1 on axis[0]\n" in script
    assert "F(PP=1, MB=0); [F(PP=0, MB=1), B(PP=1, MB=0)]; F(PP=1, MB=1)" in script
    compiled = plan(load_strategy(script), mesh={"pp": 1}, program=Program.chain("PP=2"))
    assert compute_slots(compiled, 0)[2] == ("0F1", "1B0")
    split = import_torch_csv("0F0,0I0,0W0\n1F0,1I0,1W0\n")
    assert "split B into BI, BW" in split and "BI(PP=1, MB=0); BW(PP=1, MB=0)" in split


def test_export_of_a_composed_strategy_uses_the_pipeline_axis():
    """dp=2 x pp=2: one row per pp coordinate (the dp replicas run the same order)."""
    script = load_strategy("use one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n")
    compiled = plan(script, mesh={"dp": 2, "pp": 2}, program=Program.chain("PP=2"))
    assert export_torch_csv(compiled) == "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"


def test_bad_csv_is_a_diagnostic():
    with pytest.raises(PiperError) as err:
        read_torch_csv("0F0,0X1\n")
    assert err.value.diagnostics[0].code == "bad-schedule-csv"
    with pytest.raises(PiperError) as err:
        import_torch_csv("0F0,1F0\n1F0\n")
    assert "stage 1 runs on rank 0 and on rank 1" in err.value.diagnostics[0].message
    assert read_torch_csv("0F0,0REDUCE_GRAD,0UNSHARD\n") == [[(("F", 0, 0),)]]


def test_command_line_entry_points(tmp_path, capsys):
    csv_path, pps_path = tmp_path / "zbv.csv", tmp_path / "zbv.pps"
    args = argparse.Namespace(script=str(STDLIB / "zbv.pps"), model=None, regions="PP=4", mesh="pp=2",
                              set=["microbatches=4"], format="torch-csv", output=str(csv_path))
    assert export_main(args) == 0
    assert csv_path.read_text() == export_torch_csv(stdlib_plan("zbv", p=2, m=4))
    assert import_main(argparse.Namespace(file=str(csv_path), output=str(pps_path))) == 0
    assert pps_path.read_text().startswith("# Imported from zbv.csv")
    again = plan(load_strategy(pps_path), mesh={"pp": 2}, program=Program.chain("PP=4"))
    assert export_torch_csv(again) == csv_path.read_text()
    assert import_main(argparse.Namespace(file=str(csv_path), output=None)) == 0
    assert "strategy zbv(axis = pp):" in capsys.readouterr().out
    with pytest.raises(PiperError):
        export_main(argparse.Namespace(script=str(STDLIB / "zbv.pps"), model=None, regions=None, mesh="pp=2",
                                       set=["microbatches=4"], format="torch-csv", output=None))


def test_export_with_a_model(capsys):
    """--model captures the model (meta device, no Ray): small_gpt has the 4 regions zbv needs on pp=2."""
    root = Path(__file__).resolve().parents[1]
    args = argparse.Namespace(script=str(root / "examples" / "gpt_zbv.pps"), model=f"{root}/examples/gpt.py:small_gpt",
                              regions=None, mesh=None, set=None, format="torch-csv", output=None)
    assert export_main(args) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows == export_torch_csv(stdlib_plan("zbv", p=2, m=8)).splitlines()
