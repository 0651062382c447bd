"""Tensor parallelism's collectives as plan actions: a region under `shard columns/rows/vocab`
is cut at each of its TP collectives into pieces (`piper.ir.region_cut`), each collective one
`TP` exchange between them (`piper.compiler.cut_passes`), priced by its own bytes, and an
overlapped slot run on one thread switches items at them (async TP). Compile-time only: the
training tests of tests/test_tensor_parallel.py run these plans against one device.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from piper.compiler.analysis import compile_with_program
from piper.compiler.slots import interleaved, spans
from piper.compiler.step_costs import comm_cost
from piper.dsl import load_strategy
from piper.frontend.interop import compute_slots
from piper.frontend.tensor_traffic import exchange_bytes, traffic
from piper.ir.region_cut import TP_KINDS, cut, exchange_ops, op_name

from examples.llama_tp import example_batch, make_model  # noqa: F401 - `four_stages`' module gives the batch

MODEL = f"{Path(__file__).resolve().parent.parent}/examples/llama_tp.py:make_model"
FOUR_STAGES = f"{Path(__file__).resolve()}:four_stages"        # for DualPipeV's 2 stages per device


def four_stages():
    return make_model(stages=4, layers=4)
PLAN = ('shard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", '
        '"blocks.*.mlp.up" over tp\nshard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp\n'
        'shard vocab of "embed", "head" over tp\n')


@functools.cache
def compiled(schedule: str = "one_f_one_b(microbatches=2)", sequence: bool = True, model: str = MODEL):
    text = f"mesh pp=2, tp=2\nuse {schedule} on pp\n" + PLAN + ("shard sequence over tp\n" if sequence else "")
    return compile_with_program(load_strategy(text), model_spec=model)


def tp_ops(region) -> list[str]:
    return [op_name(n) for n in region.graph.graph.nodes if op_name(n) in TP_KINDS]


@pytest.mark.parametrize("sequence", [True, False], ids=["sp", "no-sp"])
def test_each_tp_collective_is_an_exchange_between_two_pieces(sequence):
    c, program = compiled(sequence=sequence)
    block = ["tp_gather", "tp_reduce_scatter"] * 2 if sequence else ["tp_copy", "tp_reduce"] * 2
    embed = ["tp_reduce_scatter" if sequence else "tp_reduce"]
    head = ["tp_gather" if sequence else "tp_copy", "tp_max", "tp_reduce"]    # the loss: a max, both sums in one
    # stage 0: the embedding and block 0; stage 1: block 1, the head and the vocab-parallel loss
    assert [tp_ops(r) for r in program.regions] == [embed + block, block + head]
    for region in program.regions:
        n = len(tp_ops(region))
        assert exchange_ops(region.graph, experts=False, tensor=True) == ("TP",) * n
        the_cut = cut(region.graph, 1, experts=False, tensor=True)
        assert len(the_cut.pieces) == n + 1 and [e.kind for e in the_cut.exchanges] == tp_ops(region)
        for rank in c.ir.devices_of(region.index):
            keys = [a.key for a in c.plans[rank] if a.node.region == region.index and a.node.mb == 0
                    and (a.node.op in ("F", "B", "TP"))]
            r = region.index
            forward = [f"{r}F0"] + [k for i in range(n) for k in (f"{r}TP_F0.{i}", f"{r}F0.{i + 1}")]
            backward = [f"{r}B0.{n}"] + [k for i in reversed(range(n))
                                         for k in (f"{r}TP_B0.{i}", f"{r}B0.{i}" if i else f"{r}B0")]
            assert keys == forward + backward, (rank, keys)
    # Nothing is left issuing TP collectives from inside a compute: no marker.
    assert not [a.key for plan in c.plans.values() for a in plan if a.node.op == "TP" and a.node.value is None]


def test_an_abstract_program_keeps_one_marker_per_pass():
    from piper.compiler.analysis import compile_script

    c = compile_script(load_strategy("mesh pp=2, tp=2\nuse one_f_one_b(microbatches=2) on pp\n" + PLAN),
                       regions={"PP": 2})
    keys = [a.key for a in c.plans[0]]
    assert "0TP_F0" in keys and "0TP_B1" in keys and not any(k.startswith("0TP_F0.") for k in keys)


def test_each_exchange_is_priced_by_the_bytes_of_its_own_collective():
    c, program = compiled()
    cost = comm_cost(c, program, bandwidth=1.0)
    moves, totals = exchange_bytes(program), traffic(program)
    for region in program.regions:
        kinds = tp_ops(region)
        for phase, i in (("F", 0), ("B", 1)):
            nodes = sorted((a.node for a in c.plans[c.ir.devices_of(region.index)[0]]
                            if a.node.op == "TP" and a.node.region == region.index and a.node.mb == 0
                            and a.node.phase == phase), key=lambda n: n.value)
            priced = [cost(n) for n in nodes]
            assert priced == [m[i] or 0.0 for m in moves[region.index]]
            assert sum(priced) == pytest.approx(totals[(region.index, phase)][0])
            for kind, price in zip(kinds, priced):
                # f moves nothing forward and g nothing backward; the vocab loss's max has no gradient
                silent = (kind == "tp_copy" and phase == "F") or (kind in ("tp_reduce", "tp_max") and phase == "B")
                assert (price == 0.0) == silent, (kind, phase, price)


def test_an_overlapped_slot_on_one_thread_switches_items_at_their_tp_collectives():
    """DualPipeV's slots hold a forward and a backward: run in turn, the other item's piece runs
    while one item's collective is in flight (the plan issues it and moves on)."""
    c, program = compiled("dualpipev(microbatches=4)", sequence=True, model=FOUR_STAGES)
    slots = compute_slots(c)
    rank = 0
    plan = c.plans[rank]
    mine = [r.index for r in c.ir.regions if rank in c.ir.devices_of(r.index)]
    multi = tuple(s for s in slots[rank] if len(s) > 1)
    found = spans(plan, multi, {r: set() for r in mine}, {r: set() for r in mine})
    switched = 0
    for span in found.values():
        order = [a.key for a in interleaved(span)]
        lanes = [{a.key for a in lane} for lane in span.lanes]
        assert sorted(order) == sorted(k for lane in lanes for k in lane)
        for before, after in zip(order, order[1:]):
            if "TP_" in before and "." in before:
                lane = next(i for i, keys in enumerate(lanes) if before in keys)
                switched += after not in lanes[lane]
    assert switched > 0


def test_piper_simulate_prices_the_4d_example_with_its_model(capsys, monkeypatch):
    """The simulator's profile runs each region on one process with TP's stand-in group: its
    reduce-scatter of a batch of one along the sequence is a copy (a custom op's output may not
    alias its input)."""
    from piper.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert main(["simulate", "examples/llama_tp_4d.pps", "--model", "examples/llama_tp.py:make_model"]) == 0
    assert "predicted step" in capsys.readouterr().out


@pytest.mark.parametrize("sequence", [True, False], ids=["sp", "no-sp"])
def test_what_only_an_exchange_reads_may_be_let_go_once_it_has_read_it(sequence):
    """`Cut.freeable`: the runtime drops the data of a piece's output once the TP exchange that
    alone reads it has read it (the output itself stays: its backward starts there). Never
    tp_copy's input (its result is that tensor), nor a value that passes through a piece."""
    _, program = compiled(sequence=sequence)
    for region in program.regions:
        the_cut = cut(region.graph, 1, experts=False, tensor=True)
        kinds = {e.sources[0]: e.kind for e in the_cut.exchanges}
        assert the_cut.freeable <= set(kinds)
        assert not [s for s in the_cut.freeable if kinds[s] == "tp_copy"]
        # every rows module's partial sums and (under SP) every gathered norm output
        collectives = {"tp_reduce_scatter", "tp_gather"} if sequence else {"tp_reduce"}
        assert {s for s, k in kinds.items() if k in collectives} <= the_cut.freeable, region.index
        for s in the_cut.freeable:
            produced = the_cut.pieces[s.index].graph.output_node().args[0][s.out]
            assert produced.op != "placeholder"


def test_a_4d_plan_on_8192_devices_checks_clean(tmp_path, capsys):
    """dp=64 x pp=16 x tp=8 with 64 microbatches: the plan limit counts the devices that plan apart
    (one replica of dp and tp stands for the others), not all 8,192."""
    from piper.cli import main

    script = tmp_path / "big.pps"
    script.write_text("mesh dp=64, pp=16, tp=8\nuse one_f_one_b(microbatches=64) on pp\nuse zero3() on dp\n"
                      + PLAN + "shard sequence over tp\n")
    assert main(["check", str(script), "--regions", "PP=16"]) == 0, capsys.readouterr().out


def test_values_between_pieces_are_let_go_after_their_last_reader_but_never_one_handed_on():
    """`Cut.after_piece`: a value passed between pieces that no exchange reads and that is not a
    region output may be let go once its last reader has run; one a piece hands on unchanged (its
    tensor lives on as that piece's output) never is."""
    _, program = compiled(sequence=True)
    for region in program.regions:
        the_cut = cut(region.graph, 1, experts=False, tensor=True)
        read_by_exchange = {s for e in the_cut.exchanges for s in e.sources}
        handed = set()
        for piece, gm in enumerate(the_cut.pieces):
            outs = gm.graph.output_node().args[0]
            holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            handed |= {the_cut.inputs[piece][holders.index(n)] for n in outs if n.op == "placeholder"}
        for piece, sources in the_cut.after_piece.items():
            for s in sources:
                assert the_cut.readers[s][-1] == piece and piece in the_cut.readers[s]
                assert s not in read_by_exchange and s not in the_cut.outputs and s not in handed
                assert s.kind != "arg"
        assert any(the_cut.after_piece.values()), "the residual stream crosses pieces"
