"""`job.train(steps)`: the workers step on their own data without a driver call per step, and train
exactly as the same number of `job.step()` calls (float64: losses to the bit, every parameter equal),
with evaluations and saves inside the loop; a dead worker is named as in a step; a non-finite loss
stops at the step `job.step()` stops at."""
import copy
import functools

import pytest
import torch

import piper
import piper.job.checkpoint
from examples import llama_tp, moe
from piper.job import Job
from piper.dsl.script import load_strategy
from tests.test_data import blocks
from tests.helpers import wait_gone
from tests.test_train import gpt

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2)


@piper.strategy
def tensor_parallel(s):
    llama_tp.tensor_parallel(s, sequence=True)


COMPOSITIONS = {         # strategy, mesh, model
    "dp": ("use dp() on dp\n", {"dp": 2}, lambda: gpt(4, torch.float64)),
    "zero3-1f1b": ("use one_f_one_b(microbatches=2) on pp\nuse zero3() on dp\n", {"dp": 2, "pp": 2},
                   lambda: gpt(2, torch.float64)),
    "dualpipev": ("use dualpipev(microbatches=4) on pp\n", {"pp": 2}, lambda: gpt(4, torch.float64)),
    "tp-sp": (tensor_parallel, {"tp": 2}, lambda: llama_tp.make_model(torch.float64, vocab=128)),
    "ep": ("use dp() on dp\nuse expert_parallel() on dp\n", {"dp": 2}, lambda: moe.make_model(dtype=torch.float64)),
}


def _compile(model, script, mesh, **kw):
    strategy = load_strategy(script) if isinstance(script, str) else script
    return piper.compile(copy.deepcopy(model), None, strategy=strategy, mesh=mesh,
                         optimizer=OPTIMIZER, data=blocks(), batch_size=8, shuffle=True, seed=2,
                         val_data=blocks(16), lr_schedule=piper.warmup_cosine(2, 6), **kw)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_train_equals_as_many_steps(name, tmp_path):
    script, mesh, make = COMPOSITIONS[name]
    model = make()
    with _compile(model, script, mesh) as job:
        stepped = [job.step() for _ in range(5)]
        evaluated = job.evaluate(batches=2)
        stepped_state = job.state_dict()
    seen = []
    with _compile(model, script, mesh) as job:
        metrics = job.train(5, eval_every=5, eval_batches=2, save_every=2, save_dir=tmp_path / "ckpt",
                            on_metrics=lambda step, m: seen.append((step, dict(m))))
        assert job.steps == 5 and job.data_position == 5
        state = job.state_dict()
    assert [m["loss"] for m in metrics] == stepped                     # to the bit
    for key, value in stepped_state.items():
        assert torch.equal(state[key], value), key
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5] and metrics[-1]["eval_loss"] == evaluated
    assert all(m["tokens"] == 8 * 16 and m["seconds"] > 0 for m in metrics)
    assert [m["lr_scale"] for m in metrics] == [piper.warmup_cosine(2, 6)(k) for k in range(5)]
    # Each step's metrics reach on_metrics once, in order, and the evaluation after its step.
    assert [s for s, m in seen if "loss" in m] == [1, 2, 3, 4, 5]
    assert seen[-1] == (5, {"eval_loss": evaluated})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2", "step-4"]
    assert piper.job.checkpoint.read_info(str(tmp_path / "ckpt" / "step-4"))["step"] == 4


class _Counting:
    """An actor handle whose method calls are counted: what the driver sends a worker."""

    def __init__(self, actor, calls):
        self._actor, self._calls = actor, calls

    def __getattr__(self, name):
        method = getattr(self._actor, name)
        calls = self._calls

        class Counted:
            def remote(self, *args, **kwargs):
                calls.append(name)
                return method.remote(*args, **kwargs)
        return Counted()


@pytest.mark.usefixtures("ray_cluster")
def test_the_driver_calls_each_worker_once_per_train_whatever_the_steps():
    script, mesh, make = COMPOSITIONS["dp"]
    counts = {}
    with _compile(make(), script, mesh) as job:
        for steps in (1, 6):
            calls = []
            job.actors = [_Counting(actor, calls) for actor in job.actors]
            job.train(steps)
            job.actors = [actor._actor for actor in job.actors]
            counts[steps] = [c for c in calls if c != "train_progress"]
    assert counts[1] == counts[6] == ["train_data", "train_data"]


@pytest.mark.usefixtures("ray_cluster")
def test_a_non_finite_loss_stops_train_where_step_stops():
    script, mesh, make = COMPOSITIONS["dp"]
    model = make()
    inf = functools.partial(torch.optim.SGD, lr=float("inf"))
    errors = []
    for run in ("step", "train"):
        with piper.compile(copy.deepcopy(model), None, strategy=load_strategy(script), mesh=mesh, optimizer=inf,
                           data=blocks(), batch_size=8) as job:
            with pytest.raises(piper.PiperError) as err:
                if run == "step":
                    for _ in range(5):
                        job.step()
                else:
                    job.train(5)
            errors.append((err.value.code, str(err.value), job.steps, job.data_position))
    assert errors[0] == errors[1] and errors[0][0] == "non-finite" and errors[0][2] < 5


@pytest.mark.usefixtures("ray_cluster")
def test_a_worker_killed_mid_train_is_named():
    script, mesh, make = COMPOSITIONS["zero3-1f1b"]
    job = _compile(make(), script, mesh, timeout=20,
                   worker_env={"PIPER_FAULT": "rank=2 action=0F1 do=kill step=2 delay=1"})
    where = job.placement()
    with pytest.raises(piper.PiperError) as err:
        job.train(5)
    assert err.value.code == "worker-died"
    assert f"rank 2 (dp=1, pp=0) on node {where[2]['node'][:8]}" in str(err.value)
    assert "while running 0F1" in str(err.value)
    assert not wait_gone(job.pids), "a worker process outlived its job"


def test_train_needs_data_and_whole_numbers():
    job = Job.__new__(Job)
    job._closed, job.data, job.val_data = False, None, None
    with pytest.raises(piper.PiperError, match="without data="):
        job.train(3)
    job.data = object()
    for kw in ({"steps": -1}, {"steps": 2.5}, {"steps": 2, "eval_every": 0}, {"steps": 2, "eval_every": 2},
               {"steps": 2, "save_every": 1}):
        with pytest.raises(piper.PiperError) as err:
            job.train(kw.pop("steps"), **kw)
        assert err.value.code == "bad-inputs"


@pytest.mark.usefixtures("ray_cluster")
def test_piper_run_with_data_read_by_the_workers_trains_through_train(tmp_path, monkeypatch):
    """`piper run --data` never calls `job.step`: its steps run as `job.train`'s stretches, cut where a
    checkpoint and an evaluation are due, and the progress, metrics and checkpoints are as before."""
    import json

    import numpy as np

    from examples.gpt import _corpus_tokens
    from piper.cli import main

    tokens = _corpus_tokens()[1].numpy().astype(np.uint16)
    tokens[:4000].tofile(tmp_path / "train.bin")
    tokens[4000:6000].tofile(tmp_path / "val.bin")
    (tmp_path / "job.pps").write_text("mesh dp=2\nuse dp() on dp\n")
    stretches = []
    real_train = Job.train

    def train(job, steps, **kw):
        stretches.append(steps)
        return real_train(job, steps, **kw)

    monkeypatch.setattr(Job, "step", lambda *a, **k: pytest.fail("piper run --data called job.step"))
    monkeypatch.setattr(Job, "train", train)
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(tmp_path / "job.pps"), "--model", "examples/gpt.py:small_gpt", "--steps", "5",
                 "--batch-size", "4", "--data", str(tmp_path / "train.bin"), "--val-data", str(tmp_path / "val.bin"),
                 "--block-size", "32", "--eval-every", "3", "--eval-batches", "1", "--checkpoint-dir",
                 str(tmp_path / "ckpt"), "--checkpoint-every", "2", "--metrics", str(metrics)]) == 0
    assert stretches == [2, 1, 1, 1]                        # to the saves at 2 and 4, the evaluation at 3, the end
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == ["step-4", "step-5"]
