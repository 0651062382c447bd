"""The IR, the statements and the compiler, without running anything: printed
forms, plans in action notation, simulated step counts, and the errors a bad
order gets."""
import pytest

import piper
from piper.frontend.capture import Program
from piper.compiler.actions import Action
from piper.compiler.plans import compile_ir
from piper.ir.dag import Node, format_ir, parse_ir, parse_key
from piper.job import plan
from piper.mesh import Mesh
from piper.compiler.simulate import simulate
from piper.ir.statements import apply_all, initial_ir
from tests.test_train import one_f_one_b, pipeline


def chain_plan(strategy, regions=2, **mesh):
    return plan(strategy, mesh=mesh, program=Program.chain(f"PP={regions}"))


def chain_ir(strategy, regions=2, **mesh):
    """The IR after the statements, before lowering."""
    mesh = Mesh.of(mesh)
    return apply_all(initial_ir(Program.chain(f"PP={regions}"), mesh), strategy.build(mesh)[1])


def test_node_tokens_parse_back():
    for token in ["2F0", "0UPD", "3BI12", "1BW0", "0SEND_F3>2.1", "2RECV_B3<0.1", "0ALL_REDUCE",
                  "0ALL_GATHER_F3", "1REDUCE_SCATTER", "1REDUCE_SCATTER_BW2", "0ALL_GATHER"]:
        assert parse_key(token).key == token
    assert parse_key("2F0") == Node("F", 2, 0)


def test_ir_text_round_trips():
    @piper.strategy
    def s(s):
        s.split("MB", 2)
        s.place("PP=0", s.mesh["pp"][0])
        s.place("PP=1", s.mesh["pp"][1])
        s.shard("batch", over="dp")
        s.shard("optimizer", "grads", over="dp")
        s.split("B")
        s.order("PP=0", ["F(MB=0)", "F(MB=1)", ["BI(MB=0)", "BW(MB=0)"]])

    ir = chain_ir(s, dp=2, pp=2)
    text = format_ir(ir)
    assert parse_ir(text) == ir
    assert "order 0F1 -> 0BI0" in text and "node 1BW1 @1,3" in text


def test_an_order_repeated_adds_its_edges_once():
    @piper.strategy
    def s(s):
        s.split("MB", 2)
        s.place("PP=0", s.mesh["pp"][0])
        s.place("PP=1", s.mesh["pp"][1])
        for _ in range(2):
            s.order("PP=0", ["F(MB=0)", "F(MB=1)", "B(MB=0)", "B(MB=1)"])

    ir = chain_ir(s, pp=2)
    assert len(set(ir.edges)) == len(ir.edges)
    assert sum(e.kind == "temporal" for e in ir.edges) == 3
    compiled = compile_ir(ir)
    assert len(set(compiled.ir.edges)) == len(compiled.ir.edges)


def test_gpipe_plan_in_action_notation():
    compiled = chain_plan(pipeline(2), pp=2)
    assert compiled.show() == (
        "rank 0: 0F0 0SEND_F0>1.0 0F1 0SEND_F1>1.0 0RECV_B0<1.0 0B0 0RECV_B1<1.0 0B1 0UPD\n"
        "rank 1: 1RECV_F0<0.0 1F0 1RECV_F1<0.0 1F1 1B0 1SEND_B0>0.0 1B1 1SEND_B1>0.0 1UPD")


def test_zero_collectives_are_placed():
    # GPipe: stage 0's backwards follow each other, so one reduce-scatter after the last.
    zero2 = chain_plan(pipeline(2, batch_axis="dp", zero=("optimizer", "grads")), pp=2, dp=2)
    plan0 = [a.key for a in zero2.plans[0]]
    assert plan0[-3:] == ["0REDUCE_SCATTER", "0UPD", "0ALL_GATHER"]
    assert zero2.plans[0][-3].group == (0, 1)   # mesh pp=2, dp=2: pp[0] is ranks 0 and 1
    # 1F1B: forwards come between stage 0's backwards B0 | B1 | B2 B3; each run's gradients are
    # reduce-scattered after it, so no device holds a full gradient buffer across microbatches.
    zero2 = chain_plan(pipeline(4, order=one_f_one_b, batch_axis="dp", zero=("optimizer", "grads")), pp=2, dp=2)
    plan0 = [a.key for a in zero2.plans[0]]
    assert [k for k in plan0 if "REDUCE_SCATTER" in k] == ["0REDUCE_SCATTER_B0", "0REDUCE_SCATTER_B1",
                                                           "0REDUCE_SCATTER_B3"]
    assert plan0[plan0.index("0B0") + 1] == "0REDUCE_SCATTER_B0"
    assert plan0[-3:] == ["0REDUCE_SCATTER_B3", "0UPD", "0ALL_GATHER"]
    assert {"0REDUCE_SCATTER_B0", "0REDUCE_SCATTER_B1", "0REDUCE_SCATTER_B3"} <= set(zero2.plans[0][-2].waits)
    dp = chain_plan(pipeline(4, order=one_f_one_b, batch_axis="dp"), pp=2, dp=2)
    assert [a.key for a in dp.plans[0]].count("0ALL_REDUCE") == 1       # replicated: once per step
    zero3 = chain_plan(pipeline(2, batch_axis="dp", zero=("optimizer", "grads", "params")), pp=2, dp=2)
    keys = [a.key for a in zero3.plans[0]]
    assert keys[0] == "0ALL_GATHER_F0" and "0ALL_GATHER" not in keys
    assert zero3.plans[0][keys.index("0B1")].release == (0,)   # freed after the last use


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_simulated_1f1b_and_gpipe_steps(p, m):
    gpipe = simulate(chain_plan(pipeline(m), regions=p, pp=p).plans)
    ofob = simulate(chain_plan(pipeline(m, order=one_f_one_b), regions=p, pp=p).plans)
    # Unit costs F=1, B=2: m(F+B) of work plus a (p-1)(F+B) bubble on every device.
    assert gpipe.step_time == ofob.step_time == (m + p - 1) * 3
    assert ofob.bubble(0) == (p - 1) * 3


def test_order_that_contradicts_data_flow_is_a_cycle_with_its_line():
    @piper.strategy
    def backwards_first(s):
        s.split("MB", 2)
        s.place("PP=0", s.mesh["pp"][0])
        s.place("PP=1", s.mesh["pp"][1])
        s.order("PP=1", ["B(MB=0)", "F(MB=0)"])

    with pytest.raises(piper.PiperError) as err:
        chain_plan(backwards_first, pp=2)
    diag = err.value.diagnostics[0]
    assert diag.code == "order-cycle"
    assert "1F0" in diag.message and "1B0" in diag.message
    assert diag.span.file.endswith("test_compiler.py")


def test_deadlock_is_shown_as_a_grid():
    send = Node("SEND", 0, 0, "F", 0, 1)
    recv = Node("RECV", 1, 0, "F", 0, 0)
    back = Node("SEND", 1, 0, "B", 0, 0)
    brecv = Node("RECV", 0, 0, "B", 0, 1)
    plans = {  # each device first waits for the other's message
        0: (Action(brecv, peer=1, tag=1), Action(Node("B", 0, 0), waits=(brecv.key,)), Action(send, peer=1, tag=0)),
        1: (Action(recv, peer=0, tag=0), Action(Node("F", 1, 0), waits=(recv.key,)), Action(back, peer=0, tag=1)),
    }
    with pytest.raises(piper.PiperError) as err:
        simulate(plans)
    diag = err.value.diagnostics[0]
    assert diag.code == "deadlock"
    assert "rank 0 at step 0" in diag.message and "rank 1 at step 0" in diag.message
    assert "*0RECV_B0<1.0" in diag.notes[0]


def test_unknown_microbatch_in_order():
    @piper.strategy
    def too_many(s):
        s.split("MB", 2)
        s.order("PP=0", ["F(MB=0)", "F(MB=5)"])

    with pytest.raises(piper.PiperError) as err:
        chain_plan(too_many, pp=1)
    assert err.value.code == "unknown-node"
    assert "2 microbatch" in err.value.diagnostics[0].notes[0]


def test_placed_twice_points_at_both_places():
    @piper.strategy
    def twice(s):
        s.place("PP=0", s.mesh["pp"][0])
        s.place("PP=0", s.mesh["pp"][1])

    with pytest.raises(piper.PiperError) as err:
        chain_plan(twice, pp=2)
    diag = err.value.diagnostics[0]
    assert diag.code == "placed-twice" and diag.labels[0].message == "first placed here"
    assert diag.labels[0].span.line == diag.span.line - 1


def test_collectives_in_different_orders_are_caught():
    a = Node("ALL_REDUCE", 0, devices=(0, 1))
    b = Node("ALL_REDUCE", 1, devices=(0, 1))
    plans = {0: (Action(a, group=(0, 1)), Action(b, group=(0, 1))),
             1: (Action(b, group=(0, 1)), Action(a, group=(0, 1)))}
    with pytest.raises(piper.PiperError) as err:
        simulate(plans)
    assert err.value.code == "collective-mismatch"
    assert "0ALL_REDUCE on rank 0 but 1ALL_REDUCE on rank 1" in err.value.diagnostics[0].message


def test_partial_order_and_bi_without_bw_are_warnings():
    @piper.strategy
    def partial(s):
        s.split("MB", 4)
        s.split("B")
        s.place("PP=0", s.mesh["pp"][0])
        s.place("PP=1", s.mesh["pp"][1])
        s.order("PP=0", ["F(MB=0)", "F(MB=1)", "BI(MB=0)", "BW(MB=0)", "BI(MB=1)"])

    compiled = chain_plan(partial, pp=2)
    codes = sorted({w.code for w in compiled.warnings})
    assert codes == ["bi-without-bw", "partial-order"]
    assert all(w.severity == "warning" and w.span.file.endswith("test_compiler.py") for w in compiled.warnings)
    # The full stdlib schedules order everything: no warnings.
    from piper.dsl import load_strategy
    full = plan(load_strategy("stdlib/zero_bubble.pps").bind(microbatches=4), mesh={"pp": 2},
                program=Program.chain("PP=2"))
    assert full.warnings == []
