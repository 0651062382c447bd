"""A local Ray cluster `piper run` starts goes with it, even killed with -9 while its workers start
(`piper/runtime/launch/cluster_reaper.py`): without the watcher, the raylet's DashboardAgent and
RuntimeEnvAgent outlived the driver by minutes.

The test finds the cluster's processes as the watcher does, and kills only those: the raylet the
`piper run` process started, and every process whose environment names that raylet."""
import os
import signal
import subprocess
import sys
import time

import pytest

from piper.runtime.launch import cluster_reaper
from tests.test_checkpoint_lock import MODEL_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GONE_WITHIN_S = 30      # the agents outlived a killed driver by 60 s and more (each waits 60 s on the dead GCS)


def _alive(noted: dict[int, int]) -> dict[int, int]:
    """Those of `noted` ({pid: start time}) still running as the same process."""
    return {pid: began for pid, began in noted.items() if (cluster_reaper._stat(pid) or (0, "", -1))[2] == began}


def test_a_local_cluster_goes_with_a_driver_killed_while_workers_start(tmp_path):
    (tmp_path / "m.py").write_text(MODEL_FILE)
    (tmp_path / "s.pps").write_text("mesh dp=2\nuse dp() on dp\n")
    driver = subprocess.Popen([sys.executable, "-m", "piper.cli", "run", str(tmp_path / "s.pps"), "--model",
                               f"{tmp_path}/m.py:make", "--steps", "100000", "--batch-size", "8", "--device", "cpu"],
                              cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    noted: dict[int, int] = {}          # the run's cluster: its raylet and everything below it
    try:
        for line in driver.stderr:                 # until the workers are being placed
            if "placing" in line:
                break
        # The raylet starts its agents a few seconds after itself: wait for them (what outlived the
        # driver), as the workers start.
        agents, names = {"ray::DashboardA", "ray::RuntimeEnv"}, set()     # as /proc keeps them (15 bytes)
        for _ in range(240):
            raylet = cluster_reaper._raylet_of(driver.pid)
            if raylet is not None:
                noted.update({raylet[0]: raylet[1], **cluster_reaper._descendants(raylet[0])})
            names = {s[1] for s in map(cluster_reaper._stat, noted) if s}
            if agents <= names or driver.poll() is not None:
                break
            time.sleep(0.25)
        assert agents <= names, f"the run's cluster has no agents yet: {names}"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    left = _alive(noted)
    deadline = time.monotonic() + GONE_WITHIN_S
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _alive(left)
    names = [cluster_reaper._stat(p) for p in left]
    for pid in left:                               # the test's own cluster only: never leave it behind
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes of the killed run's cluster still alive after {GONE_WITHIN_S} s: {names}"
