"""`job.evaluate` under every composition the suite trains, on models with a region per block (the
annotation ZeRO-3 wants: one block's parameters gathered at a time): each evaluation equals one
device's evaluation of the job's own weights (float64, 1e-10), before the first step and after one,
and the step after an evaluation trains as one device does.

With a region per block, 1F1B runs a block's backward and its next forward back to back on a device,
the forward on the parameters gathered for the backward: an evaluation that kept only forward-phase
gathers ran that forward on freed parameters (`setStorage ... out of bounds for storage of size 0`).

    .venv/bin/python -m pytest tests/test_evaluate_grid.py              # the representative cases
    PIPER_FULL=1 .venv/bin/python -m pytest tests/test_evaluate_grid.py # every schedule x ZeRO level
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import piper
from examples import llama_tp, moe
from examples.gpt import make_model as make_gpt
from piper.dsl import load_strategy
from tests.test_stdlib import DATA_PARALLEL, PIPELINES
from tests.test_train import gpt_batches

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
TOL = 1e-10


def layered_gpt(stages: int):
    """GPT with `stages` PP regions of one block each, every block (and the embeddings, the head) an
    `L` region nested in its stage, in float64."""
    return make_gpt(n_layer=stages, n_regions=stages, layer_regions=True, n_embd=32, n_head=2,
                    block_size=16)[0].double()


def gpt_case(script: str, mesh: dict, stages: int):
    return lambda: (layered_gpt(stages), load_strategy(script), mesh, gpt_batches(3))


def tp_case():
    """examples/llama_tp.py with a region per block, ZeRO-3 over dp and Megatron's plan over tp."""
    @piper.strategy
    def plan(s):
        s.use("zero3", on="dp")
        llama_tp.tensor_parallel(s, sequence=True)
    model = llama_tp.make_model(stages=1, layers=2, block_regions=True, vocab=96)
    return model, plan, {"dp": 2, "tp": 2}, llama_tp.batches(count=3, batch=4, vocab=96)


def ep_case():
    """examples/moe.py with a region per block under 1F1B, ZeRO-3 and expert parallelism over dp."""
    model = moe.make_model(n_layer=2, n_regions=2, layer_regions=True, block_size=16, dtype=torch.float64)
    script = "use one_f_one_b(microbatches=2) on pp\nuse zero3() on dp\nuse expert_parallel() on dp\n"
    return model, load_strategy(script), {"dp": 2, "pp": 2}, gpt_batches(3)


def _pipeline(name: str, dp: str | None) -> tuple[str, dict, int]:
    """`use NAME(microbatches=4) on pp` (and `use DP() on dp`), its mesh and its number of stages."""
    script = f"use {name}(microbatches=4) on pp\n" + (f"use {dp}() on dp\n" if dp else "")
    return script, ({"dp": 2, "pp": 2} if dp else {"pp": 2}), 2 * PIPELINES[name]


# The default suite: ZeRO-1/2/3 under 1F1B, DualPipeV's V with ZeRO-3, TP and EP.
CASES = {f"one_f_one_b+{dp}": gpt_case(*_pipeline("one_f_one_b", dp)) for dp in ("zero1", "zero2", "zero3")}
CASES["dualpipev+zero3"] = gpt_case(*_pipeline("dualpipev", "zero3"))
CASES["zero3+tp"] = tp_case
CASES["one_f_one_b+zero3+ep"] = ep_case
# PIPER_FULL=1: every other stdlib schedule alone and under each data-parallel level, and the
# data-parallel levels alone (test_stdlib.py's grid).
FULL = {}
for _name in PIPELINES:
    for _dp in (None, *DATA_PARALLEL):
        FULL[f"{_name}+{_dp}" if _dp else _name] = gpt_case(*_pipeline(_name, _dp))
for _dp in DATA_PARALLEL:
    FULL[_dp] = gpt_case(f"use {_dp}() on dp\n", {"dp": 2}, 2)


def one_device_eval(model, state, batch) -> float:
    model = copy.deepcopy(model)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(*batch).item()


def evaluate_like_one_device(model, strategy, mesh, batches):
    """Evaluate, step, evaluate, step: each evaluation against one device's evaluation of the job's
    weights then, and the losses against one device's training."""
    held_out = batches[2]
    reference = copy.deepcopy(model)
    opt = ADAMW(reference.parameters())
    ref_losses = []
    for batch in batches[:2]:
        opt.zero_grad()
        loss = reference(*batch)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    evals, expected, losses = [], [], []
    with piper.compile(copy.deepcopy(model), batches[0], strategy=strategy, mesh=mesh, optimizer=ADAMW,
                       progress=False) as job:
        for batch in batches[:2]:
            evals.append(job.evaluate(*held_out))
            expected.append(one_device_eval(model, job.state_dict(), held_out))
            losses.append(job.step(*batch))
    torch.testing.assert_close(torch.tensor(evals), torch.tensor(expected), rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=TOL, atol=TOL)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", list(CASES))
def test_evaluate_equals_one_device(case):
    evaluate_like_one_device(*CASES[case]())


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", [c for c in FULL if c not in CASES])
def test_evaluate_equals_one_device_full(case):
    evaluate_like_one_device(*FULL[case]())
