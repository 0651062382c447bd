"""Which expert group the calling thread's MoE ops exchange tokens over, and the seconds it spent there.

    with lane_group(groups, lane):   # the runtime, around one lane's compute
        current()                    # `piper.nn`'s dispatch/combine: that lane's group (None on one device)

Pure Python, below both the front end's ops (`piper.nn`) and the runtime's expert groups
(`piper.runtime.moe.expert_groups`, which makes the groups and sets the default): the ops ask, the runtime answers.
"""
from __future__ import annotations

import contextlib
import threading

_thread = threading.local()
_default = None      # lane 0's group (and CUDA's autograd threads, where backward runs)


def forget() -> None:
    """Drop the last job's groups (a kept worker's `reset`): a job without EP must not find them."""
    global _default, _thread
    _default = None
    _thread = threading.local()


def set_default(group) -> None:
    """The group of threads that entered no lane (lane 0's; None without expert parallelism)."""
    global _default
    _default = group


def current():
    """The calling thread's expert group; None on one device (the ops' local meaning)."""
    return getattr(_thread, "group", None) or _default


def add_seconds(seconds: float) -> None:
    """Count time the calling thread spent in an expert all-to-all."""
    _thread.seconds = getattr(_thread, "seconds", 0.0) + seconds


def take_seconds() -> float:
    """Seconds the calling thread spent in expert all-to-alls since it last asked (and reset them)."""
    seconds, _thread.seconds = getattr(_thread, "seconds", 0.0), 0.0
    return seconds


@contextlib.contextmanager
def lane_group(groups, lane: int):
    """Run the body with lane `lane`'s expert group (overlapped slots: one group per lane)."""
    if not groups:
        yield
        return
    previous = getattr(_thread, "group", None)
    _thread.group = groups[lane]
    try:
        yield
    finally:
        _thread.group = previous
