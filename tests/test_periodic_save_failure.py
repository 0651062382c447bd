"""A periodic checkpoint that cannot be written (a full disk: OSError ENOSPC) is reported and training
goes on, the next save trying again; a final one that fails ends the run saying which steps no
checkpoint holds (`piper.job.recovery.Checkpoints`, `piper run`)."""
import errno
import os

import pytest

from piper.cli import main
from piper.diagnostics import PiperError, error
from piper.job.recovery import Checkpoints, StepData, train
from tests.test_checkpoint_lock import MODEL_FILE
from tests.test_recovery import _FakeJob

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DATA = StepData(lambda: ((float(k),) for k in range(100)))


class _Job(_FakeJob):
    """Sums its batches; the saves after the steps in `full` fail as `job.save` does on a full disk."""

    def __init__(self, full):
        super().__init__([])
        self.full = full

    def step(self, x):
        self.weight += x
        self.steps += 1
        return self.weight

    def save(self, path):
        if self.steps in self.full:
            raise error("checkpoint-save-failed", "the checkpoint could not be written: OSError: [Errno 28] "
                        "No space left on device", hint="make room")
        super().save(path)


def test_a_failed_periodic_save_is_reported_and_training_goes_on(tmp_path):
    failed = []
    ckpt = Checkpoints(str(tmp_path), every=2, on_save_failed=lambda path, err, lost: failed.append(
        (os.path.basename(path), lost)))
    losses, _ = train(lambda: _Job({4}), DATA, 6, checkpoints=ckpt)
    assert len(losses) == 6
    assert failed == [("step-4", f"steps 3-4 are in no checkpoint; the last one is {tmp_path}/step-2")]
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-6"]     # the next save wrote, and rotated


def test_a_failed_final_save_ends_the_run_saying_what_no_checkpoint_holds(tmp_path):
    ckpt = Checkpoints(str(tmp_path), every=4)
    with pytest.raises(PiperError) as info:
        train(lambda: _Job({6}), DATA, 6, checkpoints=ckpt)
    assert info.value.code == "checkpoint-save-failed"
    assert f"steps 5-6 are in no checkpoint; the last one is {tmp_path}/step-4" in str(info.value)


@pytest.mark.usefixtures("ray_cluster")
def test_piper_run_goes_on_past_a_full_disk_and_saves_at_the_next_checkpoint(tmp_path, capsys, monkeypatch):
    import piper.job.checkpoint as checkpoint

    (tmp_path / "m.py").write_text(MODEL_FILE)
    (tmp_path / "s.pps").write_text("split MB into 2\n")
    ckpt = tmp_path / "ckpt"
    real = checkpoint._write_manifest
    writes = []

    def full_disk_once(directory, *args, **kwargs):   # the driver's part of the second save: the disk is full
        writes.append(directory)
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(directory, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "_write_manifest", full_disk_once)
    assert main(["run", str(tmp_path / "s.pps"), "--model", f"{tmp_path}/m.py:make", "--steps", "6",
                 "--batch-size", "4", "--device", "cpu", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "No space left on device" in err and "training goes on" in err
    assert f"steps 3-4 are in no checkpoint; the last one is {ckpt}/step-2" in err
    assert "loss" in err and "over 6 steps" in err
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step-2", "step-6"]
