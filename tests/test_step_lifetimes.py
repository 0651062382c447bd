"""What a step holds, for how long: a value kept by id (a region's output, a received activation) goes
after its last forward reader, and a sent tensor once an arrival proves it delivered
(`runtime/execution/value_lifetimes.py`, `compiler/received.py`); both were held to the step's end."""
import copy
import functools

import pytest
import torch

import piper
from piper.compiler.actions import Action
from piper.compiler.received import sends_received
from piper.dsl.script import load_strategy
from piper.ir.dag import Node
from piper.runtime.execution.value_lifetimes import last_readers
from piper.testing import single_device
from tests.test_train import gpt, gpt_batches

ONE_F_ONE_B = "use one_f_one_b(microbatches=4) on pp\n"


def _plans(script, mesh, regions=2):
    from piper.frontend.capture import capture
    from piper.job import plan

    model, batch = gpt(regions, torch.float64), gpt_batches(1)[0]
    program = capture(model, tuple(x[:4] for x in batch))
    return plan(load_strategy(script), mesh=mesh, program=program), program


def test_each_send_of_1f1b_is_proven_delivered_by_the_next_message_back():
    plans = _plans(ONE_F_ONE_B, {"pp": 2})[0].plans
    proven = sends_received(plans)
    # stage 0: the gradient of microbatch k proves its activation delivered
    assert proven[0] == {f"0RECV_B{k}<1.0": (f"0SEND_F{k}>1.0",) for k in range(4)}
    # stage 1: stage 0 sends microbatch k+2's activation only after it has k's gradient;
    # the last two gradients have nothing after them and are waited for at the step's end
    assert proven[1] == {"1RECV_F2<0.0": ("1SEND_B0>0.0",), "1RECV_F3<0.0": ("1SEND_B1>0.0",)}


def _action(op, mb, peer, tag, waits=(), phase=None):
    return Action(Node(op, 0, mb, phase or ("F" if op in ("SEND", "F") else "B"), 0, peer), peer, tag, None,
                  tuple(waits), ())


def test_a_wait_inside_an_overlapped_slot_proves_nothing_to_a_send_of_the_same_slot():
    back = _action("RECV", 0, 1, 6)
    a = [_action("SEND", 0, 1, 5), back, _action("B", 0, None, None, waits=(back.key,))]
    recv = _action("RECV", 0, 0, 5, phase="F")
    b = [recv, _action("F", 0, None, None, waits=(recv.key,)), _action("SEND", 0, 0, 6, phase="B")]
    assert sends_received({0: a, 1: b}) == {0: {a[1].key: (a[0].key,)}}
    # b's wait and its send back in one slot's stretch: the lanes may send before they wait
    assert sends_received({0: a, 1: b}, {1: [(1, 3)]}) == {}
    # a send back that is never waited for within the step proves nothing
    assert sends_received({0: a, 1: b[:2] + [_action("SEND", 0, 0, 7, phase="B")]}) == {}


def test_a_value_goes_after_its_last_forward_reader():
    compiled, program = _plans("use zbv(microbatches=2) on pp\n", {"pp": 2}, regions=4)
    plan = compiled.plans[1]      # ZBV's turn: 0's output arrives, region 1 reads it, 2 reads 1's, 2's is sent on
    assert {a.node.region for a in plan if a.node.op == "F"} == {1, 2}
    value = {(v.producer, v.index): v.id for v in program.values}
    readers = last_readers(plan, dict(enumerate(program.regions)), value)
    assert readers == {**{f"1F{mb}": ((value[(0, 0)], mb),) for mb in range(2)},
                       **{f"2F{mb}": ((value[(1, 0)], mb),) for mb in range(2)},
                       **{f"2SEND_F{mb}>3.0": ((value[(2, 0)], mb),) for mb in range(2)}}


def _held_at_the_end(worker):
    """Inside a worker: what the executor still holds by id when its plan's last entry is done."""
    ex = worker.executor
    end = ex._end_step

    def probe():
        ex.held_at_end = (sorted(ex.values), sorted(ex.sends))
        return end()
    ex._end_step = probe


def _read(worker):
    return worker.executor.held_at_end


@pytest.mark.usefixtures("ray_cluster")
def test_a_pipeline_step_holds_no_finished_value_or_delivered_send_to_its_end():
    import ray

    model, batches = gpt(2, torch.float64), gpt_batches(2)
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    expected, _ = single_device(copy.deepcopy(model), batches, optimizer)
    with piper.compile(model, batches[0], strategy=load_strategy(ONE_F_ONE_B), mesh={"pp": 2},
                       optimizer=optimizer) as job:
        ray.get([a.__ray_call__.remote(_held_at_the_end) for a in job.actors])
        losses = [job.step(*batch) for batch in batches]
        held = ray.get([a.__ray_call__.remote(_read) for a in job.actors])
    assert losses == pytest.approx(expected, rel=1e-12)
    assert held[0] == ([], [])                          # every activation's gradient came back
    assert held[1] == ([], ["1SEND_B2>0.0", "1SEND_B3>0.0"])     # nothing came after these
