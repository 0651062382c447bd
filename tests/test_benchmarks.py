"""Smoke test of the benchmark harness: a --quick run of the compiler suite completes
and writes a report with numbers. No timing assertions and no time limits: this
machine's speed is not under test, only that the harness runs end to end.

The suites that start Ray workers (overhead, cost-model, batch-composition,
overlap) run with PIPER_FULL=1; by default only the compiler suite runs, in seconds:

    PIPER_FULL=1 .venv/bin/python -m pytest -q tests/test_benchmarks.py
"""
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.harness.results import Table, fmt
from benchmarks.harness.timing import fit_exponent
from benchmarks.harness.report import markdown
from benchmarks.harness.runner import SUITES

REPO = Path(__file__).resolve().parent.parent
FULL = bool(os.environ.get("PIPER_FULL"))
full_only = pytest.mark.skipif(not FULL, reason="suites that start Ray workers run with PIPER_FULL=1 (minutes)")


def run_harness(*args, timeout=None):
    """`python -m benchmarks ARGS` in its own session, so a hang can be stopped with everything it started.

    No time limit by default: a loaded machine is slow, not wrong (pytest-timeout guards against hangs)."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"python -m benchmarks {' '.join(args)} did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def test_quick_run_of_the_compiler_suite_writes_numbers(tmp_path):
    report, metrics = tmp_path / "RESULTS.md", tmp_path / "metrics.json"
    code, out = run_harness("--suite", "compiler", "--quick", "--out", str(report), "--json", str(metrics))
    assert code == 0, out[-3000:]
    text = report.read_text()
    assert "## 6. `compiler`" in text and "Not implemented yet." not in text
    assert "--suite compiler --quick" in text          # each suite says how to reproduce it
    section = text.split("## 6. `compiler`")[1]           # each section says its run: when, commit, machine
    assert "- run: " in section and ", commit " in section and "- machine: cores " in section and " torch " in section
    compiler = json.loads(metrics.read_text())["compiler"]
    assert any(k.endswith(".seconds") for k in compiler) and any(k.endswith(".nodes_per_s") for k in compiler)
    for value in compiler.values():
        assert isinstance(value, (int, float)) and math.isfinite(value)


@full_only
@pytest.mark.timeout(3600)      # a hang guard only
def test_quick_run_of_the_overhead_and_cost_model_suites_writes_numbers(tmp_path):
    report, metrics = tmp_path / "RESULTS.md", tmp_path / "metrics.json"
    code, out = run_harness("--suite", "overhead", "cost-model", "--quick",
                            "--out", str(report), "--json", str(metrics))
    assert code == 0, out[-3000:]
    text = report.read_text()
    assert "## 7. `overhead`" in text and "## 8. `cost-model`" in text and "Not implemented yet." not in text
    numbers = json.loads(metrics.read_text())
    overhead = numbers["overhead"]
    assert "dev1.rank0.us_per_action_end_to_end" in overhead
    assert "dev2.rank1.us_per_action_executor" in overhead
    for value in overhead.values():
        assert isinstance(value, (int, float)) and math.isfinite(value)
    cost = numbers["cost-model"]
    for key in ("1f1b.pp2.measured_ms", "1f1b.pp2.predicted_ms", "1f1b.pp2.error", "dualpipev.pp2.bubble_fraction",
                "zero3.dp2.predicted_ms", "overhead.fixed_ms"):
        assert key in cost, sorted(cost)
    for value in cost.values():
        assert isinstance(value, (int, float)) and math.isfinite(value)


def test_every_suite_is_implemented():
    import importlib

    assert [s.module for s in SUITES if s.module is None] == []
    for s in SUITES:
        assert callable(importlib.import_module(f"benchmarks.suites.{s.module}").run)


@pytest.mark.ray
@full_only
@pytest.mark.timeout(3600)      # a hang guard only: it took 287 s alone on 2 cores, 480+ under load
def test_quick_batch_composition_and_overlap(tmp_path):
    report, metrics = tmp_path / "RESULTS.md", tmp_path / "metrics.json"
    code, out = run_harness("--suite", "batch-composition", "overlap", "--quick",
                            "--out", str(report), "--json", str(metrics))
    assert code == 0, out[-3000:]
    text = report.read_text()
    assert "## 4. `batch-composition`" in text and "## 5. `overlap`" in text
    assert "--suite batch-composition --quick" in text and "byte accounting" in text
    assert "failed:" not in text, text
    numbers = json.loads(metrics.read_text())
    batches, overlap = numbers["batch-composition"], numbers["overlap"]
    # Byte accounting, not timing: sharding the model state leaves room for at least as large a microbatch.
    assert batches["dp.largest_microbatch"] >= 1
    assert batches["zero3.largest_microbatch"] >= batches["dp.largest_microbatch"]
    assert batches["budget_bytes"] > 0
    for key in ("zero3_vs_dp.dp2.ratio", "dualpipev_vs_1f1b.m4.ratio", "dualpipev_vs_1f1b.m4.predicted_ratio"):
        assert key in overlap, sorted(overlap)
    for value in [*batches.values(), *overlap.values()]:
        assert isinstance(value, (int, float)) and math.isfinite(value)


def test_fit_exponent_and_formatting():
    assert fit_exponent([1, 10, 100], [2, 20, 200]) == pytest.approx(1.0)
    assert fit_exponent([1, 10, 100], [1, 100, 10000]) == pytest.approx(2.0)
    assert fit_exponent([5], [1]) is None
    assert fmt(None) == "—" and fmt(0.012345) == "0.0123" and fmt(123456.0) == "123,456" and fmt(3) == "3"
    t = Table("t", ["a", "b|c"])
    t.add(1.5, None)
    from benchmarks.harness.results import SuiteResult

    md = markdown([SuiteResult("x", 9, "X", "cmd", tables=[t])], command="cmd", started=__import__("datetime").datetime.now(),
                  info={"cores": "2"})
    assert "| a | b\\|c |" in md and "| 1.5 | — |" in md


def test_a_report_keeps_the_other_devices_part():
    from benchmarks.harness.report import GPU_HEADING, merged

    cpu_v1, cpu_v2 = "# Piper benchmark results\n\ncpu one\n", "# Piper benchmark results\n\ncpu two\n"
    gpu_v1, gpu_v2 = f"{GPU_HEADING}\n\ngpu one\n", f"{GPU_HEADING}\n\ngpu two\n"
    assert merged("", cpu_v1, "cpu") == cpu_v1
    both = merged(cpu_v1, gpu_v1, "cuda")
    assert both == cpu_v1 + "\n" + gpu_v1                       # the GPU part goes after the CPU part
    assert merged(both, cpu_v2, "cpu") == cpu_v2 + "\n" + gpu_v1   # a CPU run keeps the GPU results
    assert merged(both, gpu_v2, "cuda") == cpu_v1 + "\n" + gpu_v2  # and the other way round
    assert merged("", gpu_v1, "cuda") == gpu_v1


def test_a_run_replaces_only_the_sections_of_its_own_suites():
    import datetime

    from benchmarks.harness.report import markdown, merged
    from benchmarks.harness.results import SuiteResult

    def run(numbers, word, when):
        results = [SuiteResult(f"s{n}", n, f"suite {n}", f"cmd {n}", notes=[f"{word} {n}"]) for n in numbers]
        info = {"cores": "2", "commit": f"c{word}", "load": "0.50 0.40 0.30"}
        return markdown(results, command=f"run {word}", started=datetime.datetime(2026, 12, 5, when), info=info)

    first = merged("", run([1, 2, 3], "old", 1), "cpu")
    both = merged(first, run([2], "new", 2), "cpu")
    assert [line for line in both.splitlines() if line.startswith("## ")] == [
        "## 1. `s1` — suite 1", "## 2. `s2` — suite 2", "## 3. `s3` — suite 3"]
    assert "old 1" in both and "old 3" in both and "new 2" in both and "old 2" not in both
    section = both.split("## 2.")[1].split("## 3.")[0]
    assert "commit cnew" in section and "2026-12-05 02:00" in section and "`run new`" in section
    assert "commit cold" in both.split("## 3.")[1]                 # each section keeps its own run


def test_the_results_file_holds_only_what_the_harness_writes():
    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    for section in text.split("\n## ")[1:]:
        assert section.splitlines()[2].startswith("- run: "), section[:200]      # provenance first
        assert section.rstrip().endswith("s._"), section[-200:]               # and the suite's time last
    assert "\n# " not in text.split("\n", 1)[1] and "\n### " not in text


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_with_the_fix(capsys):
    # In this process: the refusals come before any suite runs, and a traceback would fail the test;
    # `python -m benchmarks` itself is run by test_quick_run_of_the_compiler_suite_writes_numbers.
    from benchmarks.harness.runner import main

    code = main(["--device", "cuda", "--quick"])
    out = capsys.readouterr().out
    assert code == 2 and "torch sees no CUDA GPU here" in out and "without --device cuda" in out, out
    assert "Traceback" not in out
    code = main(["--device", "cuda", "--suite", "compiler", "overlap"])
    out = capsys.readouterr().out
    assert code == 2 and "compiler runs on CPU only" in out and "GPU suites: pipelines, data-parallel, overlap" in out


def test_cuda_rows_name_the_gpus_they_need(ray_cluster):
    # Each row of a GPU suite needs one GPU per process; rows the machine cannot host say so
    # instead of failing (a one-GPU machine can still run the others).
    from benchmarks.suites import data_parallel
    from benchmarks.harness.runner import Context
    from rich.console import Console

    ctx = Context(quick=True, console=Console(quiet=True), device="cuda")
    ctx.gpus = 1
    assert ctx.cannot_host(1) is None and ctx.cannot_host(2) == "needs 2 GPUs, this machine has 1"
    assert ctx.command("data-parallel").endswith("--suite data-parallel --quick --device cuda")
    result = data_parallel.run(ctx)
    rows = result.tables[0].rows
    assert [row[:5] for row in rows] == [["2", "dp", "DistributedDataParallel", *["needs 2 GPUs, this machine has 1"] * 2],
                                         ["2", "zero3", "FSDP2 fully_shard", *["needs 2 GPUs, this machine has 1"] * 2]]
    assert result.metrics == {}


def test_head_to_head_reports_where_the_paired_ratios_fall():
    import re

    from benchmarks.harness.timing import Timings, head_to_head

    timings = Timings({"torch": [2.0, 3.0, 4.0], "piper": [1.0, 3.0, 2.0]}, {})
    assert timings.paired_ratios("torch", "piper") == [2.0, 1.0, 2.0]
    assert timings.paired_ratios("torch", "absent") == []

    class Fake:
        closed = False

        def step(self, x, y):
            return 1.5

        def close(self):
            self.closed = True

    group, job = Fake(), Fake()
    race = head_to_head(group, job, [(None, None)] * 5, warmup=1, steps=4, torch_error=None, piper_error=None)
    assert job.closed and race.group is group
    assert re.fullmatch(r"\d+\.\d\d – \d+\.\d\d", race.cells[3]), race.cells
    q1, q3 = race.quartiles
    assert 0 < q1 <= q3
    assert {"ratio", "ratio_q1", "ratio_q3"} <= dict(race.metrics()).keys()
    assert race.cells[-1] == "0.0e+00"                 # the same losses


def test_alternation_keeps_one_order_so_each_step_follows_the_other_system():
    from benchmarks.harness.timing import alternate

    calls = []
    systems = {name: (lambda x, y, name=name: calls.append((name, x)) or 1.0) for name in ("a", "b")}
    timings = alternate(systems, [(i, None) for i in range(3)], warmup=1, steps=2)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert len(timings.times["a"]) == len(timings.times["b"]) == 2


HF_FSDP_CHECK = """
import torch
from benchmarks.baselines.torch_group import TorchWorker
from benchmarks.suites.training_features import hf_workload
from benchmarks.harness.workloads import make_hf
from examples.gpt import training_batches

wl = hf_workload(True)
x, y = next(training_batches(2))
eager = float(make_hf(wl, 2)[0](x, y))
worker = TorchWorker(0, 1)
worker.init(worker.rendezvous_address(), 60.0)
kw = {"family": wl.family, "layers": wl.layers, "hidden": wl.hidden, "heads": wl.heads, "batch": 2, "stages": 2}
out = {}
for precision, checkpoint in (("fp32", False), ("bf16", False), ("fp32", True)):
    worker.setup("fsdp2", model="hf", model_kw=kw, precision=precision, checkpoint=checkpoint)
    units = [m for m in worker.model.modules() if type(m).__name__.startswith("FSDP")]
    out[(precision, checkpoint)] = (worker.step(x, y)[0], len(units))
# The FSDP2 x pipelining baseline (benchmarks/baselines/composed.py), one stage on this one process.
composed = {}
for precision, checkpoint in (("fp32", False), ("bf16", True)):
    worker.setup("fsdp2_pipeline", model="hf", model_kw={**kw, "stages": 1}, schedule="Schedule1F1B", microbatches=2,
                 pp=1, precision=precision, checkpoint=checkpoint)
    composed[(precision, checkpoint)] = worker.step(x, y)[0]
worker.shutdown()
print(repr((eager, out, composed)))
"""


def test_fsdp2_baseline_of_the_hf_llama_shards_each_block_and_starts_from_the_same_loss():
    """Suite 14's FSDP2 Llama baselines, on one process: one FSDP unit per decoder block plus the root,
    and the first loss of fp32 (with or without per-block checkpointing) is the unsharded model's; the
    FSDP2 x Schedule1F1B baseline (one stage here) too, and with bf16 and checkpointing it runs."""
    pytest.importorskip("transformers")
    import ast

    proc = subprocess.run([sys.executable, "-c", HF_FSDP_CHECK], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eager, out, composed = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert math.isclose(composed[("fp32", False)], eager, rel_tol=1e-5)
    assert math.isclose(composed[("bf16", True)], eager, rel_tol=5e-2) and composed[("bf16", True)] != eager
    layers = 4
    for (precision, checkpoint), (loss, units) in out.items():
        assert units == layers + 1
        if precision == "fp32":
            assert math.isclose(loss, eager, rel_tol=1e-5)
        else:
            assert math.isclose(loss, eager, rel_tol=5e-2) and loss != eager


def test_llama_stages_of_the_composed_baseline_compute_the_library_forward():
    """Suite 14's FSDP2 x pipelining Llama stages (benchmarks/baselines/composed.py) chained give the logits
    of the library's own LlamaForCausalLM forward (its rotary tables and causal mask)."""
    pytest.importorskip("transformers")
    from benchmarks.harness.llama_stage import LlamaStage
    from benchmarks.suites.training_features import hf_workload
    from benchmarks.harness.workloads import make_hf
    from examples.gpt import training_batches

    model = make_hf(hf_workload(True), 2)[0]
    x, _ = next(training_batches(2))
    with torch.no_grad():
        logits = LlamaStage(model, 1, 2)(LlamaStage(model, 0, 2)(x))
        torch.testing.assert_close(logits, model.m(input_ids=x).logits, rtol=1e-5, atol=1e-5)



TP_CHECK = """
import torch
from benchmarks.baselines.torch_group import TorchWorker
from benchmarks.suites.tensor_parallel import composed_workload, workload
from examples import llama_tp

sizes, batch, seq = workload(True)
x, y = llama_tp.batches(1, batch=batch, seq=seq, vocab=sizes["vocab"])[0]
eager = float(llama_tp.make_model(torch.float32, **sizes, stages=1)(x, y))
worker = TorchWorker(0, 1)
worker.init(worker.rendezvous_address(), 60.0)
out = {}
for sequence in (False, True):
    worker.setup("tp", model="llama_tp", model_kw=dict(sizes, stages=1), sequence=sequence)
    dtensors = sum(type(p).__name__ == "DTensor" for p in worker.model.parameters())
    out[sequence] = (worker.step(x, y)[0], dtensors)
worker.setup("tp_fsdp2_pipeline", model="llama_tp", model_kw=dict(sizes, stages=1), schedule="Schedule1F1B",
             microbatches=2, pp=1, tp=1, sequence=True)
composed = worker.step(x, y)[0]
worker.shutdown()
print(repr((eager, out, composed)))
"""


def test_torch_tensor_parallel_baselines_start_from_the_models_loss():
    """Suite 16's torch baselines on one process (tp=1): parallelize_module with and without
    SequenceParallel, the loss under loss_parallel, and TP -> FSDP2 -> Schedule1F1B, give the plain
    model's first loss; the divided modules' parameters became DTensors (and the norms' under SP)."""
    import ast

    proc = subprocess.run([sys.executable, "-c", TP_CHECK], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eager, out, composed = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    from benchmarks.suites.tensor_parallel import workload

    sizes = workload(True)[0]
    divided = 1 + 7 * sizes["layers"] + 1          # embed, 7 linears a block, head
    for sequence, (loss, dtensors) in out.items():
        assert math.isclose(loss, eager, rel_tol=1e-5), sequence
        assert dtensors == divided + (2 * sizes["layers"] + 1 if sequence else 0)     # SequenceParallel norms
    assert math.isclose(composed, eager, rel_tol=1e-5)


def test_torch_tensor_parallel_plan_divides_the_modules_piper_divides():
    """The baseline's plan (torchtitan's) splits exactly the modules examples/llama_tp.py's statements
    name, each the same way: columns as ColwiseParallel, rows as RowwiseParallel, the vocab's embedding
    row-wise and its output layer column-wise; the stages chain to the model's own loss."""
    import re

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from benchmarks.baselines.tensor_parallel import LlamaTPStage, llama_loss, plan
    from examples import llama_tp

    model = llama_tp.make_model(torch.float32, layers=2, stages=2)
    names = [n for n, _ in model.named_modules()]

    def matched(patterns):
        return {n for n in names for p in patterns if re.fullmatch(re.escape(p).replace(r"\*", "[^.]+"), n)}

    for sequence in (False, True):
        styles = plan(model, sequence=sequence)
        assert {n for n, s in styles.items() if type(s) is ColwiseParallel} == matched(llama_tp.COLUMNS) | {"head"}
        assert {n for n, s in styles.items() if type(s) is RowwiseParallel} == matched(llama_tp.ROWS) | {"embed"}
    x, y = llama_tp.batches(1)[0]
    with torch.no_grad():
        logits = LlamaTPStage(model, 1, 2)(LlamaTPStage(model, 0, 2)(x))
        torch.testing.assert_close(llama_loss(logits, y), model(x, y))


def test_the_tensor_parallel_suites_4d_plan_builds_on_8192_devices():
    """Suite 16's `piper check` point: the script it writes names a dp=64 x pp=16 x tp=8 mesh and plans."""
    from piper.compiler.analysis import compile_script
    from piper.dsl import load_strategy

    from benchmarks.suites.tensor_parallel import CHECK_MESH, CHECK_MICROBATCHES, plan_text

    script = load_strategy(plan_text(CHECK_MESH, CHECK_MICROBATCHES, zero=True))
    mesh, directives = script.build(None)
    assert mesh.world_size == 8192 and directives
    assert len(compile_script(script, regions={"PP": 16}).plans) == 8192


def test_piper_saves_for_backward_what_torch_tensor_parallelism_saves():
    """benchmarks/tp_saved_bytes.py at suite 16's quick sizes: TP=2 and TP=2 + SP keep the same
    bytes for their backward on both sides (Piper's cut into pieces too)."""
    from examples import llama_tp

    from benchmarks.suites.tensor_parallel import workload
    from benchmarks.tp_saved_bytes import piper_saved, torch_saved

    sizes, batch, seq = workload(True)
    data = llama_tp.batches(1, batch=batch, seq=seq, vocab=sizes["vocab"])[0]
    for sequence in (False, True):
        theirs = torch_saved(sequence, sizes, data)
        whole, cut = piper_saved(sequence, sizes, data)
        assert whole == cut and abs(whole - theirs) <= 0.01 * theirs, (sequence, theirs, whole, cut)



@pytest.mark.usefixtures("ray_cluster")
def test_the_dispatch_comparison_runs_the_three_systems_from_the_same_weights():
    """benchmarks/tp_dispatch.py at its tiny size on the CPU: eager torch, torch's TP on a mesh of one
    and Piper's TP plan at tp=1 start from the same weights (their first losses agree, else it
    stops) and each gets a median step."""
    from benchmarks.tp_dispatch import measure, one_rank_group

    device = torch.device("cpu")
    with one_rank_group(device):
        row = measure("tiny", device, steps=2, rounds=1)
    assert set(row["median_ms"]) == {"eager", "torch TP (DTensor)", "Piper TP"}
    assert all(ms > 0 for ms in row["median_ms"].values()) and row["eager_over"]["eager"] == 1.0
    losses = list(row["first_loss"].values())
    assert losses[0] > 0 and max(losses) - min(losses) <= 1e-5 * losses[0], row["first_loss"]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.full)])
def test_the_driver_loop_comparison_starts_both_sides_from_the_same_weights(world, tmp_path):
    """benchmarks/driver_loop.py at its tiny size: Piper's job.train and job.step against an eager loop
    (one device) or DDP's spawned ranks, their first losses equal (else it raises), each a step time."""
    from benchmarks.driver_loop import _token_file, compare

    row = compare(world, "tiny", _token_file(str(tmp_path), 16), steps=2, rounds=1)
    assert row["torch"] == ("eager loop" if world == 1 else "DDP (spawned ranks)")
    assert all(row[k] > 0 for k in ("torch_ms", "piper_train_ms", "piper_step_ms"))
    assert abs(row["first_loss"]["piper"] - row["first_loss"]["torch"]) <= 1e-5 * row["first_loss"]["torch"]
