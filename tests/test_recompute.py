"""The `recompute` statement: regions that keep only their inputs in forward and run it again in
backward train exactly as without it (float64, against one device), under 1F1B, ZB-H1 (split
backward) and DualPipeV (overlapped slots), and hold fewer saved activations."""
import pytest
import torch

import piper
from piper.dsl.script import load_strategy
from piper.mesh import Mesh
from piper.testing import train_both
from tests.test_train import assert_same_training, gpt, gpt_batches

SCHEDULES = {"one_f_one_b": 2, "zero_bubble": 2, "dualpipev": 4}    # schedule -> regions (2 devices)


def _script(schedule, recompute):
    return f"use {schedule}(microbatches=4) on pp\n" + (f"recompute {recompute}\n" if recompute else "")


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_recompute_trains_exactly(schedule):
    result = train_both(gpt(SCHEDULES[schedule], torch.float64), load_strategy(_script(schedule, "PP=*")),
                        mesh={"pp": 2}, batches=gpt_batches(2, batch=8))
    assert_same_training(result, rtol=1e-10, atol=1e-12)


def _memory(strategy):
    model = gpt(2, torch.float64)
    batch = gpt_batches(1, batch=8)[0]
    with piper.compile(model, batch, strategy=strategy, mesh={"pp": 2}, timeout=120) as job:
        job.step(*batch)
        return job.memory()


@pytest.mark.usefixtures("ray_cluster")
def test_recompute_lowers_the_saved_activation_peak():
    plain = _memory(load_strategy(_script("one_f_one_b", None)))
    recomputed = _memory(load_strategy(_script("one_f_one_b", "PP=*")))
    ratio = {r: recomputed[r]["activations_peak"] / plain[r]["activations_peak"] for r in (0, 1)}
    # The first stage holds several microbatches' activations: recomputed, only their inputs and
    # one microbatch's rerun. The last stage runs each backward right after its forward, so
    # recomputing there saves nothing (and costs nothing in bytes either).
    assert ratio[0] < 0.75 and ratio[1] <= 1.0, ratio
    assert recomputed[0]["step_peak"] < plain[0]["step_peak"]


@pytest.mark.usefixtures("ray_cluster")
def test_recompute_one_region_under_zero3_python_strategy():
    # Both regions on both devices: the recomputed one is gathered again for its backward.
    @piper.strategy
    def strategy(s):
        s.split("MB", 2)
        s.use(load_strategy("use zero3() on dp\n"))
        s.recompute("PP=1")
    result = train_both(gpt(2, torch.float64), strategy, mesh={"dp": 2}, batches=gpt_batches(2))
    assert_same_training(result, rtol=1e-10, atol=1e-12)


def _ir(strategy, regions=4, mesh=None):
    from piper.frontend.capture import Program
    from piper.job import build_strategy
    from piper.ir.statements import apply_all, initial_ir

    mesh, directives = build_strategy(strategy, {"pp": 2} if mesh is None else mesh)
    return apply_all(initial_ir(Program.chain({"PP": regions}), mesh), directives)


def test_script_and_python_mark_the_same_regions():
    @piper.strategy
    def python(s):
        s.use(load_strategy("use one_f_one_b(microbatches=2) on pp\n"))
        s.recompute("PP=1", "PP=3")
    script = load_strategy("use one_f_one_b(microbatches=2) on pp\nrecompute PP=1, PP=3\n")
    assert _ir(python).recompute == _ir(script).recompute == (1, 3)
    assert _ir(load_strategy("recompute PP=*\n"), mesh={}).recompute == (0, 1, 2, 3)


@pytest.mark.parametrize("text,code", [
    ("recompute PP=7\n", "unknown-region"),
    ("recompute XX=*\n", "unknown-region"),
])
def test_bad_recompute_script(text, code):
    with pytest.raises(piper.PiperError) as info:
        _ir(load_strategy(text), mesh={})
    assert info.value.code == code


@pytest.mark.parametrize("selector", ["F(MB=0)", "PP=0 MB=1"])
def test_recompute_takes_regions_only(selector):
    @piper.strategy
    def strategy(s):
        s.recompute(selector)
    with pytest.raises(piper.PiperError) as info:
        _ir(strategy, mesh={})
    assert info.value.code == "bad-recompute"


def test_recompute_of_a_pass_is_a_syntax_error():
    with pytest.raises(piper.PiperError) as info:
        load_strategy("recompute F(MB=0)\n").build(Mesh.of({}))
    assert info.value.diagnostics[0].span.line == 1


@pytest.mark.usefixtures("ray_cluster")
def test_recompute_with_clipping_under_dualpipev_lanes():
    # DualPipeV: overlapped F/B slots in lanes, whole and split backwards; every region recomputes,
    # and clipping holds every update to the end of the step.
    result = train_both(gpt(4, torch.float64), load_strategy(_script("dualpipev", "PP=*")), mesh={"pp": 2},
                        batches=gpt_batches(2, batch=8), clip_grad_norm=0.5)
    assert_same_training(result, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("text", ["recompute\n", "recompute PP\n", "recompute F(MB=0)\n"])
def test_recompute_without_a_region_is_named(text):
    with pytest.raises(piper.PiperError) as info:
        load_strategy(text).build(Mesh.of({}))
    assert info.value.code == "unexpected-token-in-selector"
