"""Shortcuts the compiler takes at scale give what the general path gives: the
scheduler's order against a plain one-heap topological sort, the computes'
positions it hands on, the key index `add_transfers` lets later passes skip,
and the final edges made without it."""
from __future__ import annotations

import heapq
from dataclasses import replace

import pytest

from piper.frontend.capture import PARAM, VALUE, Program, RegionInput
from piper.compiler.plans import _priority, _with_new_edges, _units_used, add_collectives, add_tie_exchanges, schedule
from piper.compiler.plans import schedule_with_computes
from piper.ir.dag import COMPUTE, Edge, Node, distinct_edges
from piper.dsl import load_strategy
from piper.ir.lower import add_transfers, resolve_placement, zero_levels
from piper.ir.statements import apply_all, initial_ir
from tests.test_node_ids import CASES, lowered

TIED = "tied"       # the last of 2 regions also reads the first's weight: tied-weight exchanges
SKIP = "skip"       # region 0's output also feeds region 2: a compute with two sends


def placed(text: str, regions: int):
    """`lowered` (the IR placed, before transfers), or for TIED a chain whose ends share a weight."""
    if text == SKIP:
        chain = Program.chain({"PP": 3})
        last = chain.regions[-1]
        chain = replace(chain, values=(replace(chain.values[0], consumers=(1, 2)),) + chain.values[1:],
                        regions=chain.regions[:-1] + (replace(last, inputs=last.inputs + (RegionInput(VALUE, 0),)),))
        mesh, directives = load_strategy("mesh dp=2, pp=3\nuse one_f_one_b(microbatches=4) on pp\n"
                                         "use zero3() on dp\n", file="skip.pps").build(None)
        return resolve_placement(apply_all(initial_ir(chain, mesh), directives), [])
    if text != TIED:
        return lowered(text, regions)
    chain = Program.chain({"PP": 2})
    last = chain.regions[-1]
    chain = replace(chain, regions=chain.regions[:-1] + (
        replace(last, inputs=last.inputs + (RegionInput(PARAM, "r0.weight"),)),))
    mesh, directives = load_strategy("mesh dp=2, pp=2\nuse one_f_one_b(microbatches=3) on pp\n"
                                     "use zero3() on dp\n", file="tied.pps").build(None)
    return resolve_placement(apply_all(initial_ir(chain, mesh), directives), [])


def reference_schedule(ir) -> list[Node]:
    """Kahn's algorithm with one heap ordered by (`_priority`, key): what `schedule` promises."""
    index = ir.index()
    succ, indeg = {k: [] for k in index}, dict.fromkeys(index, 0)
    for e in ir.edges:
        succ[e.src].append(e.dst)
        indeg[e.dst] += 1
    ready = [(_priority(index[k]), k) for k, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, k = heapq.heappop(ready)
        out.append(index[k])
        for j in succ[k]:
            indeg[j] -= 1
            if not indeg[j]:
                heapq.heappush(ready, (_priority(index[j]), j))
    return out


@pytest.mark.parametrize("text,regions", CASES + [(TIED, 2), (SKIP, 3)])
def test_schedule_is_the_one_heap_topological_order(text, regions):
    ir = add_transfers(placed(text, regions))
    assert [n.key for n in schedule(ir)] == [n.key for n in reference_schedule(ir)]


@pytest.mark.parametrize("text,regions", CASES)
def test_schedule_hands_on_the_positions_of_its_computes(text, regions):
    ir = add_transfers(lowered(text, regions))
    order, computes_at = schedule_with_computes(ir)
    assert order == schedule(ir)
    assert computes_at == [i for i, n in enumerate(order) if n.op in COMPUTE]
    zero = zero_levels(ir)
    assert add_collectives(ir, order, zero, computes_at) == add_collectives(ir, order, zero)


@pytest.mark.parametrize("text,regions", CASES)
def test_transfers_vouch_for_distinct_keys_and_their_ops(text, regions):
    ir = add_transfers(lowered(text, regions))
    assert ir.vouched_ops() == frozenset(n.op for n in ir.nodes)
    assert ir.keys_distinct() and len({n.key for n in ir.nodes}) == len(ir.nodes)


def test_an_ir_with_a_key_twice_is_not_distinct_and_is_scheduled_once():
    ir = add_transfers(lowered(*CASES[2]))
    twice = ir.with_(nodes=ir.nodes + ir.nodes[:1])
    assert twice.vouched_ops() is None and not twice.keys_distinct()
    assert [n.key for n in schedule(twice)] == [n.key for n in schedule(ir)]


@pytest.mark.parametrize("text,regions", CASES + [(TIED, 2)])
def test_final_edges_without_the_key_index_are_the_distinct_union(text, regions):
    ir = add_transfers(placed(text, regions))
    order, extra, _ = add_collectives(ir, schedule(ir), zero_levels(ir))
    order, ties = add_tie_exchanges(ir, order, _units_used(ir))
    assert bool(ties) == (text == TIED)
    expected = tuple(dict.fromkeys(ir.edges + tuple(extra) + tuple(ties)))
    assert _with_new_edges(ir, extra, ties) == expected
    unvouched = ir.with_(nodes=tuple(ir.nodes))      # new nodes: no vouching, every edge looked up
    assert unvouched.vouched_ops() is None
    assert _with_new_edges(unvouched, extra, ties) == expected
    # An extra edge repeating one of the IR's own is dropped on either path.
    again = [Edge(ir.edges[0].src, ir.edges[0].dst)] if ir.edges[0].kind == "data" else []
    assert _with_new_edges(unvouched, extra + again, ties) == distinct_edges(ir.edges + tuple(extra + again) + tuple(ties))
