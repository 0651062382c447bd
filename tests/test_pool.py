"""PIPER_KEEP_WORKERS: a closed job's workers serve the next job of the same shape, and
nothing of the old job reaches the new one."""
import os
import time

import pytest
import torch

import piper
from examples.gpt import _corpus_tokens, batches, make_model
from piper.dsl.script import load_strategy
from piper.runtime.launch import pool

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture
def keep(monkeypatch):
    monkeypatch.setenv("PIPER_KEEP_WORKERS", "1")
    pool.release()
    yield
    pool.release()


def _model_and_batch():
    torch.manual_seed(0)
    model, _ = make_model(n_layer=2, n_regions=2, n_embd=32, n_head=2, block_size=16)
    return model.double(), next(batches(_corpus_tokens()[1], 8, 16, seed=1))


def _train(model, batch, script, mesh):
    with piper.compile(model, batch, strategy=load_strategy(script), mesh=mesh) as job:
        losses = [job.step(*batch) for _ in range(2)]
        return losses, job.pids, job.state_dict()


def _gone(pid, wait=30.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.usefixtures("keep")
def test_a_kept_worker_trains_the_next_job_exactly_as_a_new_one():
    model, batch = _model_and_batch()
    one_f_one_b = "use one_f_one_b(microbatches=2) on pp\nuse {}() on dp\n"
    fresh, pids, state = _train(model, batch, one_f_one_b.format("zero3"), {"dp": 2, "pp": 2})
    # Another strategy on the same mesh: the same processes, new process groups and plans.
    _, again, _ = _train(model, batch, one_f_one_b.format("dp"), {"dp": 2, "pp": 2})
    assert again == pids
    kept, again, kept_state = _train(model, batch, one_f_one_b.format("zero3"), {"dp": 2, "pp": 2})
    assert again == pids
    assert kept == fresh
    for name, value in state.items():
        torch.testing.assert_close(kept_state[name], value, rtol=0, atol=0)
    # A mesh of another shape gets workers of its own; release() stops every kept one.
    _, other, _ = _train(model, batch, "use dp() on dp\n", {"dp": 2})
    assert not set(other) & set(pids)
    assert pool.release() == 6
    assert all(_gone(pid) for pid in [*pids, *other])


@pytest.mark.usefixtures("keep")
def test_the_workers_of_a_failed_job_are_not_kept():
    import ray

    model, batch = _model_and_batch()
    job = piper.compile(model, batch, strategy=load_strategy("use dp() on dp\n"), mesh={"dp": 2})
    job.step(*batch)
    pids = job.pids
    ray.kill(job.actors[1])
    with pytest.raises(piper.PiperError):
        job.step(*batch)
    job.close()
    assert pool.release() == 0
    assert all(_gone(pid) for pid in pids)
