"""Traces: a real 1F1B run and its simulation as Chrome/Perfetto trace-event JSON."""
import json

import pytest

import piper
from piper.frontend.capture import Program
from piper.cli import main
from piper.job import plan
from piper.dsl.script import load_strategy
from piper.compiler.simulate import simulate
from piper.compiler.trace import COMM_TID, simulation_trace
from tests.test_train import gpt, gpt_batches

SCRIPT = "mesh pp=2\nuse one_f_one_b(microbatches=4) on pp\n"


def _slices(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") != "step"]


def _tracks(doc):
    return {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def _check_document(doc, plans):
    processes = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {0: "device 0 (pp=0)", 1: "device 1 (pp=1)"}
    assert {(0, "lane 0 (plan)"), (0, "communication"), (1, "lane 0 (plan)"), (1, "communication")} <= _tracks(doc)
    slices = _slices(doc)
    for rank in (0, 1):
        names = [e["name"] for e in sorted((e for e in slices if e["pid"] == rank), key=lambda e: e["ts"])
                 if e["tid"] != COMM_TID]
        # the lane runs exactly the plan's computes, in plan order
        assert names == [a.key for a in plans[rank] if a.node.is_compute]
        comm = {e["name"] for e in slices if e["pid"] == rank and e["tid"] == COMM_TID}
        assert comm == {a.key for a in plans[rank] if not a.node.is_compute}
    starts = [e for e in doc["traceEvents"] if e["ph"] == "s"]
    ends = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "f"}
    sends = [a for a in plans[0] if a.node.op == "SEND"] + [a for a in plans[1] if a.node.op == "SEND"]
    assert len(starts) == len(ends) == len(sends) == 8          # 4 activations forward, 4 gradients back
    for s in starts:
        f = ends[s["id"]]
        assert f["pid"] == 1 - s["pid"] and f["ts"] >= s["ts"]
    return slices


def test_simulated_trace_has_every_action_and_a_flow_per_message(tmp_path):
    compiled = plan(load_strategy(SCRIPT), program=Program.chain({"PP": 2}))
    plans = compiled.plans.representatives()
    sim = simulate(plans, record_comm=True)
    doc = json.loads(json.dumps(simulation_trace(plans, sim, mesh=compiled.ir.mesh)))
    _check_document(doc, plans)
    # the CLI writes the same document
    path = tmp_path / "sim.json"
    script = tmp_path / "s.pps"
    script.write_text(SCRIPT)
    assert main(["simulate", str(script), "--regions", "PP=2", "--trace", str(path)]) == 0
    assert json.loads(path.read_text())["traceEvents"] == doc["traceEvents"]


@pytest.mark.usefixtures("ray_cluster")
def test_run_trace_matches_the_plan_and_the_simulation(tmp_path):
    model = gpt(2)
    batches = gpt_batches(steps=3, batch=4)
    with piper.compile(model, batches[0], strategy=load_strategy(SCRIPT), timeout=120) as job:
        for b in batches:
            job.step(*b)
        path = job.trace(str(tmp_path / "run.json"), steps=1)
        plans = {r: job.compiled.plans[r] for r in range(2)}
    doc = json.loads(open(path).read())
    real = _check_document(doc, plans)
    # one step's slice per device, every action inside its step
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert len(steps) == 2
    for e in real:
        step = next(s for s in steps if s["pid"] == e["pid"])
        assert step["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1
    sim = simulate(plans, record_comm=True)
    simulated = _slices(simulation_trace(plans, sim))
    assert sorted((e["pid"], e["name"]) for e in real) == sorted((e["pid"], e["name"]) for e in simulated)


@pytest.mark.usefixtures("ray_cluster")
def test_piper_run_writes_metrics_and_a_trace(tmp_path):
    script = tmp_path / "pp2.pps"
    script.write_text(SCRIPT)
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    assert main(["run", str(script), "--model", "examples/gpt.py:two_stage_gpt", "--steps", "2",
                 "--metrics", str(metrics), "--trace", str(trace)]) == 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["step_s"] > 0 and m["loss"] > 0 and m["tokens_per_s"] == pytest.approx(16 * 64 / m["step_s"])
    doc = json.loads(trace.read_text())
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"} == {0, 1}
