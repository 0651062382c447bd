"""Memory prediction (piper/compiler/memory_model.py) against the runtime's measured step peak.

Each composition of a stdlib pipeline schedule with a stdlib data-parallel
strategy trains the example GPT for two steps; the predicted per-device peak
must be within 10% of `job.memory()[rank]["step_peak"]` (with overlapped slots
in lanes, of the range [least, peak] over the lanes' interleavings). So must
compositions with `precision=` and `recompute`; under `shard experts` (the
example MoE) the routing decides how many token copies each device saves, so
the prediction is compared with each expert group's mean. The default suite
runs a representative subset; `PIPER_FULL=1` runs every case.
"""
from __future__ import annotations

import os

import pytest
import torch

import piper
from piper.ir import experts
from piper.frontend.capture import Program
from piper.dsl import load_strategy
from piper.job import plan
from piper.compiler.memory_model import RegionBytes, optimizer_states, predict_job, predict_memory
from tests.test_train import gpt, gpt_batches

FULL = bool(os.environ.get("PIPER_FULL"))
PIPELINES = {"gpipe": 1, "one_f_one_b": 1, "zero_bubble": 1, "interleaved_1f1b": 2,
             "interleaved_zero_bubble": 2, "zbv": 2, "dualpipev": 2}
DATA = (None, "dp", "zero1", "zero2", "zero3")
ALL = [(p, d) for p in (None, *PIPELINES) for d in DATA if (p, d) != (None, None)]
SUBSET = [(None, "zero3"), ("one_f_one_b", "zero3"), ("dualpipev", None)]
TOLERANCE = 0.10


def composition(pipeline, data, microbatches=4):
    lines, mesh = [], []
    if data:
        mesh.append("dp=2")
    if pipeline:
        mesh.append("pp=2")
        lines.append(f"use {pipeline}(microbatches={microbatches}) on pp")
    if data:
        lines.append(f"use {data}() on dp")
    return "mesh " + ", ".join(mesh) + "\n" + "\n".join(lines) + "\n"


def measure(pipeline, data):
    regions = 2 * PIPELINES[pipeline] if pipeline else 2
    model = gpt(regions)
    batches = gpt_batches(steps=2, batch=16)
    script = load_strategy(composition(pipeline, data))
    with piper.compile(model, batches[0], strategy=script, timeout=120) as job:
        predicted = predict_memory(job.compiled, job.program)     # from the IR alone: nothing has run
        for b in batches:
            job.step(*b)
        measured = job.memory()
    return predicted, measured


def _table(rows) -> str:
    lines = [f"{'composition':<34}{'rank':>5}{'predicted':>12}{'least':>12}{'measured':>12}{'error':>8}"]
    for name, rank, pred, meas in rows:
        lines.append(f"{name:<34}{rank:>5}{pred.peak:>12,}{pred.least:>12,}{meas:>12,}"
                     f"{(pred.peak - meas) / meas:>8.1%}")
    return "\n".join(lines)


def _outside(rows) -> list:
    """Rows whose measured peak is not within 10% of the prediction. With overlapped slots in
    lanes the prediction is a range, [least, peak], over the lanes' interleavings."""
    return [r for r in rows if not (1 - TOLERANCE) * r[2].least <= r[3] <= (1 + TOLERANCE) * r[2].peak]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("pipeline,data", ALL if FULL else SUBSET, ids=lambda x: x or "-")
def test_predicted_peak_is_within_ten_percent_of_the_measured_step_peak(pipeline, data, capsys):
    predicted, measured = measure(pipeline, data)
    name = " + ".join(x for x in (pipeline, data) if x)
    rows = [(name, rank, predicted[rank], m["step_peak"]) for rank, m in measured.items()]
    with capsys.disabled():
        print("\n" + _table(rows))
    bad = _outside(rows)
    assert not bad, "\n" + _table(bad)


def _moe(regions=2):
    from examples.moe import make_model

    return make_model(n_layer=2, n_regions=regions)


def _moe_batches(steps=2, batch=8):
    from examples.moe import training_batches

    stream = training_batches(batch, seed=1)
    return [next(stream) for _ in range(steps)]


def _tp():
    from examples.llama_tp import make_model

    return make_model(dtype=torch.float32, stages=2, dim=64, hidden=128)


def _tp_batches(steps=2, batch=16):
    from examples.llama_tp import batches

    return batches(count=steps, batch=batch, seq=32)


TP_PLAN = ('shard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", '
           '"blocks.*.mlp.up" over tp\nshard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp\n'
           'shard vocab of "embed", "head" over tp\nshard sequence over tp\n')

# name -> (model, script, piper.compile options): each of precision=, recompute and
# shard experts, alone and with the others' strategies.
FEATURES = {
    "zero3 bf16": (lambda: gpt(2), "mesh dp=2\nuse zero3() on dp\nsplit MB into 2\n", {"precision": "bf16"}),
    "zero_bubble recompute": (lambda: gpt(2), "mesh pp=2\nuse zero_bubble(microbatches=4) on pp\nrecompute PP=*\n",
                              {}),
    "expert_parallel zero1 (MoE)": (_moe, "mesh dp=2\nuse zero1() on dp\nuse expert_parallel() on dp\n"
                                          "split MB into 2\n", {}),
    "1f1b bf16": (lambda: gpt(2), "mesh pp=2\nuse one_f_one_b(microbatches=4) on pp\n", {"precision": "bf16"}),
    "zero2 fp16": (lambda: gpt(2), "mesh dp=2\nuse zero2() on dp\nsplit MB into 2\n", {"precision": "fp16"}),
    "1f1b recompute": (lambda: gpt(2), "mesh pp=2\nuse one_f_one_b(microbatches=4) on pp\nrecompute PP=*\n", {}),
    "dualpipev recompute": (lambda: gpt(4), "mesh pp=2\nuse dualpipev(microbatches=4) on pp\nrecompute PP=*\n",
                            {}),
    "zero3 recompute one region": (lambda: gpt(2), "mesh dp=2\nuse zero3() on dp\nsplit MB into 2\n"
                                                   "recompute PP=1\n", {}),
    "gpipe bf16 recompute": (lambda: gpt(2), "mesh pp=2\nuse gpipe(microbatches=4) on pp\nrecompute PP=*\n",
                             {"precision": "bf16"}),
    "1f1b zero3 expert_parallel (MoE)": (_moe, "mesh dp=2, pp=2\nuse one_f_one_b(microbatches=2) on pp\n"
                                               "use zero3() on dp\nuse expert_parallel() on dp\n", {}),
    # Passes cut into pieces at their TP collectives, each piece saving on its own.
    "tp sequence vocab (pieces)": (_tp, "mesh tp=2\nsplit MB into 2\n" + TP_PLAN, {}),
    "1f1b tp recompute (pieces)": (_tp, "mesh pp=2, tp=2\nuse one_f_one_b(microbatches=4) on pp\n"
                                        "recompute PP=*\n" + TP_PLAN, {}),
    "1f1b zero3 bf16 recompute": (lambda: gpt(2), "mesh dp=2, pp=2\nuse one_f_one_b(microbatches=4) on pp\n"
                                                  "use zero3() on dp\nrecompute PP=*\n", {"precision": "bf16"}),
}
DEFAULT_FEATURES = ("zero3 bf16", "zero_bubble recompute", "expert_parallel zero1 (MoE)",
                    "tp sequence vocab (pieces)")


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", [c if c in DEFAULT_FEATURES else pytest.param(c, marks=pytest.mark.full)
                                  for c in FEATURES])
def test_precision_recompute_and_experts_are_predicted_within_ten_percent(case, capsys):
    make, text, options = FEATURES[case]
    batches = {_moe: _moe_batches, _tp: _tp_batches}.get(make, gpt_batches)(steps=2, batch=16)
    with piper.compile(make(), batches[0], strategy=load_strategy(text), timeout=120, **options) as job:
        predicted = predict_job(job)          # from the IR, the options and one forward per region
        for b in batches:
            job.step(*b)
        measured = job.memory()
        groups = experts.groups(job.compiled.ir)
    rows = [(case, rank, predicted[rank], m["step_peak"]) for rank, m in measured.items()]
    with capsys.disabled():
        print("\n" + _table(rows))
    if groups:
        # A MoE region's saved activations hold the token copies routed to this device's experts,
        # which the data decides: the prediction is each expert group's mean (every device its
        # share), and the members' measured peaks scatter around it (about +-10% on this tiny MoE).
        # The runtime runs a MoE pass as pieces cut at its all-to-alls, each saving its tensors on
        # its own; the prediction runs the pieces with a local group of one: 2-6% under the means here.
        rows = [(f"{case} (mean of ranks {list(g)})", g[0], predicted[g[0]],
                 sum(measured[r]["step_peak"] for r in g) // len(g)) for g in groups]
        with capsys.disabled():
            print(_table(rows))
    bad = _outside(rows)
    assert not bad, "\n" + _table(bad)


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
def test_lanes_interleave_between_the_kindest_and_the_worst_prediction(capsys):
    """DualPipeV + ZeRO-2 on dp=2 x pp=2 runs its [F, B] slots in two threads: whether a backward
    has attached its gradient buffer when the forward beside it finishes depends on their timing,
    so the measured step peak moves between steps of one job. Every steady step (optimizer state
    allocated: from the second) lies within [least, peak]; the test prints the steps' peaks."""
    batches = gpt_batches(steps=5, batch=16)
    with piper.compile(gpt(4), batches[0], strategy=load_strategy(composition("dualpipev", "zero2")),
                       timeout=120) as job:
        predicted = predict_job(job)
        assert any(p.least < p.peak for p in predicted.values())
        steps = {rank: [] for rank in predicted}
        for b in batches:
            job.step(*b)
            for rank, m in job.memory().items():
                steps[rank].append(m["step_peak"])
    with capsys.disabled():
        for rank, peaks in steps.items():
            print(f"\nrank {rank}: least {predicted[rank].least:,} peak {predicted[rank].peak:,} "
                  f"measured per step {peaks}")
    for rank, peaks in steps.items():
        assert all(predicted[rank].least <= p <= predicted[rank].peak for p in peaks[1:]), (rank, peaks)


def test_parts_follow_the_zero_formulas_between_steps():
    """Parameters and optimizer state between steps: ZeRO's 4/8 bytes per parameter, sharded;
    gradients exist only within a step (replicated ones, dp and ZeRO-1, from a unit's first
    backward to its update, at the peak (the end of forward here) no more than all; ZeRO-2/3's
    shards of the sums from the unit's first reduce-scatter to its update): none between steps."""
    model = gpt(2)
    x, y = gpt_batches(steps=1, batch=8)[0]
    from piper.frontend.capture import capture

    program = capture(model, (x[:2], y[:2]))
    psi = sum(p.numel() for p in model.parameters())
    for level, shard in (("dp", ()), ("zero1", ("optimizer",)), ("zero2", ("optimizer", "grads")),
                         ("zero3", ("optimizer", "grads", "params"))):
        compiled = plan(load_strategy(f"mesh dp=2\nuse {level}() on dp\nsplit MB into 2\n"), program=program)
        prediction = predict_memory(compiled, program)[0]
        got = prediction.between_steps
        want = {k: v / 2 if k in shard else v for k, v in {"params": 4 * psi, "grads": 4 * psi,
                                                             "optimizer": 8 * psi}.items()}
        if "grads" not in shard:
            assert prediction.grads <= want["grads"] + 64, (level, prediction)   # the peak: end of forward
        want["grads"] = 0
        for k in want:   # padding to the group adds at most a few elements per unit
            assert want[k] <= got[k] <= want[k] + 64, (level, k, got, want)


def test_optimizer_states_counts_the_state_per_element():
    import functools

    assert optimizer_states(functools.partial(torch.optim.AdamW, lr=1e-3)) == 2
    assert optimizer_states(functools.partial(torch.optim.SGD, lr=1e-3)) == 0
    assert optimizer_states(functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)) == 1


def test_activations_follow_the_schedule():
    """GPipe holds every microbatch's activations on stage 0, 1F1B at most p of them."""
    chain = Program.chain({"PP": 2})
    saved = {0: 1000, 1: 1000}
    gpipe = plan(load_strategy("mesh pp=2\nuse gpipe(microbatches=8) on pp\n"), program=chain)
    one = plan(load_strategy("mesh pp=2\nuse one_f_one_b(microbatches=8) on pp\n"), program=chain)
    assert predict_memory(gpipe, chain, saved=saved)[0].activations == 8000
    assert predict_memory(one, chain, saved=saved)[0].activations == 2000
    assert predict_memory(one, chain, saved=saved)[1].activations == 1000


def test_precision_adds_a_16_bit_copy_and_gathers_it_under_zero3():
    """bf16: replicated/ZeRO-1/2 units hold float32 masters and a 16-bit copy (6 bytes per
    parameter); ZeRO-3 holds the float32 shard and gathers 16 bits (half the float32 unit)."""
    model = gpt(2)
    x, y = gpt_batches(steps=1, batch=8)[0]
    from piper.frontend.capture import capture

    program = capture(model, (x[:2], y[:2]))
    psi = sum(p.numel() for p in model.parameters())
    saved = {r.index: 0 for r in program.regions}
    for level, params in (("dp", 6 * psi), ("zero2", 6 * psi), ("zero3", 4 * psi / 2)):
        compiled = plan(load_strategy(f"mesh dp=2\nuse {level}() on dp\nsplit MB into 2\n"), program=program)
        fp32 = predict_memory(compiled, program, saved=saved)[0]
        bf16 = predict_memory(compiled, program, saved=saved, precision="bf16")[0]
        assert params <= bf16.between_steps["params"] <= params + 64, (level, bf16.between_steps)
        assert bf16.between_steps["grads"] == fp32.between_steps["grads"]
        assert bf16.between_steps["optimizer"] == fp32.between_steps["optimizer"]
        if level == "zero3":      # the largest unit gathered: 16 bits, half of the float32 one
            assert 0 < bf16.gathered and bf16.gathered * 2 == fp32.gathered


def test_recompute_keeps_the_inputs_and_reruns_in_backward():
    """GPipe on stage 0: 8 microbatches' inputs, then one rerun at a time in backward."""
    chain = Program.chain({"PP": 2})
    saved = {0: RegionBytes(1000, 100, 950), 1: RegionBytes(1000, 100, 950)}
    plain = plan(load_strategy("mesh pp=2\nuse gpipe(microbatches=8) on pp\n"), program=chain)
    again = plan(load_strategy("mesh pp=2\nuse gpipe(microbatches=8) on pp\nrecompute PP=*\n"), program=chain)
    assert predict_memory(plain, chain, saved=saved)[0].activations == 8000
    assert predict_memory(again, chain, saved=saved)[0].activations == 8 * 100 + 950
    # a split backward reruns in BI and frees in BW: ZB-H1's stage 0 holds two microbatches' inputs
    # and one rerun (its BW follows its BI), instead of two microbatches' activations
    zb = plan(load_strategy("mesh pp=2\nuse zero_bubble(microbatches=8) on pp\nrecompute PP=*\n"), program=chain)
    assert predict_memory(zb, chain, saved=saved)[0].activations == 2 * 100 + 950


def test_expert_rows_divide_over_the_expert_axis():
    """shard experts over dp=2: each device holds half of w1/w2/w3 (and their AdamW state);
    the dense parameters stay whole in the flat unit."""
    from piper.frontend.capture import capture

    model = _moe()
    program = capture(model, tuple(t[:4] for t in _moe_batches(1)[0]))
    expert = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in ("w1", "w2", "w3")
                 and p.dim() == 3)
    dense = sum(p.numel() for p in model.parameters()) - expert
    compiled = plan(load_strategy("mesh dp=2\nuse dp() on dp\nuse expert_parallel() on dp\nsplit MB into 2\n"),
                    program=program)
    saved = {r.index: 0 for r in program.regions}
    got = predict_memory(compiled, program, saved=saved)
    for rank in (0, 1):
        between = got[rank].between_steps
        assert 4 * (dense + expert // 2) <= between["params"] <= 4 * (dense + expert // 2) + 64
        assert between["optimizer"] == 2 * between["params"]
        # in the step, the expert rows' gradients exist from the first backward to the update
        assert got[rank].grads >= 4 * (dense + expert // 2)
