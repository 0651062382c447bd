"""A local Ray cluster goes with the process that started it, however that process ends.

Ray ties its head processes (GCS, raylet, monitors) to the driver that started them (they get
SIGKILL when it dies), but not what the raylet starts: killed with -9 while workers join, the
driver leaves the raylet's `DashboardAgent` and `RuntimeEnvAgent` behind. Each sees its raylet die
and then waits up to 60 s per agent to tell the (dead) GCS so (measured on Ray 2.60: about 2.5
minutes), and a worker may be left too. So Piper starts a small watcher beside a local cluster:

    watch_local_cluster()         # before ray.init(address="local")

The watcher (this file run as a script: standard library only, no torch, no Ray) holds the read end of
a pipe from the driver. It finds the driver's raylet among its children and, every second, notes the
raylet's descendants (agents, workers and what they start). When the pipe closes (the driver exited
or was killed) it kills the processes of that raylet: the raylet, every descendant noted that is still
the same process (same start time), and each process whose environment names the raylet
(`RAY_RAYLET_PID`, set for what it starts; an agent's title can overwrite it, hence the notes). The
raylet dies with the driver and its children pass to init at once, so the notes are what find them.
Nothing else is touched: another cluster on the machine has another raylet.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

_watcher = None          # the Popen of this process's watcher; its stdin pipe lives as long as we do


def watch_local_cluster() -> None:
    """Start this process's watcher, once (Linux only: it reads /proc)."""
    global _watcher
    if _watcher is not None and _watcher.poll() is None or not sys.platform.startswith("linux"):
        return
    _watcher = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)


# -- the watcher: run as a script -----------------------------------------------------------------

def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, command name, start time in clock ticks) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), name, int(fields[19])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _raylet_of(driver: int) -> tuple[int, int] | None:
    """(pid, start time) of the raylet the driver started, or None yet."""
    for pid in _pids():
        info = _stat(pid)
        if info is not None and info[0] == driver and info[1] == "raylet":
            return pid, info[2]
    return None


def _descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every process below `root` now."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid in _pids():
        info = _stat(pid)
        if info is not None:
            children.setdefault(info[0], []).append((pid, info[2]))
    found, todo = {}, [root]
    while todo:
        for pid, began in children.get(todo.pop(), ()):
            if pid not in found:
                found[pid] = began
                todo.append(pid)
    return found


def _names_raylet(pid: int, raylet: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"RAY_RAYLET_PID={raylet}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _cluster(raylet: tuple[int, int], noted: dict[int, int] | None = None) -> list[int]:
    """The raylet, the processes `noted` below it that are still the same, and every process of the
    same user started after it that names it."""
    pid, began = raylet
    noted = {**(noted or {}), **_descendants(pid)} if _same(pid, began) else dict(noted or {})
    uid, found = os.getuid(), []
    for other in _pids():
        info = _stat(other)
        if info is None or info[2] < began:
            continue
        try:
            if os.stat(f"/proc/{other}").st_uid != uid:
                continue
        except OSError:
            continue
        if (other == pid and info[2] == began) or noted.get(other) == info[2] or _names_raylet(other, pid):
            found.append(other)
    return found


def _same(pid: int, began: int) -> bool:
    """Whether `pid` is still the process that started at `began`."""
    info = _stat(pid)
    return info is not None and info[2] == began


def _reap(raylet: tuple[int, int], noted: dict[int, int]) -> None:
    """Kill the cluster until two looks in a row find nothing (the raylet may start a worker as it dies)."""
    quiet = 0
    for _ in range(50):
        victims = _cluster(raylet, noted)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        quiet = 0 if victims else quiet + 1
        if quiet >= 2:
            return
        time.sleep(0.2)


def _watch(driver: int) -> None:
    """Wait for the driver to end (its pipe closes, or it is gone), then reap its raylet's cluster."""
    began = (_stat(driver) or (0, "", 0))[2]
    raylet, noted = None, {}
    while True:
        ready, _, _ = select.select([0], [], [], 0.5 if raylet is None else 1.0)
        if ready and not os.read(0, 4096):
            break                                    # the pipe closed: the driver has ended
        if not _same(driver, began):
            break
        if raylet is not None and not _same(*raylet):
            _reap(raylet, noted)                     # what its dying raylet left (agents, workers)
            raylet, noted = None, {}                 # the driver may start another cluster
        if raylet is None:
            raylet = _raylet_of(driver)
        if raylet is not None:
            noted.update(_descendants(raylet[0]))
    if raylet is not None:
        _reap(raylet, noted)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a Ctrl-C is the driver's to handle
    _watch(int(sys.argv[1]))
