"""The standard library (stdlib/*.pps): every strategy loads, documents itself and
composes by name; each pipeline schedule's simulated bubble and peak activation
count match the formulas in its docstring; the Python forms in
examples/strategies.py build the same IR; and, with Ray, the strategies train
exactly as one device does.

    .venv/bin/python -m pytest tests/test_stdlib.py                 # planning + 4 training runs
    PIPER_FULL=1 .venv/bin/python -m pytest tests/test_stdlib.py    # every schedule x mesh trains

Unit costs throughout: F = BI = BW = 1 and B = BI + BW = 2 per region.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # plain `pytest` does not put the repo root (examples/) on sys.path

from piper import PiperError  # noqa: E402
from piper.frontend.capture import Program  # noqa: E402
from piper.dsl import load_strategy  # noqa: E402
from piper.frontend.interop import overlapped_slots  # noqa: E402
from piper.job import build_strategy, plan  # noqa: E402
from piper.mesh import Mesh  # noqa: E402
from piper.compiler.simulate import simulate  # noqa: E402
from piper.ir.statements import apply_all, initial_ir  # noqa: E402

STDLIB = ROOT / "stdlib"
F, B, W = 1.0, 2.0, 1.0                  # B is the whole backward, W its weight half
DATA_PARALLEL = ("dp", "zero1", "zero2", "zero3")
# pipeline schedule -> regions per device
PIPELINES = {"gpipe": 1, "one_f_one_b": 1, "zero_bubble": 1, "interleaved_1f1b": 2,
             "interleaved_zero_bubble": 2, "zbv": 2, "dualpipev": 2}
FULL = bool(os.environ.get("PIPER_FULL"))


@functools.lru_cache(maxsize=None)
def stdlib(name: str):
    return load_strategy(STDLIB / f"{name}.pps")


@functools.lru_cache(maxsize=None)       # the bubble and memory tests share plans; nothing mutates one
def pipeline_plan(name: str, p: int, m: int):
    return plan(stdlib(name).bind(microbatches=m), mesh={"pp": p},
                program=Program.chain(f"PP={p * PIPELINES[name]}"))


def ir_of(strategy, mesh, regions: int):
    mesh = Mesh.of(mesh)
    _, directives = build_strategy(strategy, mesh)
    return apply_all(initial_ir(Program.chain(f"PP={regions}"), mesh), directives)


def peak_activations(compiled, rank: int) -> int:
    """Most region activations `rank` holds at once: saved by F, freed by the whole B or by BW."""
    live = peak = 0
    for key in compiled.compute_order(rank):
        op = compiled.ir.node(key).op
        live += {"F": 1, "B": -1, "BW": -1}.get(op, 0)
        peak = max(peak, live)
    return peak


def sizes(*, small=False):
    """(p, m) pairs: p in {2, 4, 8}, m in {p, 2p, 3p}."""
    return [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 3 * p) if not (small and m == p)]


# ---- every file


@pytest.mark.parametrize("name", DATA_PARALLEL + tuple(PIPELINES))
def test_each_file_is_one_documented_strategy(name):
    text = (STDLIB / f"{name}.pps").read_text()
    assert text.startswith(f"strategy {name}("), "a stdlib file opens with its strategy and docstring"
    doc = re.search(r'"""(.*?)"""', text, re.S).group(1)
    for part in ("Source:", "Limits:") + (("Bubble per device:", "Activation memory:") if name in PIPELINES
                                          else ("Memory per device:",)):
        assert part in doc, f"{name}.pps: the docstring says nothing under {part!r}"
    script = stdlib(name)
    assert ("microbatches" in script.params) == (name in PIPELINES)
    assert "axis" in script.params


@pytest.mark.parametrize("name", DATA_PARALLEL + tuple(PIPELINES))
def test_found_by_name_and_bound_to_an_axis(name):
    """`use NAME(...) on AXIS` finds the file through importlib.resources (piper.stdlib)."""
    args = "microbatches=8" if name in PIPELINES else ""
    axis = "pp" if name in PIPELINES else "dp"
    regions = 2 * PIPELINES.get(name, 1)
    by_name = ir_of(load_strategy(f"use {name}({args}) on {axis}\n"), {axis: 2}, regions)
    by_path = ir_of(stdlib(name).bind(**({"microbatches": 8} if args else {}), axis=axis), {axis: 2}, regions)
    assert by_name == by_path


# ---- the same IR as the Python forms


def test_python_forms_build_the_same_ir():
    from examples.strategies import one_f_one_b, zero3

    for p, m in [(2, 4), (4, 8), (4, 3)]:
        assert ir_of(one_f_one_b(microbatches=m), {"pp": p}, p) == ir_of(stdlib("one_f_one_b").bind(microbatches=m),
                                                                          {"pp": p}, p)
    assert ir_of(zero3, {"dp": 2}, 2) == ir_of(stdlib("zero3"), {"dp": 2}, 2)
    composed_py = piper_strategy(lambda s: (s.use(one_f_one_b, microbatches=8, axis="pp"), s.use(zero3, axis="dp")))
    composed_pps = load_strategy("use one_f_one_b(microbatches=8) on pp\nuse zero3() on dp\n")
    mesh = {"dp": 2, "pp": 2}
    assert ir_of(composed_py, mesh, 2) == ir_of(composed_pps, mesh, 2)
    assert ir_of(composed_pps, mesh, 2) == ir_of(ROOT / "examples" / "gpt_zero3_1f1b.pps", mesh, 2)


def piper_strategy(fn):
    import piper

    return piper.strategy(fn)


def test_data_parallel_family_is_what_the_training_tests_train():
    """stdlib dp/zero1/2/3 and one_f_one_b build the IR whose training tests/test_train.py checks."""
    from tests.test_train import data_parallel, one_f_one_b, pipeline

    for name, what in zip(DATA_PARALLEL, [(), ("optimizer",), ("optimizer", "grads"),
                                          ("optimizer", "grads", "params")]):
        assert ir_of(stdlib(name), {"dp": 2}, 2) == ir_of(data_parallel(*what), {"dp": 2}, 2)
    assert ir_of(stdlib("one_f_one_b").bind(microbatches=8), {"pp": 4}, 4) == \
        ir_of(pipeline(8, order=one_f_one_b), {"pp": 4}, 4)


def test_data_parallel_family_collectives():
    def keys(name):
        compiled = plan(stdlib(name), mesh={"dp": 2}, program=Program.chain("PP=1"))
        return [a.key for a in compiled.plans[0] if not a.node.is_compute]

    assert keys("dp") == ["0ALL_REDUCE"]
    assert keys("zero1") == ["0ALL_REDUCE", "0ALL_GATHER"]
    assert keys("zero2") == ["0REDUCE_SCATTER", "0ALL_GATHER"]
    assert keys("zero3") == ["0ALL_GATHER_F0", "0REDUCE_SCATTER"]    # gathered once: F and B run back to back


# ---- bubbles: simulated with unit costs, against the docstrings' formulas


@pytest.mark.parametrize("p,m", sizes())
@pytest.mark.parametrize("name", ["gpipe", "one_f_one_b", "interleaved_1f1b"])
def test_bubble_of_1f1b_family(name, p, m):
    sim = simulate(pipeline_plan(name, p, m).plans)
    assert [sim.bubble(r) for r in range(p)] == [(p - 1) * (F + B)] * p


@pytest.mark.parametrize("p,m", sizes())
@pytest.mark.parametrize("name", ["zero_bubble", "interleaved_zero_bubble"])
def test_bubble_of_zero_bubble(name, p, m):
    sim = simulate(pipeline_plan(name, p, m).plans)
    assert [sim.bubble(r) for r in range(p)] == [(p - 1) * (F + B - 2 * W)] * p


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in (2 * p - 1, 2 * p, 3 * p)])
def test_bubble_of_zbv(p, m):
    sim = simulate(pipeline_plan("zbv", p, m).plans)
    assert [sim.bubble(r) for r in range(p)] == [(p - 1) * (F + B - 2 * W)] * p


def test_zbv_with_few_microbatches_is_still_better_than_1f1b():
    for p in (2, 4, 8):     # m = p < 2p - 1: torch plans 2p - 1 and drops the extras
        zbv = simulate(pipeline_plan("zbv", p, p).plans)
        assert zbv.bubble(0) == (p - 1) * (F + B - W) < (p - 1) * (F + B)


@pytest.mark.parametrize("p,m", sizes(small=True))
@pytest.mark.parametrize("fb", [F + B, 2.5, B])
def test_bubble_of_dualpipev(p, m, fb):
    """DualPipe README: DualPipeV's bubble is (PP/2-1)(F&B+B-3W), with PP = 2p stages on p devices.

    It holds when an overlapped slot runs as one unit taking F&B (between B,
    all of F hidden, and F+B, none), on the device that computes least: the
    last device runs its first F and B apart, so its busy time differs.
    """
    compiled = pipeline_plan("dualpipev", p, m)
    sim = simulate(compiled.plans, costs={"F&B": fb}, overlap=overlapped_slots(compiled))
    assert max(sim.bubble(r) for r in range(p)) == (p - 1) * (fb + B - 3 * W)
    if fb == F + B:
        assert {sim.bubble(r) for r in range(p)} == {(p - 1) * (fb + B - 3 * W)}


def test_dualpipev_slots_run_one_after_the_other_without_overlap():
    """Run as plain sequences (the runtime with overlap=False, and on CUDA), the halves of a slot
    start as soon as each one's inputs are there: (p-1)(F+B-2W) then."""
    for p in (2, 4, 8):
        sim = simulate(pipeline_plan("dualpipev", p, 2 * p).plans)
        assert [sim.bubble(r) for r in range(p)] == [(p - 1) * (F + B - 2 * W)] * p


def test_overlap_is_a_no_op_for_plans_without_overlapped_slots():
    compiled = pipeline_plan("zbv", 4, 8)
    assert overlapped_slots(compiled) == ()
    plain = simulate(compiled.plans)
    assert simulate(compiled.plans, overlap=overlapped_slots(compiled)).timeline == plain.timeline


def test_dualpipev_overlapped_slots():
    compiled = pipeline_plan("dualpipev", 2, 4)
    slots = overlapped_slots(compiled)
    assert ("0F3", "3BI1", "3BW1") in slots and ("3F2", "0BI0", "0BW0") in slots
    sim = simulate(compiled.plans, costs={"F&B": 2.0}, overlap=slots)
    units = [key for start, end, key in sim.timeline[0] if "&" in key]
    assert "0F3&3BI1&3BW1" in units


# ---- activation memory: the docstrings' peaks


@pytest.mark.parametrize("p,m", sizes(small=True))
def test_peak_activations(p, m):
    def peaks(name):
        compiled = pipeline_plan(name, p, m)
        return [peak_activations(compiled, r) for r in range(p)]

    v = 2
    assert peaks("gpipe") == [m] * p
    assert peaks("one_f_one_b") == [p - s for s in range(p)]
    assert peaks("zero_bubble") == [p] * p                                  # as 1F1B's device 0
    assert peaks("interleaved_1f1b") == [(v - 1) * p + 2 * (p - 1 - s) + 1 for s in range(p)]
    assert peaks("interleaved_zero_bubble") == [v * p] * p                  # v*p chunks of A/v: p*A
    assert peaks("zbv") == [2 * p] * p                                      # 2p halves: p*A
    assert peaks("dualpipev") == [2 * p + 1] * p                            # README: PP+1, PP = 2p


# ---- composition and the examples


def test_pipeline_composes_with_zero3():
    script = load_strategy("use zero_bubble(microbatches=4) on pp\nuse zero3() on dp\n")
    compiled = plan(script, mesh={"dp": 2, "pp": 2}, program=Program.chain("PP=2"))
    keys = [a.key for a in compiled.plans[0]]
    assert keys[0] == "0ALL_GATHER_F0" and "0ALL_GATHER" not in keys
    # zero_bubble splits B: a reduce-scatter after each run of weight passes into the region
    reduces = [k for k in keys if "REDUCE_SCATTER" in k]
    assert len(reduces) > 1 and reduces[-1] == "0REDUCE_SCATTER_BW3"
    assert compiled.compute_order(0) == compiled.compute_order(2)       # ranks 0, 2: pp[0], dp = 0 and 1
    simulate(compiled.plans)


# script -> (the devices of each PP region, microbatches, the data-parallel collectives, the bubble
# per device with unit costs from its schedule's docstring, p = 2)
EXAMPLE_SCRIPTS = {
    "gpt_zero3_1f1b.pps": ({0: (0, 2), 1: (1, 3)}, 8, {"ALL_GATHER", "REDUCE_SCATTER"}, F + B),
    "gpt_dualpipev.pps": ({0: (0,), 1: (1,), 2: (1,), 3: (0,)}, 8, set(), F + B - 2 * W),   # V; slots in sequence
    "gpt_zero2_interleaved.pps": ({0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}, 4,
                                  {"ALL_GATHER", "REDUCE_SCATTER"}, F + B),
    "gpt_zbv.pps": ({0: (0,), 1: (1,), 2: (1,), 3: (0,)}, 8, set(), F + B - 2 * W),
}


@pytest.mark.parametrize("script", list(EXAMPLE_SCRIPTS))
def test_example_scripts_plan(script):
    """Each example script plans on its own mesh: every region on the devices its comment names,
    each device running every microbatch's forward and backward of its regions and one update,
    with the data-parallel collectives its `use` lines ask for, and the plans run to the end with
    the bubble of the schedule's docstring."""
    devices, microbatches, collectives, bubble = EXAMPLE_SCRIPTS[script]
    compiled = plan(load_strategy(ROOT / "examples" / script), program=Program.chain(f"PP={len(devices)}"))
    assert {r: compiled.ir.devices_of(r) for r in devices} == devices
    assert sorted(compiled.plans) == sorted({d for ds in devices.values() for d in ds})
    for rank, actions in compiled.plans.items():
        mine = {r for r, ds in devices.items() if rank in ds}
        computes = [a.node for a in actions if a.node.is_compute]
        assert {n.region for n in computes} == mine
        for r in mine:
            ops = [n.op for n in computes if n.region == r]
            assert ops.count("F") == microbatches and ops.count("UPD") == 1, (rank, r)
            assert ops.count("B") + ops.count("BW") == microbatches and ops.count("BI") == ops.count("BW")
        assert {a.node.op for a in actions if not a.node.is_compute} - {"SEND", "RECV"} == collectives
    sim = simulate(compiled.plans)      # raises `deadlock` where the plans cannot finish
    assert [sim.bubble(r) for r in sorted(compiled.plans)] == [bubble] * len(compiled.plans)


def test_whole_backward_after_split_names_bi_and_bw():
    """`B(MB=m)` after `split B into BI, BW` is the whole backward: BI then BW, in one slot."""
    script = load_strategy("split MB into 2\nsplit B into BI, BW\norder PP=0:\n"
                           "    F(MB=0); F(MB=1); B(MB=0); BI(MB=1); BW(MB=1)\n")
    compiled = plan(script, mesh={"pp": 1}, program=Program.chain("PP=1"))
    assert compiled.compute_order(0) == ["0F0", "0F1", "0BI0", "0BW0", "0BI1", "0BW1", "0UPD"]
    with pytest.raises(PiperError) as err:
        plan(load_strategy("split MB into 1\nsplit B into BI, BW\norder PP=0: F(MB=0); B(MB=0); BW(MB=0)\n"),
             mesh={"pp": 1}, program=Program.chain("PP=1"))
    assert err.value.diagnostics[0].code == "ordered-twice"


# ---- training equality (Ray): a representative few in CI, everything with PIPER_FULL=1


def train_case(script: str, mesh: dict, regions: int, microbatches: int):
    from piper.testing import train_both
    from tests.test_train import assert_same_training, gpt, gpt_batches

    shards = mesh.get("dp", 1)
    result = train_both(gpt(regions), load_strategy(script), mesh=mesh,
                        batches=gpt_batches(batch=microbatches * shards))
    assert_same_training(result)


def _pipeline_script(name: str, p: int) -> tuple[str, int, int]:
    m = 2 * p                     # DualPipeV needs m >= 2p; one sample per microbatch
    return f"use {name}(microbatches={m}) on pp\n", p * PIPELINES[name], m


CI_TRAINING = {
    # split backward (BI/BW) through the runtime, on chunks interleaved over devices
    "interleaved_zero_bubble-pp2": ("use interleaved_zero_bubble(microbatches=4) on pp\n", {"pp": 2}, 4, 4),
    # (interleaved 1F1B + ZeRO-2 runs with PIPER_FULL=1: interleaving trains by default in
    # test_train.py and test_hf.py, ZeRO-2 under a pipeline in test_train.py)
    # the V placement, overlapped slots, whole and split backwards mixed
    "dualpipev-pp2": ("use dualpipev(microbatches=4) on pp\n", {"pp": 2}, 4, 4),
    # overlapped slots run in two lanes while ZeRO-3 gathers and reduce-scatters around them
    "dualpipev+zero3-dp2pp2": ("use dualpipev(microbatches=4) on pp\nuse zero3() on dp\n", {"dp": 2, "pp": 2}, 4, 4),
    # zero bubble on a V with parameters gathered per pass (ZeRO-3)
    "zbv+zero3-dp2pp2": ("use zbv(microbatches=4) on pp\nuse zero3() on dp\n", {"dp": 2, "pp": 2}, 4, 4),
}

FULL_TRAINING = {}
for _name in PIPELINES:
    for _p in (2, 4):
        _script, _regions, _m = _pipeline_script(_name, _p)
        FULL_TRAINING[f"{_name}-pp{_p}"] = (_script, {"pp": _p}, _regions, _m)
    for _dp in DATA_PARALLEL:
        FULL_TRAINING[f"{_name}+{_dp}-dp2pp2"] = (f"use {_name}(microbatches=4) on pp\nuse {_dp}() on dp\n",
                                                  {"dp": 2, "pp": 2}, 2 * PIPELINES[_name], 4)
for _dp in DATA_PARALLEL:
    FULL_TRAINING[f"{_dp}-dp2"] = (f"use {_dp}() on dp\n", {"dp": 2}, 2, 2)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", list(CI_TRAINING))
def test_train_like_one_device(case):
    train_case(*CI_TRAINING[case])


@pytest.mark.skipif(not FULL, reason="every schedule x mesh trains with PIPER_FULL=1 (42 more runs, 10-15 minutes)")
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", [c for c in FULL_TRAINING if c not in CI_TRAINING])
def test_train_like_one_device_full(case):
    train_case(*FULL_TRAINING[case])
