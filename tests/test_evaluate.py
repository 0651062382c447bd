"""`job.evaluate(*batch)`: the loss of a batch without any update, run as the forward half of
every device's plan on the same devices; it equals one device's loss (float64) and changes no
parameter, optimizer state or step count (the next step is still the reference's)."""
import copy
import functools

import pytest
import torch

import piper
from piper.dsl.script import load_strategy
from piper.ir.tied import units_used
from piper.runtime.execution.evaluation import forward_only, is_release_only
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
    uses = units_used(compiled.ir)
    assert [a.key for a in forward_only(compiled.plans[0], uses)] == [
        "0ALL_GATHER_F0", "0F0", "0SEND_F0>1.0", "0F1", "0SEND_F1>1.0", "0B1"]    # B1: its release alone
    last = forward_only(compiled.plans[1], uses)     # dp=0, pp=1: the last stage
    assert [a.node.op for a in last] == ["RECV", "ALL_GATHER", "F", "RECV", "F", "B"]
    assert is_release_only(last[-1]) and last[-1].release == (1,)
    keys = {a.key for a in last}
    assert all(w in keys for a in last for w in a.waits)


def _walk(plan, uses):
    """Run the forward-only `plan`'s gathers and releases: the ZeRO-3 units each forward finds
    unavailable (nothing gathered, or a gather it does not wait for), and those gathered at the end."""
    gathered, waited, missing = {}, set(), []
    zero3 = {a.node.region for a in plan if a.node.op == "ALL_GATHER" and a.node.phase}
    for a in plan:
        waited.update(a.waits)
        if a.node.op == "ALL_GATHER" and a.node.phase:
            assert a.node.region not in gathered, f"{a.key}: gathers a unit that is gathered"
            gathered[a.node.region] = a.key
        elif a.node.op == "F":
            missing += [(a.key, u) for u in uses[a.node.region]
                        if u in zero3 and (u not in gathered or gathered[u] not in waited)]
        if a.node.is_compute:
            assert a.node.op == "F" or is_release_only(a) and a.release
            for u in a.release:
                gathered.pop(u, None)
    return missing, gathered


@pytest.mark.parametrize("script,stages", [
    ("use one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n", 2),
    ("use dualpipev(microbatches=4) on pp\nuse zero3() on dp\n", 4),
    ("use zbv(microbatches=4) on pp\nuse zero3() on dp\n", 4),
    ("use interleaved_zero_bubble(microbatches=4) on pp\nuse zero3() on dp\n", 4)])
def test_forwards_read_gathered_parameters_with_a_region_per_block(script, stages):
    """With a region per block 1F1B runs `0B0 0F2` back to back, 0F2 on the parameters gathered for
    0B0: the forward-only plan keeps that gather, 0F2 waits on it, and the backward's release stays."""
    from examples.gpt import make_model
    from piper.frontend.capture import capture
    from piper.job import plan

    model = make_model(n_layer=stages, n_regions=stages, layer_regions=True, n_embd=32, n_head=2, block_size=16)[0]
    compiled = plan(load_strategy(script), mesh={"dp": 2, "pp": 2},
                    program=capture(model, tuple(x[:2] for x in gpt_batches(1)[0])))
    uses = units_used(compiled.ir)
    for rank, device_plan in compiled.plans.items():
        missing, left = _walk(forward_only(device_plan, uses), uses)
        assert missing == [] and left == {}, rank
    if stages == 2:
        first = {a.key: a for a in forward_only(compiled.plans[0], uses)}
        assert "0ALL_GATHER_B0" in first and "0ALL_GATHER_B0" in first["0F2"].waits
        assert "1B0" in first and first["1B0"].release == (1,)      # kept for its release alone
        assert not any(k.startswith("1ALL_GATHER_B") for k in first)    # read by no forward: dropped


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


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("worker_read", [False, True], ids=["batches-from-the-driver", "data-file"])
def test_a_failing_evaluation_leaves_the_checkpoint_of_its_step_saved(tmp_path, monkeypatch, worker_read):
    """`piper run --eval-every 1 --checkpoint-every 1`: step 1's checkpoint is written before its
    evaluation runs, so an evaluation that fails (a worker raising at its first action) costs no
    checkpoint: training could resume from step 1. Both loops of `recovery.train`: a `job.step` per
    step (the model file's batches) and `job.train`'s stretches (`--data`, the workers reading)."""
    import numpy as np

    from examples.gpt import _corpus_tokens
    from piper.cli import main
    from piper.job.checkpoint import checkpoints
    from piper.job.recovery import checkpoint_problem

    tokens = _corpus_tokens()[1].numpy().astype(np.uint16)
    tokens[:4000].tofile(tmp_path / "train.bin")
    tokens[4000:6000].tofile(tmp_path / "val.bin")
    (tmp_path / "job.pps").write_text("mesh dp=2\nuse zero3() on dp\n")
    # The first action rank 0 runs once it has finished one step: step 1's evaluation.
    monkeypatch.setenv("PIPER_FAULT", "rank=0 do=raise step=1")
    ckpt = tmp_path / "ckpt"
    argv = ["run", str(tmp_path / "job.pps"), "--model", "examples/gpt.py:two_stage_gpt", "--steps", "3",
            "--batch-size", "4", "--val-data", str(tmp_path / "val.bin"), "--block-size", "16",
            "--eval-every", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    if worker_read:
        argv += ["--data", str(tmp_path / "train.bin")]
    try:
        code = main(argv)
    except piper.PiperError as err:
        code, failed = 1, err
    else:
        failed = None
    assert code != 0 and (failed is None or failed.code == "worker-failed")
    assert checkpoints(ckpt) == [(1, str(ckpt / "step-1"))]
    assert checkpoint_problem(ckpt / "step-1") is None
