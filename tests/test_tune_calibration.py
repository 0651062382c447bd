"""`piper tune` priced with the runtime's measured costs (`piper.compiler.tune_calibration`), and
candidates it cannot tell apart (no Ray: a `Calibration` is given, not measured)."""
from __future__ import annotations

import json

import pytest

from piper.cli import main
from piper import cli_tune
from piper.compiler.runtime_costs import RuntimeModel
from piper.compiler.tune import Candidate, Result, Search, group_notes, groups
from piper.compiler.tune_calibration import FLOOR, Calibration, compute_ratio, driver_seconds, relative_spread

MODEL = "examples/gpt.py:small_gpt"          # 4 PP regions
PIPE = Candidate(1, 4, "one_f_one_b", 1)     # one microbatch: every action on one path
NOTHING = RuntimeModel({"F": 0.0, "B": 0.0, "UPD": 0.0, "SEND": 0.0, "RECV": 0.0})


@pytest.fixture(scope="module")
def _cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache(_cache_dir, monkeypatch):
    monkeypatch.setenv("PIPER_CACHE", str(_cache_dir))


@pytest.fixture
def search(cache):
    return Search(MODEL, 4, 2**40, 16)


def _result(ms: float) -> Result:
    return Result(Candidate(4, 1, None, 1, None, "dp"), ms / 1e3, 1, 0.0)


def _cal(runtime=NOTHING, **kw) -> Calibration:
    return Calibration(runtime, **{"cores": 64, "external": 0.0, **kw})


def test_groups_join_the_predictions_that_overlap():
    rows = [_result(ms) for ms in (100, 105, 117, 118, 200, 210)]
    # ±8%: 100 ms reaches 117.4 ms; 118 starts a group; 200 another, and 210 overlaps it
    assert groups(rows, 0.08) == [1, 1, 1, 2, 3, 3]
    assert groups(rows, 0.0) == [1, 2, 3, 4, 5, 6]
    notes = group_notes(rows, groups(rows, 0.08), 0.08)
    assert notes[0].startswith("rows 1-3 are indistinguishable within ±8%") and notes[1].startswith("rows 5-6")
    assert len(notes) == 2          # a group of one says nothing
    assert "(assumed: no calibration)" in group_notes(rows, [1] * 6, 0.15, calibrated=False)[0]


def test_tolerance_is_the_model_error_or_the_noise_or_the_floor():
    rm = RuntimeModel()
    assert Calibration(rm, measured=0.1, predicted=0.1).tolerance == FLOOR
    # the pipeline beside it predicted 30% short (no wait gave both one scale): ±30%
    assert Calibration(rm, measured=0.1, predicted=0.1, fitted="p", fitted_measured=0.1,
                       fitted_predicted=0.07).tolerance == pytest.approx(0.3)
    assert Calibration(rm, measured=0.1, predicted=0.08).tolerance == pytest.approx(0.2)
    assert Calibration(rm, measured=0.1, predicted=0.1, spread=0.3).tolerance == 0.3


def test_the_other_candidates_error_sets_the_tolerance_and_the_run_the_scale():
    rm = RuntimeModel()
    cal = Calibration(rm, measured=0.2, predicted=0.1, check="b", check_measured=0.1, check_predicted=0.112)
    assert cal.scale == 2.0 and cal.error == pytest.approx(-0.5)
    assert cal.check_error == pytest.approx(0.12) and cal.tolerance == pytest.approx(0.12)
    assert Calibration(rm).scale == 1.0 and Calibration(rm).check_error is None


def test_the_calibration_runs_one_candidate_and_checks_on_another_mesh():
    from piper.compiler.tune import candidates
    from piper.compiler.tune_calibration import choose, pair

    first, other = pair(choose(candidates(4, 16, regions=4)))
    # pipeline sends and ZeRO-3's collectives, whole backwards; then another mesh
    assert (first.dp, first.pp, first.data) == (2, 2, "zero3") and first.schedule == "interleaved_1f1b"
    assert (other.dp, other.pp) != (2, 2)
    assert pair([first]) == [first] and pair([]) == []


def test_a_scale_multiplies_every_prediction(search):
    base = search.with_calibration(_cal(driver=0.001)).evaluate(PIPE).step_s
    scaled = search.with_calibration(_cal(driver=0.001, measured=0.3, predicted=0.2)).evaluate(PIPE).step_s
    assert scaled == pytest.approx(1.5 * base)


def test_the_driver_and_the_message_latency_add_what_they_measure(search):
    base = search.with_calibration(_cal()).evaluate(PIPE).step_s
    driven = search.with_calibration(_cal(driver=0.005)).evaluate(PIPE).step_s
    assert driven == pytest.approx(base + 0.005)
    # 1F1B on 4 devices, one microbatch: 3 activations forward and 3 gradients back, one after another
    late = RuntimeModel({**NOTHING.per_op}, latency=0.002)
    assert search.with_calibration(_cal(late)).evaluate(PIPE).step_s == pytest.approx(base + 6 * 0.002)


def test_the_runtime_work_per_action_lands_on_the_path(search):
    base = search.with_calibration(_cal()).evaluate(PIPE).step_s
    per = RuntimeModel({**NOTHING.per_op, "F": 0.001, "B": 0.001})
    # 4 forwards and 4 backwards in a row; each device's update runs beside the others'
    assert search.with_calibration(_cal(per)).evaluate(PIPE).step_s == pytest.approx(base + 8 * 0.001)
    started = RuntimeModel({**NOTHING.per_op}, start=0.003)
    assert search.with_calibration(_cal(started)).evaluate(PIPE).step_s == pytest.approx(base + 0.003)


def test_the_computes_scale_and_other_load_takes_cores(search):
    base = search.with_calibration(_cal()).evaluate(PIPE).step_s
    assert search.with_calibration(_cal(compute=2.0, update=2.0)).evaluate(PIPE).step_s == pytest.approx(2 * base)
    # the updates have a ratio of their own: doubling the computes' leaves the updates as they were
    computes = search.with_calibration(_cal(compute=2.0)).evaluate(PIPE).step_s
    updates = search.with_calibration(_cal(update=2.0)).evaluate(PIPE).step_s
    assert base < updates < computes < 2 * base and computes + updates == pytest.approx(3 * base)
    # four data-parallel devices compute at once: two cores left run them slower than 64
    dp = Candidate(4, 1, None, 1, None, "dp")
    free = search.with_calibration(_cal(cores=2), external=0.0).evaluate(dp).step_s
    loaded = search.with_calibration(_cal(cores=2), external=1.0).evaluate(dp).step_s
    roomy = search.with_calibration(_cal(cores=64)).evaluate(dp).step_s
    assert roomy < free < loaded


def test_compute_ratio_driver_and_spread_from_records():
    step = {0: {"0F0": 0.004, "0B0": 0.006, "step": 0.02}, 1: {"1F0": 0.002, "1B0": 0.002}}
    assert compute_ratio([step, step], {"0F0": 0.002, "0B0": 0.003, "1F0": 0.001, "1B0": 0.001}) == 2.0
    assert compute_ratio([step], {}) == 1.0
    # two devices whose clocks differ: device 1 starts 10 ms after device 0 and ends at 50 ms
    recorded = [{"clock": (0.0, 100.0), "steps": [(0.0, [("0F0", 0.0, 0.03, 1)], {}, 1)]},
                {"clock": (5.0, 100.0), "steps": [(5.01, [("1F0", 5.01, 5.05, 1)], {}, 1)]}]
    assert driver_seconds([0.06], [{"recorded": recorded}]) == pytest.approx(0.01)
    assert relative_spread([1.0, 1.0, 1.2]) == 0.0 and relative_spread([1.0, 1.1, 1.2]) == pytest.approx(0.1 / 1.1)


@pytest.mark.usefixtures("cache")
def test_tune_uses_the_cached_calibration_and_groups_what_it_cannot_tell_apart(monkeypatch, capsys):
    measured = _cal(RuntimeModel({"F": 1e-4, "B": 1e-4, "SEND": 5e-5, "RECV": 5e-5, "UPD": 1e-4}, latency=0.003),
                    cores=2, driver=0.004, measured=0.1, predicted=0.09, spread=0.02, candidate="measured")
    runs = []
    monkeypatch.setattr(cli_tune, "_calibrate_on", lambda search, c, log: runs.append(c) or measured)
    args = ["tune", "--model", MODEL, "--devices", "4", "--memory", "8MiB", "--format", "json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["strategies"]
    assert main(args) == 0 and len(runs) == 1           # measured once, then read from the cache
    assert json.loads(capsys.readouterr().out)["strategies"] == rows
    assert all(r["calibrated"] and r["tolerance"] == pytest.approx(0.1) for r in rows)
    assert [r["group"] for r in rows] == sorted(r["group"] for r in rows) and rows[0]["group"] == 1
    plain = json.loads(_out(main, args + ["--no-calibrate"], capsys))["strategies"]
    # the runtime's costs make every step dearer than the computes alone
    assert min(r["step_s"] for r in rows) > min(r["step_s"] for r in plain) + measured.driver
    assert not any(r["calibrated"] for r in plain)
    # the text names the groups and where the costs came from
    assert main(args[:-2]) == 0
    text = capsys.readouterr().out
    assert "group" in text and "measured on measured" in text
    assert ("indistinguishable within ±10%" in text) == any(n > 1 for n in
                                                             _sizes([r["group"] for r in rows]))


def _out(fn, args, capsys) -> str:
    assert fn(args) == 0
    return capsys.readouterr().out


def _sizes(numbers):
    return [numbers.count(g) for g in set(numbers)]


class _FakeJob:
    """Steps that take no time, with what `measure_steps` reads of a job."""

    def __init__(self):
        self.steps = 0

    def step(self, *batch):
        self.steps += 1
        return 0.0

    def timings(self, cpu=False):
        return {0: {"step": 0.0}}

    def memory(self):
        return {0: {"step_peak": 100 + self.steps}, 1: {"step_peak": 7}}


def test_verify_measures_the_other_load_and_predicts_for_it(search):
    from piper.compiler.tune import at_load, measure_steps

    job = _FakeJob()
    step, peak, load = measure_steps(job, (), 3)
    assert job.steps == 3 and peak == 103 and step >= 0 and load >= 0
    dp = Candidate(4, 1, None, 1, None, "dp")
    calibrated = search.with_calibration(_cal(cores=2))
    r = calibrated.evaluate(dp)
    assert at_load(search, r, 1.0) is None              # no calibration: nothing to predict again
    assert at_load(calibrated, r, 0.0) < at_load(calibrated, r, 1.0)


def test_a_collective_call_costs_what_was_measured_for_its_op_and_group_size():
    from piper.compiler.tune_calibration import call_cost

    measured = {("ALL_GATHER", 2): (0.002, 0.0004), ("REDUCE_SCATTER", 4): (0.009, 0.0012)}
    assert call_cost(measured, "ALL_GATHER", 2) == (0.002, 0.0004)
    # another group size: the nearest measured one, scaled by the ring's steps (n - 1) / (m - 1)
    assert call_cost(measured, "ALL_GATHER", 4) == pytest.approx((0.006, 0.0012))
    assert call_cost(measured, "REDUCE_SCATTER", 2) == pytest.approx((0.003, 0.0004))
    assert call_cost(measured, "ALL_REDUCE", 4) == (0.0, 0.0)          # never measured: its bytes alone
    assert call_cost(measured, "ALL_GATHER", 1) == (0.0, 0.0)


def test_zero3_pays_each_collective_call_on_the_path_and_on_the_cores(search):
    from piper.compiler.tune_calibration import calls_seconds

    zero3 = Candidate(4, 1, None, 1, None, "zero3")        # per device: 4 gathers forward, 3 backward, 4 reduce-scatters
    dp = Candidate(4, 1, None, 1, None, "dp")              # 4 all-reduces
    calls = {("ALL_GATHER", 4): (0.003, 0.001), ("REDUCE_SCATTER", 4): (0.004, 0.001), ("ALL_REDUCE", 4): (0.0, 0.0)}
    roomy = {"cores": 64}
    for c in (zero3, dp):
        base = search.with_calibration(_cal(**roomy)).evaluate(c).step_s
        priced = search.with_calibration(_cal(collectives=calls, **roomy)).evaluate(c).step_s
        if c is dp:
            assert priced == pytest.approx(base)
        else:
            # the first forward waits for its gather, every backward after the first for one more;
            # the last reduce-scatter ends the step
            assert priced > base + 0.003 + 0.004
    from piper.compiler.planning import plan
    from piper.dsl import load_strategy

    plans = {0: plan(load_strategy(zero3.script(), file="<t>"), program=search.reference.program).plans[0]}
    # per device: 7 gathers and 4 reduce-scatters at 1 ms of CPU each, less the runtime's 0.2 ms issuing each
    issuing = RuntimeModel({"ALL_GATHER": 0.0002, "REDUCE_SCATTER": 0.0002})
    assert calls_seconds(plans, calls, issuing) == pytest.approx(11 * 0.0008)


def test_the_update_ratio_and_the_collectives_come_from_the_run():
    from piper.compiler.tune_calibration import compute_ratio, is_update

    step = {0: {"0F0": 0.004, "0B0": 0.006, "0UPD": 0.001, "step": 0.02}}
    estimated = {"0F0": 0.002, "0B0": 0.003, "0UPD": 0.002}
    assert compute_ratio([step], estimated, lambda k: not is_update(k)) == 2.0
    assert compute_ratio([step], estimated, is_update) == 0.5
    assert is_update("12UPD") and not is_update("1F0") and not is_update("0ALL_GATHER_F0")


def test_a_compute_costs_a_ratio_of_its_profile_and_a_cost_per_call():
    from piper.compiler.tune_calibration import compute_fit

    # 4 sequences: 1 ms in the profile, 2 ms measured; 8 sequences: 2 ms and 3 ms
    assert compute_fit([(0.002, 0.001), (0.003, 0.002)]) == pytest.approx((1.0, 0.001))
    assert compute_fit([(0.003, 0.001), (0.005, 0.002)]) == pytest.approx((2.0, 0.001))
    # estimates too alike to tell the two apart, or a negative part: the plain ratio
    assert compute_fit([(0.002, 0.001), (0.0021, 0.00105)]) == pytest.approx((2.0, 0.0))
    assert compute_fit([(0.001, 0.001), (0.005, 0.002)])[1] == 0.0
    # the cost per call kept: the ratio is what is left
    assert compute_fit([(0.003, 0.001)], call=0.001) == pytest.approx((2.0, 0.001))


def test_the_calibration_checks_on_another_mesh_and_microbatch_size():
    from piper.compiler.tune import candidates
    from piper.compiler.tune_calibration import choose, pair

    first, other = pair(choose(candidates(4, 16, regions=4)), 16)
    assert (other.dp, other.pp) != (first.dp, first.pp)
    assert 16 // (other.dp * other.microbatches) != 16 // (first.dp * first.microbatches)


def test_a_cost_per_call_lands_on_each_forward_and_backward(search):
    base = search.with_calibration(_cal()).evaluate(PIPE).step_s
    # 1F1B, 4 devices, one microbatch: 4 forwards and 4 backwards on the path
    assert search.with_calibration(_cal(call=0.001)).evaluate(PIPE).step_s == pytest.approx(base + 8 * 0.001)


def test_each_collective_costs_the_calibrated_wait_and_a_pipeline_none(search):
    from piper.compiler.tune_calibration import with_wait

    # 1F1B on 4 devices: sends and receives, no collective
    base = search.with_calibration(_cal()).evaluate(PIPE).step_s
    assert search.with_calibration(_cal(wait=0.002)).evaluate(PIPE).step_s == pytest.approx(base)
    # plain dp on 4 devices: its all-reduces do (each region's update waits for one). With the
    # profile's measured computes the wait need not reach the path: region 0's update also waits
    # for the three updates before it, and where those and the backwards outlast the chain of
    # waited all-reduces (measured on a loaded machine: 1.6-1.9 ms per update, 1.4-2.0 ms per
    # backward) the step does not move. Without computes the step is that chain: one wait per
    # all-reduce, all 4 of them on the group's one stream.
    dp = Candidate(4, 1, None, 1, None, "dp")
    free = {"compute": 0.0, "update": 0.0}
    base = search.with_calibration(_cal(**free)).evaluate(dp).step_s
    assert search.with_calibration(_cal(wait=0.002, **free)).evaluate(dp).step_s == pytest.approx(base + 4 * 0.002)
    priced = with_wait(lambda node: 0.5, 0.25)
    kinds = {op: priced(type("N", (), {"op": op})()) for op in ("SEND", "RECV", "ALL_GATHER", "REDUCE_SCATTER",
                                                                  "ALL_REDUCE", "ALL_TO_ALL", "TP")}
    assert kinds == {"SEND": 0.5, "RECV": 0.5, "ALL_GATHER": 0.75, "REDUCE_SCATTER": 0.75, "ALL_REDUCE": 0.75,
                     "ALL_TO_ALL": 0.5, "TP": 0.5}


def test_the_wait_is_the_one_that_gives_two_structures_one_scale():
    from piper.compiler.tune_calibration import fit_wait

    # 20 collectives on the first's path, 5 on the second's: at 1 ms each both predict half their steps
    assert fit_wait(lambda w: (0.010 + 20 * w, 0.010 + 5 * w), (0.05, 0.025)) == pytest.approx(0.001)
    # not linear in the wait (the path changes): the secant still finds it
    curved = fit_wait(lambda w: (0.010 + 20 * w + 300 * w * w, 0.010 + 5 * w), (0.05, 0.025))
    p0, p1 = 0.010 + 20 * curved + 300 * curved ** 2, 0.010 + 5 * curved
    assert p0 / p1 == pytest.approx(2.0, rel=1e-4)
    # the first already predicted as long as it measured against the second, or the waits do not
    # tell them apart: no wait
    assert fit_wait(lambda w: (0.010 + 20 * w, 0.010 + 5 * w), (0.02, 0.025)) == 0.0
    assert fit_wait(lambda w: (0.010 + 5 * w, 0.010 + 5 * w), (0.05, 0.025)) == 0.0


def test_a_fitted_wait_and_scale_carry_to_a_third_structure(search):
    from piper.compiler.tune_calibration import fit_wait

    reference = Candidate(2, 2, "interleaved_1f1b", 2, 2, "zero3")
    pipeline = Candidate(1, 4, "one_f_one_b", 4)
    third = Candidate(4, 1, None, 2, None, "zero3")
    calls = {("ALL_GATHER", 2): (0.001, 0.0002), ("REDUCE_SCATTER", 2): (0.001, 0.0002),
             ("ALL_GATHER", 4): (0.002, 0.0003), ("REDUCE_SCATTER", 4): (0.002, 0.0003)}
    # the machine: 20 ms more per collective and everything 1.5x what the costs say
    truth = search.with_calibration(_cal(collectives=calls, wait=0.02))
    steps = {c: 1.5 * truth.evaluate(c).step_s for c in (reference, pipeline, third)}
    # one scale alone, from the reference, misses the pipeline
    plain = search.with_calibration(_cal(collectives=calls, measured=steps[reference],
                                         predicted=search.with_calibration(_cal(collectives=calls))
                                         .evaluate(reference).step_s))
    missed = abs(plain.evaluate(pipeline).step_s / steps[pipeline] - 1)
    assert missed > 0.01

    def predict(w):
        at = search.with_calibration(_cal(collectives=calls, wait=w))
        return at.evaluate(reference).step_s, at.evaluate(pipeline).step_s

    wait = fit_wait(predict, (steps[reference], steps[pipeline]))
    assert wait == pytest.approx(0.02, rel=1e-3)
    fitted = _cal(collectives=calls, wait=wait, measured=steps[reference], predicted=predict(wait)[0])
    assert fitted.scale == pytest.approx(1.5, rel=1e-3)
    for c in (pipeline, third):
        assert search.with_calibration(fitted).evaluate(c).step_s == pytest.approx(steps[c], rel=missed / 10)


def test_the_calibration_fits_its_wait_beside_a_pipeline():
    from piper.compiler.tune import candidates
    from piper.compiler.tune_calibration import choose, pair, with_pipeline

    ordered = choose(candidates(4, 16, regions=4))
    first, pipe, other = with_pipeline(pair(ordered, 16), ordered)
    assert (first.dp, first.data) == (2, "zero3") and (other.dp, other.pp) != (first.dp, first.pp)
    assert pipe.dp == 1 and pipe.pp == 4 and pipe.schedule == "one_f_one_b"
    assert with_pipeline([pipe, other], ordered) == [pipe, other]       # a pipeline first: nothing to add


def test_the_pipeline_beside_the_calibration_brings_a_third_microbatch_size():
    from piper.compiler.tune import candidates
    from piper.compiler.tune_calibration import choose, pair, with_pipeline

    ordered = choose(candidates(4, 16, regions=4))
    runs = with_pipeline(pair(ordered, 16), ordered, 16)
    sizes = [16 // (c.dp * c.microbatches) for c in runs]
    assert len(set(sizes)) == 3, [c.label() for c in runs]
    assert runs[1].dp == 1 and runs[1].pp == 4 and sizes[1] == 2 * sizes[0]     # the nearest unseen size


def test_the_scale_is_pooled_over_the_runs_and_the_tolerance_is_a_held_out_error():
    from piper.compiler.tune_calibration import pool

    scale, held_out = pool([1.2, 0.9, 1.0], [1.0, 1.0, 1.0])
    assert scale == pytest.approx((1.2 * 0.9) ** (1 / 3))
    # each run predicted with the scale of the other two: 0.9 with sqrt(1.2 x 1.0) is the worst
    assert held_out == pytest.approx((1.2 * 1.0) ** 0.5 / 0.9 - 1)
    assert pool([2.0], [1.0]) == (pytest.approx(2.0), 0.0)          # one run: its own, nothing held out
    cal = _cal(RuntimeModel(), measured=0.05, predicted=0.04, pooled=1.1, held_out=0.12, spread=0.05)
    assert cal.scale == 1.1 and cal.tolerance == 0.12


def _record(c: Candidate, program, step_s: float) -> dict:
    """What `measure_together` records of a job whose steps all take `step_s`, and nothing else."""
    from piper.compiler.planning import plan
    from piper.dsl import load_strategy

    compiled = plan(load_strategy(c.script(), file="<t>"), program=program)
    ranks = range(c.dp * c.pp)
    quiet = {"clock": (0.0, 0.0), "steps": []}
    return {"times": [step_s] * 3, "external": [0.0] * 3, "collectives": {},
            "cpu_timings": [{r: {"step": 0.0} for r in ranks}] * 3,
            "cpu_overheads": [{r: {"start": 0.0, "end": 0.0} for r in ranks}] * 3,
            "traced": [{"recorded": [quiet for _ in ranks], "plans": compiled.plans}] * 3, "compiled": compiled}


def test_the_calibration_fits_the_wait_on_its_pipeline_and_checks_the_third(search):
    reference = Candidate(2, 2, "interleaved_1f1b", 2, 2, "zero3")
    pipeline = Candidate(1, 4, "one_f_one_b", 4)
    third = Candidate(4, 1, None, 2, None, "zero3")
    # the three runs measured as 15 ms more per collective and 1.3x the rest would make them
    truth = search.with_calibration(_cal(RuntimeModel(), cores=search.machine["cores"], wait=0.015))
    steps = [1.3 * cli_tune._predicted(truth, c) for c in (reference, pipeline, third)]
    runs = [_record(c, search.reference.program, s) for c, s in zip((reference, pipeline, third), steps)]
    cal = cli_tune.calibration_from(search, [reference, pipeline, third], runs)
    assert cal.wait == pytest.approx(0.015, rel=1e-2) and cal.fitted == pipeline.label()
    assert cal.scale == pytest.approx(1.3, rel=1e-2) and cal.check == third.label()
    assert abs(cal.check_error) < 0.01 and abs(cal.fitted_error) < 0.01
    # two runs: no pipeline to fit a wait on, a scale pooled over both; a wait given is kept
    two = cli_tune.calibration_from(search, [reference, third], [runs[0], runs[2]])
    assert two.wait == 0.0 and not two.fitted and abs(two.check_error) > abs(cal.check_error)
    assert two.pooled and two.tolerance >= two.held_out > abs(two.check_error)
    assert cli_tune.calibration_from(search, [reference], runs[:1], wait=0.004).wait == 0.004
    # a third run that the wait predicts worse than none: the wait is noise of the two, and dropped
    plain = search.with_calibration(_cal(RuntimeModel(), cores=search.machine["cores"]))
    runs[2] = _record(third, search.reference.program, 1.3 * cli_tune._predicted(plain, third))
    noise = cli_tune.calibration_from(search, [reference, pipeline, third], runs)
    assert noise.wait == 0.0 and noise.fitted_wait == pytest.approx(0.015, rel=1e-2)
    assert abs(noise.fitted_error) > 0.01 and noise.tolerance >= abs(noise.fitted_error)


@pytest.mark.usefixtures("cache")
def test_tune_says_how_far_the_pipeline_beside_the_calibration_was_predicted(monkeypatch, capsys):
    runtime = RuntimeModel({"F": 1e-4, "B": 1e-4, "SEND": 5e-5, "RECV": 5e-5, "UPD": 1e-4}, latency=0.003)
    measured = _cal(runtime, cores=2, measured=0.1, predicted=0.1, spread=0.02, candidate="measured",
                    fitted="the pipeline", fitted_measured=0.1, fitted_predicted=0.13, fitted_wait=0.04)
    monkeypatch.setattr(cli_tune, "_calibrate_on", lambda search, c, log: measured)
    args = ["tune", "--model", MODEL, "--devices", "4", "--memory", "8MiB", "--batch-size", "8"]
    assert main(args + ["--recalibrate"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    # the wait was not kept (0 ms); the pipeline's +30% sets the groups' tolerance
    assert "0.00 ms more per collective, fitted beside the pipeline, which it predicts +30%" in text
    rows = json.loads(_out(main, args + ["--format", "json"], capsys))["strategies"]
    assert all(r["tolerance"] == pytest.approx(0.3) for r in rows)
