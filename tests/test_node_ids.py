"""Integer node ids in the compiler: the positions a pass hands on are those a
look-up by key finds, the scheduler's packed heap entries order as the
priorities they replace, and the simulator's bookkeeping for one replica per
group gives what simulating every device gives."""
from __future__ import annotations

import pytest

from piper.frontend.capture import Program
from piper.compiler.plans import _compute_entries, _priority, compile_ir, schedule
from piper.dsl import load_strategy
from piper.ir.dag import COMPUTE
from piper.ir.lower import add_transfers, resolve_placement
from piper.compiler.simulate import simulate, verify
from piper.ir.statements import apply_all, initial_ir

CASES = [
    ("mesh dp=2, pp=4\nuse one_f_one_b(microbatches=6) on pp\nuse zero3() on dp\n", 4),
    ("mesh dp=2, pp=2\nuse interleaved_1f1b(microbatches=4) on pp\nuse zero2() on dp\n", 4),
    ("mesh pp=2\nuse dualpipev(microbatches=4) on pp\n", 4),
    ("mesh pp=4\nuse zbv(microbatches=4) on pp\n", 8),
    ("mesh pp=3\nuse zero_bubble(microbatches=5) on pp\n", 3),
    ("mesh dp=4\nuse zero3() on dp\n", 3),
]


def lowered(text: str, regions: int):
    mesh, directives = load_strategy(text, file="case.pps").build(None)
    return resolve_placement(apply_all(initial_ir(Program.chain({"PP": regions}), mesh), directives), [])


@pytest.mark.parametrize("text,regions", CASES)
def test_transfers_hand_on_the_edge_ids_a_look_up_finds(text, regions):
    ir = add_transfers(lowered(text, regions))
    handed = ir.edge_ids()
    ir._indexes.pop("ids")                     # look every end up by key instead
    assert ir.edge_ids() == handed
    assert len(handed[0]) == len(ir.edges)


@pytest.mark.parametrize("text,regions", CASES)
def test_packed_heap_entries_order_as_priority_then_key(text, regions):
    computes = [n for n in add_transfers(lowered(text, regions)).nodes if n.op in COMPUTE]
    numbers = list(range(7, 7 + len(computes)))
    entries = _compute_entries(computes, numbers, 10 ** 6)
    assert [e % 10 ** 6 for e in entries] == numbers
    by_entry = [n.key for _, n in sorted(zip(entries, computes))]
    assert by_entry == [n.key for n in sorted(computes, key=lambda n: (_priority(n), n.key))]


def test_schedule_reports_an_edge_to_an_unknown_node():
    ir = add_transfers(lowered(*CASES[0]))
    from piper.ir.dag import Edge

    broken = ir.with_(edges=ir.edges + (Edge("0F0", "9F9"),))
    with pytest.raises(AssertionError, match="unknown node"):
        schedule(broken)


@pytest.mark.parametrize("text,regions", CASES)
def test_one_replica_per_group_simulates_as_every_device(text, regions):
    compiled = compile_ir(lowered(text, regions))
    every = simulate(dict(compiled.plans), comm_cost=lambda n: 0.5)
    replicas = simulate(compiled.plans.representatives(), comm_cost=lambda n: 0.5)
    assert replicas.step_time == every.step_time
    assert {r: every.timeline[r] for r in replicas.timeline} == replicas.timeline
    verified = verify(compiled)
    assert verified.timeline == {} and verified.busy == simulate(compiled.plans.representatives()).busy


def _waits_of(ir, order) -> dict[str, list[str]]:
    """Node key -> the receives and collectives feeding it by a data edge, by key look-ups:
    what `waits_by_number` finds by number."""
    from piper.compiler.plan_waits import WAITABLE, Feeds

    waitable = {n.key for n in order if n.op in WAITABLE}
    found = Feeds()
    for e in ir.edges:
        if e.src in waitable and e.kind == "data":
            found.add(e.src, e.dst)
    return found.waits_of


def _table_after_collectives(text: str, regions: int):
    """`compile_ir`'s table once the collectives have joined it, and the order."""
    from piper.compiler.plans import place_collectives, schedule_table
    from piper.ir.lower import lower_transfers, zero_levels

    table = lower_transfers(lowered(text, regions))
    order, computes_at = schedule_table(table)
    order, (src, dst), _ = place_collectives(table, order, zero_levels(table.ir), computes_at)
    table.src += src
    table.dst += dst
    return table, order


@pytest.mark.parametrize("text,regions", CASES + [
    ("mesh dp=2, pp=2\nuse one_f_one_b(microbatches=12) on pp\nuse zero3() on dp\n", 2)])
def test_waits_by_number_are_those_a_look_up_finds(text, regions):
    from piper.compiler.plan_waits import waits_by_number

    table, _ = _table_after_collectives(text, regions)
    found = waits_by_number(table)
    compiled = compile_ir(lowered(text, regions))
    assert {table.key(k): [table.key(s) for s in feeds] for k, feeds in found.items()} == \
        _waits_of(compiled.ir, compiled.order)
    assert max(map(len, found.values())) > 8 or "microbatches=12" not in text    # a node fed by many


@pytest.mark.parametrize("text,regions", CASES)
def test_compile_ir_makes_on_read_what_the_passes_on_objects_make(text, regions):
    """`Compiled.ir`, `.order` and the plans, made from the table when read, are what the
    passes give an IR of objects: `add_transfers`, `schedule`, `add_collectives`, `project`."""
    from piper.compiler.plans import _with_new_edges, add_collectives, project
    from piper.ir.lower import zero_levels

    compiled = compile_ir(lowered(text, regions))
    ir = add_transfers(lowered(text, regions))
    order, extra, release = add_collectives(ir, schedule(ir), zero_levels(ir))
    assert compiled.order == order
    assert compiled.ir == ir.with_(nodes=tuple(order), edges=_with_new_edges(ir, extra))
    plans = project(compiled.ir, order, release)
    assert all(compiled.plans[r] == plans[r] for r in range(compiled.ir.mesh.world_size))


@pytest.mark.parametrize("text,regions", CASES)
def test_the_replay_as_plans_are_made_is_verifys_simulation(text, regions):
    from piper.compiler.simulate import _Run

    compiled = compile_ir(lowered(text, regions))
    assert compiled.plans.replays       # known on the walk: nothing simulated yet
    assert compiled.plans._replay is not None
    replayed = compiled.plans.replayed
    real = _Run(compiled.plans.representatives(), timeline=False).run()
    assert replayed is not None
    assert (replayed.step_time, list(replayed.busy.items())) == (real.step_time, list(real.busy.items()))
    assert verify(compiled).busy == real.busy


def test_a_wait_on_a_later_receive_stops_the_replay_and_verify_finds_the_deadlock():
    from piper.compiler.plans import Compiled, project
    from piper.diagnostics import PiperError

    compiled = compile_ir(lowered("mesh pp=2\nuse gpipe(microbatches=2) on pp\n", 2))
    order = list(compiled.order)
    recv = next(i for i, n in enumerate(order) if n.op == "RECV")
    consumer = next(i for i, n in enumerate(order) if i > recv and n.op == "F" and n.devices == order[recv].devices)
    order.insert(recv, order.pop(consumer))      # the forward now comes before the receive it waits for
    plans = project(compiled.ir, order, {})
    assert plans.replayed is None and not plans.replays
    with pytest.raises(PiperError) as err:
        verify(Compiled(compiled.ir, order, plans, compiled.zero))
    assert err.value.code == "deadlock" and f"*{order[recv].key}" in err.value.diagnostics[0].notes[0]


@pytest.mark.parametrize("split_backward", [False, True])
def test_transfers_to_several_consumers_on_one_group(split_backward):
    """Region 0's first output goes to regions 1 and 2 (both on device 1) and 3; its second, not
    differentiable, to 2 and then 1. Each value crosses to device 1 once, named after its first
    consumer there, whose receives feed the other; the gradients come back one per consumer."""
    from types import SimpleNamespace as R

    from piper.frontend.directives import Place, Split
    from piper.mesh import Mesh
    from piper.frontend.selectors import Selector
    from piper.ir.statements import apply

    regions = [R(index=i, tags=(("PP", i),), params=(f"w{i}",), loss=i == 3) for i in range(4)]
    values = [R(producer=0, index=0, consumers=(1, 2, 3), differentiable=True),
              R(producer=0, index=1, consumers=(2, 1), differentiable=False),
              R(producer=1, index=0, consumers=(3,), differentiable=True),
              R(producer=2, index=0, consumers=(3,), differentiable=True)]
    mesh = Mesh.of("pp=3")
    ir = apply(initial_ir(R(regions=regions, values=values), mesh), Split("MB", 3))
    if split_backward:
        ir = apply(ir, Split("B"))
    for region, device in ((0, 0), (1, 1), (2, 1), (3, 2)):
        ir = apply(ir, Place(Selector(None, (("PP", region),)), mesh.group({"pp": device})))
    lowered_ir = add_transfers(resolve_placement(ir, []))
    handed = lowered_ir.edge_ids()
    lowered_ir._indexes.pop("ids")
    assert lowered_ir.edge_ids() == handed
    keys = {n.key for n in lowered_ir.nodes}
    edges = {(e.src, e.dst) for e in lowered_ir.edges}
    for mb in range(3):
        assert {("1RECV_F%d<0.0" % mb, "1F%d" % mb), ("1RECV_F%d<0.0" % mb, "2F%d" % mb)} <= edges
        assert {("2RECV_F%d<0.1" % mb, "2F%d" % mb), ("2RECV_F%d<0.1" % mb, "1F%d" % mb)} <= edges
        assert "2RECV_F%d<0.0" % mb not in keys and "1RECV_F%d<0.1" % mb not in keys
        assert {"1SEND_B%d>0.0" % mb, "2SEND_B%d>0.0" % mb} <= keys          # a gradient per consumer
        assert not any(k.startswith(("1SEND_B%d>0.1" % mb, "2SEND_B%d>0.1" % mb)) for k in keys)
        assert ("0F%d" % mb, "1F%d" % mb) not in edges                      # the transfer replaces it


@pytest.mark.parametrize("text,regions", CASES)
def test_entries_from_the_passes_columns_are_those_read_from_the_nodes(text, regions):
    from itertools import compress

    from piper.compiler.schedule import _COMPUTE, _entries
    from piper.ir.lower import lower_transfers

    table = lower_transfers(lowered(text, regions))
    at = list(compress(range(len(table.ops)), map(_COMPUTE.__contains__, table.ops)))
    assert table.passes
    from_passes = _entries(table, at)
    table.passes = None
    assert from_passes == _entries(table, at)


@pytest.mark.parametrize("text,regions", CASES)
def test_statements_hand_on_the_edge_ids_and_pass_positions_a_look_up_finds(text, regions):
    from piper.ir.lower import _pass_positions

    ir = lowered(text, regions)           # split, order, place: each hands the positions on
    handed, passes = ir.known_ids(), ir._indexes.get("pass_at")
    # `split MB` makes both; `split B` makes new nodes, and `place` of nodes unsplit keeps none
    split_mb_only = "microbatches" in text and not any(s in text for s in ("zero_bubble", "zbv", "dualpipev"))
    assert (handed is not None) == (passes is not None) == split_mb_only
    if split_mb_only:
        from piper.ir.lower import temporal_edges

        handed_temporal = temporal_edges(ir)
        assert ir._indexes.pop("temporal")[0] is ir.edges and temporal_edges(ir) == handed_temporal
        ir._indexes.pop("ids")
        assert ir.edge_ids() == handed
        assert {k: list(v) for k, v in passes.items()} == _pass_positions(list(ir.nodes), ir.microbatches)


@pytest.mark.parametrize("text,regions", CASES)
def test_split_hands_on_the_passes_by_microbatch_the_loop_finds(text, regions):
    mesh, directives = load_strategy(text, file="case.pps").build(None)
    ir = apply_all(initial_ir(Program.chain({"PP": regions}), mesh), directives)
    handed = ir._indexes.get("pass")
    if handed is None:
        assert "microbatches" not in text or any(s in text for s in ("zero_bubble", "zbv", "dualpipev"))
        return
    ir._indexes.pop("pass")
    found = ir.by_pass()
    assert list(handed) == list(found) and all(list(handed[k].items()) == list(found[k].items()) for k in found)


@pytest.mark.parametrize("pipeline", ["gpipe", "one_f_one_b", "zero_bubble", "interleaved_1f1b",
                                      "interleaved_zero_bubble", "zbv", "dualpipev"])
@pytest.mark.parametrize("data", ["", "use dp() on dp\n", "use zero1() on dp\n", "use zero3() on dp\n"])
def test_the_walk_knows_whether_the_replay_runs_to_the_end(pipeline, data):
    """`Plans.replays`, found without simulating, is whether the replay gives a Simulation;
    for plans projected from an order of nodes it is left to the replay itself."""
    from piper.compiler.plans import project

    regions = 4 if pipeline in ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev") else 2
    text = f"mesh {'dp=2, ' if data else ''}pp=2\nuse {pipeline}(microbatches=4) on pp\n{data}"
    compiled = compile_ir(lowered(text, regions))
    assert compiled.plans.replays and compiled.plans.replayed is not None
    again = project(compiled.ir, compiled.order, {})
    assert not again.replays and again.replayed == compiled.plans.replayed


@pytest.mark.parametrize("text,regions", [CASES[1], CASES[2], CASES[3], CASES[4]])
def test_an_item_found_directly_is_what_the_general_way_finds(text, regions):
    """`_named_nodes` (an item of one region's order, or naming its region by a tag; a split
    backward's B as its BI and BW) against `_item_nodes`, for every item of the schedule."""
    from piper.frontend.directives import Order
    from piper.ir.region_match import regions_matching
    from piper.ir.statements import _item_nodes, _named_nodes

    mesh, directives = load_strategy(text, file="case.pps").build(None)
    unordered = [d for d in directives if not isinstance(d, Order)]
    ir = apply_all(initial_ir(Program.chain({"PP": regions}), mesh), unordered)
    by_pass, found = ir.by_pass(), 0
    for d in (d for d in directives if isinstance(d, Order)):
        scope = sorted({r.index for r in regions_matching(ir, d.selector, d.span)})
        direct = {op: by_pass.get((op, scope[0]), {}) for op in ("F", "B", "BI", "BW")} if len(scope) == 1 else {}
        for item in (item for slot in d.slots for item in slot):
            nodes = _named_nodes(ir, by_pass, item, direct)
            if nodes is not None:
                found += 1
                assert list(nodes) == _item_nodes(ir, by_pass, item, scope, None, d)
    assert found
