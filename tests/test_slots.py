"""How the executor regroups slots of several items (piper.compiler.slots), on real compiled plans."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from piper.frontend.capture import Program
from piper.dsl.script import load_strategy
from piper.frontend.interop import compute_slots
from piper.job import plan
from piper.compiler.slots import span, spans, whole_backwards

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def compiled(script: str, mesh: tuple):
    return plan(load_strategy(script), mesh=dict(mesh), program=Program.chain("PP=4"))


DUALPIPEV = "use dualpipev(microbatches=4) on pp\n"
DUALPIPEV_ZERO3 = DUALPIPEV + "use zero3() on dp\n"


def multi_slots(c, rank: int):
    """The worker's view of its slots: those of several computes."""
    return tuple(slot for slot in compute_slots(c, rank) if len(slot) > 1)


def own_units(c):
    return {r.index: {r.index} for r in c.ir.regions}


def test_whole_backward_items_run_as_one_pass_and_split_ones_stay_split():
    c = compiled(DUALPIPEV, (("pp", 2),))
    for rank in (0, 1):
        whole, skip = whole_backwards(c.plans[rank], multi_slots(c, rank))
        index = c.ir.index()
        assert whole and len(whole) == len(skip)
        for key in whole:
            bi = index[key]
            assert bi.op == "BI" and f"{bi.region}BW{bi.mb}" in skip
        # Items written BI(...) and BW(...) stay split, even when adjacent (DualPipeV's phase 3).
        split = [k for k in c.compute_order(rank) if index[k].op == "BI" and k not in whole]
        assert split
        for k in split:
            assert f"{index[k].region}BW{index[k].mb}" not in skip


def test_overlapped_slot_becomes_two_lanes_with_their_sends():
    c = compiled(DUALPIPEV, (("pp", 2),))
    plan0 = c.plans[0]
    found = spans(plan0, multi_slots(c, 0), own_units(c))
    assert found
    for start, s in found.items():
        assert plan0[start].key == s.lanes[0][0].key or plan0[start].key == s.lanes[1][0].key
        assert len(s.lanes) == 2
        kinds = sorted(lane[0].node.op for lane in s.lanes)
        assert kinds[0] in ("B", "BI") and kinds[1] == "F"
        for lane in s.lanes:
            head = lane[0].node
            for a in lane[1:]:
                if a.node.op == "SEND":       # a lane sends only what its own item made
                    assert (a.node.region, a.node.mb) == (head.region, head.mb)
        for a in s.before:
            assert a.node.op in ("RECV", "SEND", "ALL_GATHER")
        # every action of the stretch is run exactly once
        stretch = [a.key for a in plan0[s.start:s.stop]]
        regrouped = [a.key for a in s.before] + [a.key for lane in s.lanes for a in lane] + [a.key for a in s.after]
        assert sorted(stretch) == sorted(regrouped)


def test_gathers_after_a_lane_that_reads_the_same_unit_wait_for_the_lanes():
    c = compiled(DUALPIPEV_ZERO3, (("dp", 2), ("pp", 2)))
    moved = 0
    for rank in c.plans.representatives():
        for s in spans(c.plans[rank], multi_slots(c, rank), own_units(c)).values():
            lane_regions = {a.node.region for lane in s.lanes for a in lane}
            for a in s.before:
                if a.node.op == "ALL_GATHER":
                    pos = [a2.key for a2 in c.plans[rank]].index(a.key)
                    earlier = {x.node.region for x in c.plans[rank][s.start:pos] if x.node.is_compute}
                    assert a.node.region not in earlier     # never refills a unit a lane may free
            for a in s.after:
                assert a.node.op != "RECV" and a.node.region in lane_regions
                moved += 1
    assert moved                      # the case exists in this plan


def test_items_sharing_parameters_run_in_turn():
    c = compiled(DUALPIPEV, (("pp", 2),))
    shared = {r.index: {0} for r in c.ir.regions}       # as if every region read one tied unit
    assert spans(c.plans[0], multi_slots(c, 0), shared) == {}
    index = c.ir.index()
    slot = next(s for s in multi_slots(c, 0) if len({index[k].op == "F" for k in s}) == 2)
    assert span(c.plans[0], set(slot), own_units(c)) is not None


def test_simulator_costs_a_slot_by_its_timed_key():
    """job.timings() reports a slot run in lanes as 'a&b'; simulate(overlap=...) takes that as the slot's cost."""
    from piper.frontend.interop import overlapped_slots
    from piper.compiler.simulate import simulate

    c = compiled(DUALPIPEV, (("pp", 2),))
    groups = overlapped_slots(c)
    timed = "&".join(groups[0])
    sim = simulate(c.plans, costs={timed: 0.25}, overlap=groups)
    spans_ = [end - start for rank in sim.timeline for start, end, key in sim.timeline[rank] if key == timed]
    assert spans_ == [0.25]
    other = "&".join(groups[1])
    assert [end - start for r in sim.timeline for start, end, key in sim.timeline[r] if key == other] == [3.0]


def test_devices_sharing_cores_stretch_the_step():
    """simulate(cores=...): more devices computing than cores slows them all down (mean field)."""
    from piper.compiler.simulate import simulate

    c = plan(load_strategy("use gpipe(microbatches=8) on pp\n"), mesh={"pp": 4}, program=Program.chain("PP=4"))
    alone = simulate(c.plans)
    assert simulate(c.plans, cores=4).step_time == alone.step_time       # a core each: nothing changes
    shared = simulate(c.plans, cores=2)
    busy = sum(alone.busy.values()) / alone.step_time                       # devices computing on average
    assert busy > 2
    assert shared.step_time > alone.step_time
    # the work of all devices (busy-time sum) cannot finish faster than on 2 cores
    assert shared.step_time >= sum(alone.busy.values()) / 2 - 1e-9


def test_background_cpu_competes_for_the_cores_too():
    from piper.compiler.simulate import simulate

    c = plan(load_strategy("use gpipe(microbatches=8) on pp\n"), mesh={"pp": 4}, program=Program.chain("PP=4"))
    busy = simulate(c.plans).busy
    shared = simulate(c.plans, cores=2, background=6.0)
    # every device's actions plus its background, on two cores
    assert shared.step_time == pytest.approx((sum(busy.values()) + 4 * 6.0) / 2, rel=1e-3)


@functools.lru_cache(maxsize=None)
def layered_program(stages: int):
    """The example GPT with 4 blocks over `stages` PP stages; every block, the embeddings and the head an `L` region."""
    from examples.gpt import example_batch, make_model
    from piper.frontend.capture import capture

    model, _ = make_model(n_layer=4, n_regions=stages, layer_regions=True, n_embd=32, n_head=2, block_size=16)
    return capture(model, example_batch(4, block_size=16))


def feeds_of(program):
    return {r.index: {program.values[i.ref].producer for i in r.inputs if i.kind == "value"}
            for r in program.regions}


def test_a_stage_of_several_regions_runs_each_chain_in_one_lane():
    # 1F1B over 2 stages of 3 regions: each slot is one chain of forwards or backwards, so no lanes.
    program = layered_program(2)
    feeds = feeds_of(program)
    c = plan(load_strategy("use one_f_one_b(microbatches=4) on pp\n"), mesh={"pp": 2}, program=program)
    for rank in (0, 1):
        slots = multi_slots(c, rank)
        assert slots and all(len(s) == 3 for s in slots)
        assert spans(c.plans[rank], slots, own_units(c), feeds) == {}
        assert spans(c.plans[rank], slots, own_units(c)) != {}    # taken apart, the chain would race
    # DualPipeV: an overlapped [F, B] slot still has two lanes, each a whole chain in plan order.
    program = layered_program(4)
    feeds = feeds_of(program)
    c = plan(load_strategy(DUALPIPEV), mesh={"pp": 2}, program=program)
    found = spans(c.plans[0], multi_slots(c, 0), own_units(c), feeds)
    assert found
    for s in found.values():
        assert len(s.lanes) == 2
        for lane in s.lanes:
            computes = [a.node for a in lane if a.node.is_compute]
            assert len({n.region for n in computes}) >= 2 and len({n.mb for n in computes}) == 1
            order = [a.key for a in c.plans[0] if a.key in {a.key for a in lane}]
            assert [a.key for a in lane] == order
