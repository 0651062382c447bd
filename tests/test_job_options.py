"""piper.compile's runtime options: overlapped slots in lanes or in turn, and the workers' environment."""
import os

import pytest
import ray
import torch

import piper
from piper.dsl.script import load_strategy
from tests.test_train import gpt, gpt_batches

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _run(strategy, mesh, regions, **options):
    model = gpt(regions, dtype=torch.float64)
    batches = gpt_batches(batch=4)
    with piper.compile(model, batches[0], strategy=strategy, mesh=mesh, **options) as job:
        losses = [job.step(*b) for b in batches]
        return losses, job.state_dict(), job.timings()


def test_overlapped_slots_train_the_same_in_lanes_and_in_turn():
    strategy = load_strategy("use dualpipev(microbatches=4) on pp\n")
    lanes = _run(strategy, {"pp": 2}, 4)
    turn = _run(strategy, {"pp": 2}, 4, overlap=False)
    assert lanes[0] == pytest.approx(turn[0], rel=1e-12)
    for name, value in turn[1].items():
        torch.testing.assert_close(lanes[1][name], value, rtol=1e-12, atol=1e-12)
    # Slots that ran in lanes are timed as a whole too; in turn, only action by action.
    assert any("&" in k for k in lanes[2][0]) and not any("&" in k for k in turn[2][0])


def _env(worker, name):
    return os.environ.get(name)


def test_worker_env_reaches_the_worker_processes():
    model = gpt(2)
    batch = gpt_batches(steps=1, batch=4)[0]
    with piper.compile(model, batch, strategy=load_strategy("use dp() on dp\n"), mesh={"dp": 2},
                       worker_env={"PIPER_TEST_WORKER_ENV": 1}) as job:
        assert ray.get([a.__ray_call__.remote(_env, "PIPER_TEST_WORKER_ENV") for a in job.actors]) == ["1", "1"]
