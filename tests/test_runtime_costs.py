"""The runtime's own time outside its computes as a cost model (piper/compiler/runtime_costs.py) and as the
runtime records it (piper/runtime/execution/overheads.py, job.overheads()). No timing assertions: the runtime
test checks what is counted (ops, entries, non-negative seconds), the model tests exact arithmetic."""
from __future__ import annotations

import pytest

from piper.frontend.capture import Program
from piper.compiler.runtime_costs import RuntimeModel, other_threads
from piper.dsl.script import load_strategy
from piper.ir.dag import Node
from piper.job import plan
from piper.compiler.simulate import simulate

ONE_F_ONE_B = "use one_f_one_b(microbatches=4) on pp\n"


def _plans(script: str = ONE_F_ONE_B, pp: int = 2, regions: int = 2):
    return plan(load_strategy(script), mesh={"pp": pp}, program=Program.chain(f"PP={regions}")).plans


def _trace(clock_offset: float, t0: float, spans, done):
    """What a worker's `trace()` returns for one step: perf_counter times, its clock pair."""
    return {"clock": (100.0, 100.0 + clock_offset), "steps": [(t0, spans, done, 1)]}


def test_skews_and_latencies_from_traced_steps():
    """Rank 1's clock reads 10 s behind rank 0's; its step started 0.002 s after rank 0's. Rank 0 sent F0
    at 0.010 (its clock); rank 1 issued the receive at 0.004, blocked after it, and had F0 at 0.013: 3 ms
    from the send. Its F1 arrived while it computed: not a sample."""
    from piper.compiler.runtime_costs import receive_latencies, start_skews

    plans = _plans()
    rank0 = _trace(0.0, 0.0, [("0F0", 0.001, 0.009, 1), ("0SEND_F0>1.0", 0.010, 0.0101, 1),
                              ("0F1", 0.011, 0.02, 1), ("0SEND_F1>1.0", 0.0201, 0.0202, 1)], {})
    rank1 = _trace(10.0, -9.998, [("1RECV_F0<0.0", -9.996, -9.9959, 1), ("1F0", -9.9869, -9.98, 1),
                                  ("1RECV_F1<0.0", -9.9799, -9.9798, 1), ("1B0", -9.9797, -9.97, 1)],
                   {"1RECV_F0<0.0": -9.987, "1RECV_F1<0.0": -9.9798})
    assert start_skews([rank0, rank1]) == {0: 0.0, 1: pytest.approx(0.002)}
    assert receive_latencies([rank0, rank1], plans) == [pytest.approx(0.003)]
    model = RuntimeModel.measured([], [{"recorded": [rank0, rank1], "plans": plans}])
    assert model.latency == pytest.approx(0.003) and model.skew[1] == pytest.approx(0.002)


def test_measured_takes_each_ops_mean_per_action_then_the_median_over_ranks_and_steps():
    steps = [{0: {"start": 1.0, "end": 5.0, "F": (4.0, 4), "SEND": (8.0, 4)},
              1: {"start": 3.0, "end": 7.0, "F": (8.0, 4), "RECV": (2.0, 4)}},
             {0: {"start": 2.0, "end": 6.0, "F": (12.0, 4), "SEND": (4.0, 4)}, 1: {}}]
    model = RuntimeModel.measured(steps)
    assert model.per_op == {"F": 2.0, "SEND": 1.5, "RECV": 0.5}        # F: median of 1, 2, 3
    assert (model.start, model.end) == (2.0, 6.0)
    # single ranks' records work too
    assert RuntimeModel.measured([steps[0][0]]).per_op == {"F": 1.0, "SEND": 2.0}


def test_an_op_not_measured_costs_what_its_kin_did():
    model = RuntimeModel({"F": 1.0, "B": 3.0, "SEND": 5.0, "RECV": 7.0})
    assert model.per_action("BI") == model.per_action("BW") == 3.0
    assert model.per_action("UPD") == 2.0                  # the mean over measured computes (F, B)
    assert model.per_action("ALL_GATHER") == 6.0           # the mean over measured communication
    assert RuntimeModel({"F": 1.0}).per_action("SEND") == 0.0


def test_each_compute_carries_its_own_share_and_the_communication_after_it():
    plans = _plans()
    model = RuntimeModel({"F": 1.0, "B": 2.0, "UPD": 4.0, "SEND": 10.0, "RECV": 100.0}, start=1000.0, end=5000.0)
    extra = model.extra(plans)
    # rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 ...
    assert extra["0F0"] == 1 + 10
    assert extra["0F1"] == 1 + 10 + 100
    assert extra["0UPD"] == 4 + 5000
    # rank 1 starts with a receive: it goes to the first compute
    assert extra["1F0"] == 100 + 1 + 100          # 1RECV_F0, 1F0, then 1RECV_F1 before 1B0
    # every action of a plan is counted once; `start` goes on a leading action (`apply`)
    for rank, p in plans.items():
        keys = [a.key for a in p if a.node.is_compute]
        assert sum(extra[k] for k in keys) + model.start == pytest.approx(model.plan_seconds(p))


def test_folded_costs_lengthen_a_single_device_step_by_its_whole_runtime_time():
    plans = _plans(pp=1, regions=1)
    costs = {a.key: 1.0 for a in plans[0] if a.node.is_compute}
    model = RuntimeModel({"F": 0.125, "B": 0.25, "UPD": 0.5}, start=0.5, end=1.0)
    base = simulate(plans, costs=costs).step_time
    led, folded = model.apply(plans, costs)
    assert [a.key for a in led[0][1:]] == [a.key for a in plans[0]] and led[0][0].key == "0F-1"
    assert simulate(led, costs=folded).step_time - base == pytest.approx(model.plan_seconds(plans[0]))


def test_a_device_that_starts_late_delays_what_waits_for_it():
    """1F1B on 2 devices, F=1 B=2: rank 1 waits 1 for rank 0's first forward anyway, so a start 0.5 late
    costs nothing and one 1.5 late costs 0.5; rank 0 starting late delays everything."""
    plans = _plans()
    base = simulate(plans).step_time
    assert simulate(*RuntimeModel(skew={0: 0.0, 1: 0.5}).apply(plans, {})).step_time == pytest.approx(base)
    assert simulate(*RuntimeModel(skew={0: 0.0, 1: 1.5}).apply(plans, {})).step_time == pytest.approx(base + 0.5)
    assert simulate(*RuntimeModel(skew={0: 0.5, 1: 0.0}).apply(plans, {})).step_time == pytest.approx(base + 0.5)
    # a receive's latency: every message on the critical path arrives later
    slow = RuntimeModel(latency=0.25)
    assert simulate(plans, comm_cost=slow.comm_cost()).step_time > base
    assert slow.comm_cost(lambda node: 7.0)(Node("ALL_REDUCE", 0, devices=(0, 1))) == 7.0


def test_an_overlapped_slot_timed_as_a_unit_gets_its_members_shares():
    from piper.frontend.interop import overlapped_slots

    from tests.test_slots import DUALPIPEV, compiled

    c = compiled(DUALPIPEV, (("pp", 2),))
    groups = overlapped_slots(c)
    slot = "&".join(groups[0])
    model = RuntimeModel({"F": 1.0, "B": 2.0, "BI": 2.0, "BW": 2.0, "SEND": 0.0, "RECV": 0.0})
    folded = model.apply(c.plans, {slot: 10.0}, overlap=groups)[1]
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
        traced = {"recorded": job.traced(), "plans": job.compiled.plans}
        model_ = RuntimeModel.measured([job.overheads(cpu=True)], [traced])
        assert set(model_.per_op) == {"F", "B", "UPD", "SEND", "RECV"}
        assert set(model_.skew) == {0, 1} and min(model_.skew.values()) == 0.0 and model_.latency >= 0.0


def test_overheads_take_each_entry_less_its_compute_and_its_blocked_waits():
    """Stamps made by hand: entries 0F0 (compute 2 wall / 1.5 CPU), 0SEND, 0RECV, 0B0 (blocked 3 in its
    wait, compute 4 wall / 4 CPU); CPU seconds share the loop's CPU outside computes by wall time."""
    from types import SimpleNamespace

    from piper.runtime.execution.overheads import StepMarks, overheads

    plan = _plans()[0]
    keys = [a.key for a in plan[:6]]          # 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0
    m = StepMarks()
    m.start, m.first_cpu = (10.0, 100.0), 10.25
    walls = [100.5, 103.0, 103.5, 106.0, 106.5, 107.0]
    m.marks = list(zip(range(6), walls))
    m.waits = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]   # the wait before each stamp's entry ended (0B0: 3)
    m.loop_end, m.end = (19.75, 114.5), (20.0, 115.0)
    timings = {keys[0]: 2.0, keys[2]: 2.0, keys[5]: 4.0}
    cpu_timings = {keys[0]: 1.5, keys[2]: 2.0, keys[5]: 4.0}
    ex = SimpleNamespace(_marks=m, spec=SimpleNamespace(plan=plan), _spans={}, timings=timings,
                         cpu_timings=cpu_timings, _interleave=False)
    wall = overheads(ex)
    assert wall["start"] == 0.5 and wall["end"] == 0.5
    assert wall["F"] == (0.5 + 0.5, 2) and wall["SEND"] == (1.0, 2) and wall["RECV"] == (0.5, 1)
    assert wall["B"] == (0.5, 1)               # 7.5 from its stamp to the loop's end, less 4 compute, 3 waiting
    cpu = overheads(ex, cpu=True)
    assert cpu["start"] == 0.25 and cpu["end"] == 0.25
    # the loop's CPU outside computes: 19.75 - 10.25 - 7.5 = 2; its wall there: 3 -> each op gets 2/3
    assert cpu["SEND"] == pytest.approx((2 / 3, 2)) and cpu["B"] == pytest.approx((1 / 3, 1))
    assert sum(v[0] for k, v in cpu.items() if k not in ("start", "end")) == pytest.approx(2.0)
