"""The runtime's own time outside its computes as a cost model (piper/dispatch_costs.py) and as the
runtime records it (piper/runtime/dispatch.py, job.overheads()). No timing assertions: the runtime
test checks what is counted (ops, entries, non-negative seconds), the model tests exact arithmetic."""
from __future__ import annotations

import pytest

from piper.capture import Program
from piper.dispatch_costs import DispatchModel, other_threads
from piper.dsl.script import load_strategy
from piper.job import plan
from piper.simulate import simulate

ONE_F_ONE_B = "use one_f_one_b(microbatches=4) on pp\n"


def _plans(script: str = ONE_F_ONE_B, pp: int = 2, regions: int = 2):
    return plan(load_strategy(script), mesh={"pp": pp}, program=Program.chain(f"PP={regions}")).plans


def test_measured_takes_each_ops_mean_per_action_then_the_median_over_ranks_and_steps():
    steps = [{0: {"start": 1.0, "end": 5.0, "F": (4.0, 4), "SEND": (8.0, 4)},
              1: {"start": 3.0, "end": 7.0, "F": (8.0, 4), "RECV": (2.0, 4)}},
             {0: {"start": 2.0, "end": 6.0, "F": (12.0, 4), "SEND": (4.0, 4)}, 1: {}}]
    model = DispatchModel.measured(steps)
    assert model.per_op == {"F": 2.0, "SEND": 1.5, "RECV": 0.5}        # F: median of 1, 2, 3
    assert (model.start, model.end) == (2.0, 6.0)
    # single ranks' records work too
    assert DispatchModel.measured([steps[0][0]]).per_op == {"F": 1.0, "SEND": 2.0}


def test_an_op_not_measured_costs_what_its_kin_did():
    model = DispatchModel({"F": 1.0, "B": 3.0, "SEND": 5.0, "RECV": 7.0})
    assert model.per_action("BI") == model.per_action("BW") == 3.0
    assert model.per_action("UPD") == 2.0                  # the mean over measured computes (F, B)
    assert model.per_action("ALL_GATHER") == 6.0           # the mean over measured communication
    assert DispatchModel({"F": 1.0}).per_action("SEND") == 0.0


def test_each_compute_carries_its_own_share_and_the_communication_after_it():
    plans = _plans()
    model = DispatchModel({"F": 1.0, "B": 2.0, "UPD": 4.0, "SEND": 10.0, "RECV": 100.0}, start=1000.0, end=5000.0)
    extra = model.extra(plans)
    # rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 ...
    assert extra["0F0"] == 1000 + 1 + 10
    assert extra["0F1"] == 1 + 10 + 100
    assert extra["0UPD"] == 4 + 5000
    # rank 1 starts with a receive: it goes to the first compute, with `start`
    assert extra["1F0"] == 1000 + 100 + 1 + 100          # 1RECV_F0, 1F0, then 1RECV_F1 before 1B0
    # every action of a plan is counted once
    for rank, p in plans.items():
        keys = [a.key for a in p if a.node.is_compute]
        assert sum(extra[k] for k in keys) == pytest.approx(model.plan_seconds(p))


def test_folded_costs_lengthen_a_single_device_step_by_its_whole_runtime_time():
    plans = _plans(pp=1, regions=1)
    costs = {a.key: 1.0 for a in plans[0] if a.node.is_compute}
    model = DispatchModel({"F": 0.125, "B": 0.25, "UPD": 0.5}, start=0.5, end=1.0)
    base = simulate(plans, costs=costs).step_time
    folded = simulate(plans, costs=model.fold(plans, costs)).step_time
    assert folded - base == pytest.approx(model.plan_seconds(plans[0]))
    # the model carries over to another schedule of the same mesh: its own action counts
    gpipe = _plans("use gpipe(microbatches=4) on pp\n", pp=1, regions=1)
    assert simulate(gpipe, costs=model.fold(gpipe, costs)).step_time - simulate(gpipe, costs=costs).step_time == \
        pytest.approx(model.plan_seconds(gpipe[0]))


def test_an_overlapped_slot_timed_as_a_unit_gets_its_members_shares():
    from piper.interop import overlapped_slots

    from tests.test_slots import DUALPIPEV, compiled

    c = compiled(DUALPIPEV, (("pp", 2),))
    groups = overlapped_slots(c)
    slot = "&".join(groups[0])
    model = DispatchModel({"F": 1.0, "B": 2.0, "BI": 2.0, "BW": 2.0, "SEND": 0.0, "RECV": 0.0})
    folded = model.fold(c.plans, {slot: 10.0}, overlap=groups)
    extra = model.extra(c.plans)
    assert folded[slot] == 10.0 + sum(extra[k] for k in groups[0])


def test_other_threads_is_the_step_less_the_actions_and_the_threads_runtime_time():
    cpu_timings = [{0: {"0F0": 1.0, "0B0": 2.0, "step": 4.5}, 1: {"1F0": 1.0, "step": 1.5}}]
    overheads = [{0: {"start": 0.25, "end": 0.25, "F": (0.5, 1)}, 1: {"start": 0.0, "end": 0.0, "F": (0.25, 1)}}]
    assert other_threads(cpu_timings, overheads) == pytest.approx(0.375)    # median of 0.5 and 0.25


def test_the_runtime_reports_its_time_per_op_of_the_plan(ray_cluster):
    import torch

    import piper
    from tests.test_train import gpt, gpt_batches

    model = gpt(2, dtype=torch.float64)
    batches = gpt_batches(batch=4)
    with piper.compile(model, batches[0], strategy=load_strategy(ONE_F_ONE_B), mesh={"pp": 2}) as job:
        assert job.overheads() == {0: {}, 1: {}}             # before a step
        job.step(*batches[0])
        for cpu in (False, True):
            got = job.overheads(cpu=cpu)
            for rank, plan_ in job.compiled.plans.items():
                counts: dict[str, int] = {}
                for a in plan_:
                    counts[a.node.op] = counts.get(a.node.op, 0) + 1
                record = got[rank]
                assert {op: n for op, (_, n) in ((k, v) for k, v in record.items() if k not in ("start", "end"))} \
                    == counts
                assert all(v >= 0 for k, v in record.items() if k in ("start", "end"))
                assert all(sec >= 0 for k, (sec, _) in ((k, v) for k, v in record.items() if k not in ("start", "end")))
        model_ = DispatchModel.measured([job.overheads(cpu=True)])
        assert set(model_.per_op) == {"F", "B", "UPD", "SEND", "RECV"}
