"""`piper tune`: the search space, the budget, the outputs (no Ray: --verify is left to the benchmark)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from piper.frontend.capture import Program
from piper.cli import main
from piper.dsl import load_strategy
from piper.job import plan
from piper.compiler.memory_model import parse_bytes, predict_memory
from piper.compiler.tune import Candidate, candidates

ROOT = Path(__file__).resolve().parent.parent

MODEL = "examples/gpt.py:small_gpt"          # 4 PP regions


@pytest.fixture(scope="module")
def _cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache(_cache_dir, monkeypatch):
    """One empty cost cache for this module's searches: the model's regions are timed once."""
    monkeypatch.setenv("PIPER_CACHE", str(_cache_dir))


def test_parse_bytes():
    assert parse_bytes("8MiB") == 8 * 2**20
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1000") == 1000
    assert parse_bytes("1.5 KB") == 1500
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_candidates_follow_the_regions_and_the_batch():
    found = candidates(4, 16, regions=4)
    meshes = {(c.dp, c.pp) for c in found}
    assert meshes == {(4, 1), (2, 2), (1, 4)}
    # p regions on p devices: the one-region schedules; 2p regions on p devices: V and interleaved ones
    assert {c.schedule for c in found if c.pp == 4} == {"one_f_one_b", "gpipe", "zero_bubble"}
    assert {c.schedule for c in found if c.pp == 2} == {"zbv", "dualpipev", "interleaved_1f1b",
                                                        "interleaved_zero_bubble"}
    assert {c.data for c in found if c.dp > 1} == {"dp", "zero1", "zero2", "zero3"}
    assert all(16 % (c.dp * c.microbatches) == 0 for c in found)
    assert all(c.microbatches >= 2 * c.pp for c in found if c.schedule == "dualpipev")
    # every candidate is a script that compiles (the chain stands in for the model's regions)
    for c in found[::7]:
        plan(load_strategy(c.script()), program=Program.chain({"PP": 4}))


def test_candidate_script_has_its_mesh():
    c = Candidate(2, 2, "interleaved_1f1b", 8, 2, "zero3")
    assert c.script() == ("mesh dp=2, pp=2\nuse interleaved_1f1b(microbatches=8, virtual=2) on pp\n"
                          "use zero3() on dp\n")
    assert Candidate(4, 1, None, 2, None, "zero2").script() == "mesh dp=4\nuse zero2() on dp\nsplit MB into 2\n"


@pytest.mark.usefixtures("cache")
def test_tune_ranks_what_fits_and_writes_the_best(tmp_path, capsys):
    best = tmp_path / "best.pps"
    budget = "3MiB"
    assert main(["tune", "--model", MODEL, "--devices", "4", "--memory", budget, "--format", "json",
                 "-o", str(best), "--no-calibrate"]) == 0
    rows = json.loads(capsys.readouterr().out)["strategies"]
    assert rows and all(r["peak_bytes"] <= parse_bytes(budget) for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert rows[0]["exact_activations"]
    text = best.read_text()
    assert rows[0]["script"] in text and text.splitlines()[1].startswith("mesh ")
    # the best's predicted peak is the memory model's for its script at its microbatch size
    from piper.frontend.capture import capture
    from piper.frontend.models import example_batch, load_model

    model, module = load_model(MODEL)
    m, dp = rows[0]["microbatches"], rows[0]["mesh"]["dp"]
    program = capture(model, example_batch(module, 16 // (m * dp)))
    compiled = plan(load_strategy(best), program=program)
    assert max(p.peak for p in predict_memory(compiled, program).values()) == rows[0]["peak_bytes"]
    # a tighter budget keeps fewer; none at all is exit 1 with what would need to change
    assert main(["tune", "--model", MODEL, "--devices", "4", "--memory", "64KiB", "--no-calibrate"]) == 1
    err = capsys.readouterr().err
    assert "no-fit" in err and "raise --memory to at least" in err


@pytest.mark.usefixtures("cache")
def test_a_budget_that_only_recompute_fits_picks_recompute(tmp_path, capsys):
    """Below the smallest peak of every composition without `recompute`, the best that fits
    recomputes its PP regions; -o writes the statement, and the memory model agrees with the
    written script's prediction."""
    from piper.compiler.tune import Search

    _, every = Search(MODEL, 4, 2**40, 16).run()
    assert every and not any(r.candidate.recompute for r in every)    # nothing needed it
    budget = int(min(r.peak_bytes for r in every) * 0.9)
    best = tmp_path / "best.pps"
    assert main(["tune", "--model", MODEL, "--devices", "4", "--memory", str(budget), "--format", "json",
                 "-o", str(best), "--no-calibrate"]) == 0
    rows = json.loads(capsys.readouterr().out)["strategies"]
    assert rows and all(r["recompute"] and r["peak_bytes"] <= budget for r in rows)
    assert "recompute PP=*" in rows[0]["script"] and "recompute PP=*\n" in best.read_text()
    # the same candidate without recompute is predicted over the budget
    from dataclasses import replace

    from piper.compiler.tune import Candidate

    c = rows[0]
    plain = Candidate(c["mesh"]["dp"], c["mesh"]["pp"], c["schedule"], c["microbatches"], c["virtual"],
                      c["data_parallel"])
    search = Search(MODEL, 4, budget, 16)
    without, recomputing = search.evaluate(plain), search.evaluate(replace(plain, recompute=True))
    assert without.peak_bytes > budget and recomputing.peak_bytes < without.peak_bytes
    # and costs less: recomputing adds each region's forward (about a third of F + B) to its backward
    assert without.step_s < recomputing.step_s < 1.5 * without.step_s


@pytest.mark.usefixtures("cache")
def test_an_update_costs_its_call_and_its_elements():
    from piper.compiler import tune
    from piper.compiler.planning import plan
    from piper.dsl import load_strategy

    call, per_tensor, per_element = tune._update_seconds(elements=1 << 16)
    assert call > 0 and per_tensor > 0 and per_element > 0
    search = tune.Search("examples/gpt.py:small_gpt", 4, 2**40, 16)
    search.machine = {**search.machine, "update": 1e-9, "update_call": 0.01, "update_tensor": 0.001}
    program = search.reference.program
    for data, shards in (("dp", 1), ("zero3", 4)):
        c = tune.Candidate(4, 1, None, 1, None, data)
        compiled = plan(load_strategy(c.script(), file="<t>"), program=program)
        costs = search.compute_costs(compiled, program, c, {}, {})
        first = next(r for r in compiled.ir.regions if r.index == 0)
        elements = sum(program.params[p].nbytes for p in first.owned) / 4       # float32
        assert costs["0UPD"] == pytest.approx(0.01 + elements / shards * 1e-9)
    # a pipeline's units (no data-parallel collective) keep a bucket per parameter: a share per bucket
    c = tune.Candidate(1, 4, "one_f_one_b", 4)
    compiled = plan(load_strategy(c.script(), file="<t>"), program=program)
    costs = search.compute_costs(compiled, program, c, {}, {})
    first = next(r for r in compiled.ir.regions if r.index == 0)
    elements = sum(program.params[p].nbytes for p in first.owned) / 4
    assert len(first.owned) > 1
    assert costs["0UPD"] == pytest.approx(0.01 + (len(first.owned) - 1) * 0.001 + elements * 1e-9)


def test_tune_searches_tensor_parallel_sizes(tmp_path, monkeypatch):
    """With a tensor-parallel plan, tune's candidates include dp x pp x tp meshes; each is priced
    from the model measured at its own shards (the parameters predicted per device shrink), and
    a size the plan cannot divide is skipped with the capture's reason."""
    from piper.compiler.tune import Search, candidates

    monkeypatch.setenv("PIPER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(
        "import sys\nsys.path.insert(0, %r)\n" % str(ROOT) +
        "from examples.llama_tp import LlamaTP, batches\nimport torch\n"
        "def small():\n    torch.manual_seed(0)\n    return LlamaTP(stages=2)\n"
        "def example_batch(b):\n    return batches(count=1, batch=b)[0]\n")
    (tmp_path / "plan.pps").write_text(
        'strategy llama_tp(axis = tp):\n    """The example model\'s plan."""\n'
        '    shard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", '
        '"blocks.*.mlp.up" over axis\n'
        '    shard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over axis\n'
        '    shard vocab of "embed", "head" over axis\n')
    search = Search(f"{tmp_path / 'model.py'}:small", 4, 64 << 20, 8, tensor="plan.pps:llama_tp")
    found = candidates(4, 8, search.regions, tensor=search.tensor)
    assert {c.tp for c in found} == {1, 2, 4}
    plain = next(c for c in found if c.tp == 1 and c.dp == 2 and c.pp == 2 and c.schedule == "one_f_one_b"
                 and c.data == "dp")
    divided = next(c for c in found if c.tp == 2 and c.pp == 2 and c.schedule == "one_f_one_b"
                   and c.microbatches == plain.microbatches)       # dp=1: the batch whole on each device
    assert "use llama_tp() on tp" in divided.script() and "tp=2" in divided.script()
    one, two = search.evaluate(plain), search.evaluate(divided)
    assert one is not None and two is not None
    assert two.memory["params"] < one.memory["params"]
    assert search.evaluate(next(c for c in found if c.tp == 4)) is None
    assert "does not divide" in search.skipped[-1][1]
    from piper.compiler.tune_parallel import skip_lines, skip_summary

    (entry,) = skip_summary(search.skipped)
    assert entry["what"] == "tp=4" and entry["candidates"] == 1 and "does not divide" in entry["reason"]
    assert skip_lines([entry])[0].startswith("skipped tp=4 (1 candidate): ")
    # a plan without a `sequence` parameter: no sequence-parallel candidates, and the reason said
    assert not any(c.sequence for c in search.candidates()) and "sequence" in search.no_sequence
    assert skip_summary([], no_sequence=search.no_sequence)[0]["what"] == "sequence parallelism"
    # and where nothing fits, the error says what was skipped too
    from types import SimpleNamespace

    from piper.cli_tune import _nothing_fits

    notes = _nothing_fits(SimpleNamespace(devices=4), search, [one, two], 1, 8, 0.0).diagnostics[0].notes
    assert notes[1].startswith("skipped tp=4 (1 candidate): ") and notes[2].startswith("not searched: sequence")


def test_candidates_with_sequence_and_expert_parallelism():
    """`sequence`: every tp > 1 candidate again with sequence=true; `experts`: every dp > 1
    candidate again with its experts divided over dp (its script uses expert_parallel)."""
    plain = candidates(4, 16, 4, tensor="llama_tensor_parallel")
    both = candidates(4, 16, 4, tensor="llama_tensor_parallel", sequence=True, experts=True)
    assert not any(c.sequence or c.experts for c in plain)
    sp = [c for c in both if c.sequence]
    ep = [c for c in both if c.experts]
    assert {replace(c, sequence=False) for c in sp} == {c for c in both if c.tp > 1 and not c.sequence}
    assert {replace(c, experts=False) for c in ep} == {c for c in both if c.dp > 1 and not c.experts}
    assert all(c.tp > 1 for c in sp) and all(c.dp > 1 for c in ep)
    c = Candidate(2, 1, None, 1, None, "zero1", tp=2, tensor="llama_tensor_parallel", sequence=True, experts=True)
    assert c.script() == ("mesh dp=2, tp=2\nuse zero1() on dp\nuse expert_parallel() on dp\n"
                          "use llama_tensor_parallel(sequence=true) on tp\n")
    assert c.label() == "dp=2 pp=1 tp=2 sp · m=1 · zero1 · ep"


@pytest.mark.parametrize("value, code, words", [
    ("nosuch", "bad-flag", "no strategy is called `nosuch`"),
    ("plans.pps", "bad-flag", "takes a strategy's name or FILE.pps:NAME"),
    ("plans.pps:nosuch", "bad-flag", "no strategy is called `nosuch`"),
    ("missing.pps:tp", "bad-flag", "cannot import"),
    ("zero3", "bad-flag", "divides no module over tp"),
    ("plans.pps:unmatched", "unknown-module", "matches no module of the model"),
])
def test_an_unusable_tensor_parallel_flag_is_an_error(value, code, words, tmp_path, monkeypatch, capsys):
    """Not "no TP" with exit 0: a name that is no strategy, a malformed FILE:NAME, a strategy that
    shards no module, a plan whose pattern matches no module are errors before anything is measured."""
    monkeypatch.setenv("PIPER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plans.pps").write_text('strategy unmatched(axis = tp):\n'
                                        '    shard columns of "nosuch.*" over axis\n'
                                        '    shard rows of "blocks.*.mlp.down" over axis\n')
    assert main(["tune", "--model", str(ROOT / MODEL), "--devices", "4", "--memory", "8MiB", "--no-calibrate",
                 "--tensor-parallel", value]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"error[{code}]" in err and words in err
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())   # nothing measured
