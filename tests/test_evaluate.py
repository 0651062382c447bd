"""`job.evaluate(*batch)`: the loss of a batch without any update, run as the forward half of
every device's plan on the same devices; it equals one device's loss (float64) and changes no
parameter, optimizer state or step count (the next step is still the reference's)."""
import copy
import functools

import pytest
import torch

import piper
from piper.dsl.script import load_strategy
from piper.runtime.execution.evaluation import forward_only
from tests.helpers import assert_same
from tests.test_train import data_parallel, gpt, gpt_batches

STRATEGIES = {
    "zero3": (lambda: data_parallel("optimizer", "grads", "params"), {"dp": 2}, 2),
    "zero3x1f1b": (lambda: load_strategy("use one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n"),
                   {"dp": 2, "pp": 2}, 2),
    "dualpipev": (lambda: load_strategy("use dualpipev(microbatches=4) on pp\n"), {"pp": 2}, 4),
}
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2)


def _optimizer_state(worker):
    """Inside a worker: every optimizer state tensor and step count, copied."""
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for u in worker.executor.units.values() for s in u.optimizer.state.values()]


def test_the_forward_only_plan_keeps_the_forward_half_in_order():
    from piper.frontend.capture import capture
    from piper.job import plan

    model, batch = gpt(2, torch.float64), gpt_batches(1)[0]
    compiled = plan(load_strategy("use one_f_one_b(microbatches=2) on pp\nuse zero3() on dp\n"),
                    mesh={"dp": 2, "pp": 2}, program=capture(model, tuple(x[:2] for x in batch)))
    assert [a.key for a in forward_only(compiled.plans[0])] == [
        "0ALL_GATHER_F0", "0F0", "0SEND_F0>1.0", "0F1", "0SEND_F1>1.0"]
    last = forward_only(compiled.plans[1])     # dp=0, pp=1: the last stage
    assert [a.node.op for a in last] == ["RECV", "ALL_GATHER", "F", "RECV", "F"]
    keys = {a.key for a in last}
    assert all(w in keys for a in last for w in a.waits)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_evaluate_equals_one_device_and_changes_nothing(name):
    import ray

    strategy, mesh, regions = STRATEGIES[name]
    model = gpt(regions, torch.float64)
    batches = gpt_batches(4)
    reference = copy.deepcopy(model)
    opt = OPTIMIZER(reference.parameters())
    ref_losses, ref_evals = [], []
    for i, batch in enumerate(batches[:3]):
        with torch.no_grad():
            ref_evals.append(reference(*batches[3]).item())     # the held-out batch before each step
        opt.zero_grad()
        loss = reference(*batch)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    with piper.compile(copy.deepcopy(model), batches[0], strategy=strategy(), mesh=mesh, optimizer=OPTIMIZER) as job:
        losses, evals = [], []
        for i, batch in enumerate(batches[:3]):
            if i == 2:      # after two steps the optimizer has state: it must not move
                before = (job.state_dict(), ray.get([a.__ray_call__.remote(_optimizer_state) for a in job.actors]))
                evals.append(job.evaluate(*batches[3]))
                assert job.evaluate(*batches[3]) == evals[-1]
                after = (job.state_dict(), ray.get([a.__ray_call__.remote(_optimizer_state) for a in job.actors]))
                assert job.steps == 2
                for k, v in before[0].items():
                    assert torch.equal(v, after[0][k]), k
                for mine, theirs in zip(before[1], after[1]):
                    assert len(mine) == len(theirs) and len(mine) > 0
                    for a, b in zip(mine, theirs):
                        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
            else:
                evals.append(job.evaluate(*batches[3]))
            losses.append(job.step(*batch))
        state = job.state_dict()
    torch.testing.assert_close(torch.tensor(evals), torch.tensor(ref_evals), rtol=1e-9, atol=1e-9)
    assert_same((losses, ref_losses, state, {k: v.detach() for k, v in reference.state_dict().items()}), tol=1e-9)
