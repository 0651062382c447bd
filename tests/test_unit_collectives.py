"""Tensor parallelism over an axis of size 1 captures no collective (`frontend/unit_collectives.py`):
the plan's graphs are the plain model's, and training equals one device."""
import copy

import pytest
import torch

import piper
from examples import llama_tp
from tests.helpers import assert_same

TP_OPS = {"tp_copy", "tp_reduce", "tp_gather", "tp_reduce_scatter", "tp_collect", "tp_split", "tp_max", "tp_offset"}


@piper.strategy
def plan(s):
    llama_tp.tensor_parallel(s, sequence=True)


def _piper_ops(job) -> set[str]:
    return {node.target.name().split("::")[1].split(".")[0] for region in job.program.regions
            for node in region.graph.graph.nodes
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "piper"}


@pytest.mark.usefixtures("ray_cluster")
def test_tp_of_one_device_runs_the_plain_graph_and_trains_as_one_device():
    model = llama_tp.make_model(torch.float64)
    data = llama_tp.batches(3)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-2)       # noqa: E731
    with piper.compile(copy.deepcopy(model), data[0], strategy=plan, mesh={"tp": 1}, optimizer=opt) as job:
        assert not _piper_ops(job) & TP_OPS, _piper_ops(job)
        losses = [job.step(*b) for b in data]
        state = job.state_dict()
    reference = copy.deepcopy(model)
    ref_opt = opt(reference.parameters())
    ref = []
    for b in data:
        ref_opt.zero_grad()
        loss = reference(*b)
        loss.backward()
        ref_opt.step()
        ref.append(loss.item())
    assert_same((losses, ref, state, {k: v.detach() for k, v in reference.state_dict().items()}), tol=1e-9)


@pytest.mark.parametrize("size", [1, 2])
def test_only_an_axis_of_one_drops_the_collectives(size):
    from piper.frontend.capture import capture
    from piper.frontend.tensor_parallel import plan_of
    from piper.job import build_strategy

    mesh, directives = build_strategy(plan, {"tp": size})
    program = capture(llama_tp.make_model(torch.float32), llama_tp.batches(1)[0], (), plan_of(directives, mesh))
    found = {node.target.name().split("::")[1].split(".")[0] for region in program.regions
             for node in region.graph.graph.nodes
             if node.op == "call_function" and getattr(node.target, "namespace", None) == "piper"}
    assert (found & TP_OPS == set()) if size == 1 else {"tp_gather", "tp_reduce_scatter", "tp_max"} <= found, found
