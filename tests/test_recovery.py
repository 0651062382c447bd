"""Recovery (`piper.job.recovery`): a run that loses a worker restarts, reloads its last
checkpoint, replays from its step, and ends exactly where an uninterrupted run does."""
import functools
import os

import pytest
import torch

import piper
from piper.job.recovery import Checkpoints, StepData, train
from piper.testing import single_device
from tests.test_train import gpt, gpt_batches, pipeline


class _FakeJob:
    """Stands in for a Job in the recovery loop: 'trains' by summing its batches (`lost` adds `step`)."""

    def __init__(self, log):
        self.log, self.weight, self.closed, self.steps = log, 0.0, False, 0

    def save(self, path):
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.tensor(self.weight, dtype=torch.float64), "steps": torch.tensor(self.steps)},
                 checkpoint_id=path, no_dist=True)      # a real DCP directory: `.metadata` and a shard

    def load(self, path):
        import torch.distributed.checkpoint as dcp

        state = {"w": torch.tensor(0.0, dtype=torch.float64), "steps": torch.tensor(0)}
        dcp.load(state, checkpoint_id=path, no_dist=True)
        self.weight, self.steps = float(state["w"]), int(state["steps"])

    def placement(self):
        return {0: {"node": "n1"}}

    def close(self):
        self.closed = True


def test_recovery_replays_from_the_last_checkpoint_to_the_uninterrupted_result(tmp_path):
    from piper.diagnostics import error

    def lost(job):
        def step(x):
            if job.steps == 5 and not lost.done:
                lost.done = True
                raise error("worker-died", "rank 1 died during `step`")
            job.weight += x
            job.steps += 1
            return job.weight
        job.step = step
        return job
    lost.done = False
    data = StepData(lambda: ((float(k),) for k in range(100)))
    assert [data(k) for k in (0, 1, 2, 1, 7)] == [(0.0,), (1.0,), (2.0,), (1.0,), (7.0,)]  # per step, any order
    jobs = []

    def start():
        jobs.append(lost(_FakeJob(jobs)))
        return jobs[-1]

    restarts = []
    ckpt = Checkpoints(str(tmp_path / "ckpt"), every=2)
    losses, done = train(start, data, 8, max_restarts=1, checkpoints=ckpt, on_restart=restarts.append)
    uninterrupted = [sum(range(k + 1)) for k in range(8)]
    assert losses == uninterrupted
    assert len(jobs) == 2 and all(j.closed for j in jobs)
    (r,) = done
    assert (r.failed_at, r.resumed_from, r.error.code) == (5, 4, "worker-died") and restarts == done
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-6", "step-8"]   # the last two kept

    # Without checkpoints the run starts over; past max_restarts the error is raised.
    lost.done, jobs[:] = False, []
    assert train(start, data, 8, max_restarts=1)[0] == uninterrupted and len(jobs) == 2
    lost.done, jobs[:] = False, []
    with pytest.raises(piper.PiperError, match="rank 1 died"):
        train(start, data, 8, max_restarts=0)
    assert jobs[0].closed



@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_worker_is_replaced_and_the_run_replays_from_its_checkpoint(tmp_path, monkeypatch):
    steps, batches = 4, gpt_batches(4)
    marker = str(tmp_path / "killed")
    # Rank 1 dies in its third step (step 2 of the run) once; the restarted workers carry the same
    # environment, and the marker keeps them alive.
    monkeypatch.setenv("PIPER_FAULT", f"rank=1 action=1F0 do=kill step=2 once={marker}")
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    model = gpt(2, torch.float64)
    jobs = []

    def start():
        jobs.append(piper.compile(model, batches[0], strategy=pipeline(2), mesh={"pp": 2}, optimizer=optimizer,
                                  timeout=30))
        return jobs[-1]

    ckpt = Checkpoints(str(tmp_path / "ckpt"), every=2)
    losses, restarts = train(start, StepData(lambda: iter(batches)), steps, max_restarts=1, checkpoints=ckpt)
    (r,) = restarts
    assert (r.error.code, r.failed_at, r.resumed_from) == ("worker-died", 2, 2)
    assert "rank 1 (pp=1)" in str(r.error) and os.path.exists(marker)
    ref_losses, _ = single_device(gpt(2, torch.float64), batches, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)
    assert len(jobs) == 2 and all(j._closed for j in jobs)
