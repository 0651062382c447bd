"""One run per checkpoint folder (`piper/job/checkpoint_lock.py`): a second `piper run` given a folder
in use is refused with checkpoint-dir-busy naming the holder, before it trains; the first run's
checkpoints stay whole; a lock left by a dead run blocks nothing."""
import os
import signal
import subprocess
import sys

import pytest

from piper.cli import main
from piper.diagnostics import PiperError
from piper.job import checkpoint_lock
from piper.job.recovery import Checkpoints, checkpoint_problem
from tests.test_recovery_holds import MODEL_FILE      # the same two-stage model, trained by piper run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


HOLD = """
import sys, time
from piper.job import checkpoint_lock
checkpoint_lock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def holder(directory):
    """A process holding `directory`'s lock, once it says so."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_holder_in_the_same_process_is_refused_until_the_first_lets_go(tmp_path):
    with checkpoint_lock.hold(str(tmp_path / "ckpt")):
        with pytest.raises(PiperError) as info:
            checkpoint_lock.acquire(str(tmp_path / "ckpt"))
        assert info.value.code == "checkpoint-dir-busy"
        assert f"pid {os.getpid()} on host " in str(info.value) and "own --checkpoint-dir" in str(info.value)
    checkpoint_lock.release(checkpoint_lock.acquire(str(tmp_path / "ckpt")))


def test_a_lock_held_by_another_process_names_it_and_is_free_once_it_is_killed(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(PiperError) as info:
            checkpoint_lock.acquire(str(tmp_path))
        assert info.value.code == "checkpoint-dir-busy" and f"pid {proc.pid} on host" in str(info.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The dead run's note is still in the file, and blocks nothing.
    assert f'"pid": {proc.pid}' in (tmp_path / checkpoint_lock.LOCK_FILE).read_text()
    with checkpoint_lock.hold(str(tmp_path)):
        assert f'"pid": {os.getpid()}' in (tmp_path / checkpoint_lock.LOCK_FILE).read_text()


def test_a_lock_file_that_is_a_fifo_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / checkpoint_lock.LOCK_FILE)
    with pytest.raises(PiperError) as info:
        checkpoint_lock.acquire(str(tmp_path))
    assert info.value.code == "unreadable-file" and "not a regular file" in str(info.value)


@pytest.mark.usefixtures("ray_cluster")
def test_a_second_run_on_the_same_checkpoint_dir_is_refused_and_the_first_keeps_its_checkpoints(
        tmp_path, capsys, monkeypatch):
    (tmp_path / "m.py").write_text(MODEL_FILE)
    (tmp_path / "s.pps").write_text("split MB into 2\n")
    ckpt = tmp_path / "ckpt"

    def run(steps):
        return main(["run", str(tmp_path / "s.pps"), "--model", f"{tmp_path}/m.py:make", "--steps", str(steps),
                     "--batch-size", "4", "--device", "cpu", "--checkpoint-dir", str(ckpt),
                     "--checkpoint-every", "2"])

    second = []
    after_step = Checkpoints.after_step

    def save_then_start_another(self, job, steps_done, last=False):
        path = after_step(self, job, steps_done, last)
        if path and not second:                 # the first run holds the folder: another starts now
            capsys.readouterr()                 # the first run's lines so far
            second.append((run(3), " ".join(capsys.readouterr().err.split())))
        return path
    monkeypatch.setattr(Checkpoints, "after_step", save_then_start_another)
    assert run(6) == 0
    code, err = second[0]
    assert code == 1 and "error[checkpoint-dir-busy]" in err and f"pid {os.getpid()} on host" in err
    assert "workers ready" not in err                      # refused before it trained
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step-4", "step-6"]
    assert all(checkpoint_problem(str(ckpt / name)) is None for name in ("step-4", "step-6"))
    # Once the first run has ended the folder is free again.
    monkeypatch.setattr(Checkpoints, "after_step", after_step)
    assert main(["run", str(tmp_path / "s.pps"), "--model", f"{tmp_path}/m.py:make", "--steps", "8",
                 "--batch-size", "4", "--device", "cpu", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                 "--resume"]) == 0
    assert "loaded checkpoint" in capsys.readouterr().err
