"""Which tensor-parallel group the calling thread's TP ops reduce over.

    with lane_group(groups, lane):   # the runtime, around one lane's compute
        current()                    # `piper.tensor_ops`' collectives: that lane's group (None on one device)

Pure Python, below both the ops (`piper.tensor_ops`) and the runtime that makes the
groups (`piper.runtime` sets the default and the lanes): the ops ask, the runtime
answers. One group per lane, as for the expert groups (`piper.expert_context`):
two threads issuing collectives on one Gloo group give silently wrong results.
"""
from __future__ import annotations

import contextlib
import threading

_thread = threading.local()
_default = None      # lane 0's group (and threads that entered no lane, such as CUDA's autograd threads)


def forget() -> None:
    """Drop the last job's groups (a kept worker's `reset`)."""
    global _default, _thread
    _default = None
    _thread = threading.local()


def set_default(group) -> None:
    global _default
    _default = group


def current():
    """The calling thread's tensor-parallel group; None where nothing is divided."""
    return getattr(_thread, "group", None) or _default


def add_seconds(seconds: float) -> None:
    """Count time the calling thread spent in a tensor-parallel collective."""
    _thread.seconds = getattr(_thread, "seconds", 0.0) + seconds


def take_seconds() -> float:
    """Seconds the calling thread spent in tensor-parallel collectives since it last asked."""
    seconds, _thread.seconds = getattr(_thread, "seconds", 0.0), 0.0
    return seconds


@contextlib.contextmanager
def lane_group(groups, lane: int):
    """Run the body with lane `lane`'s group (overlapped slots: one group per lane)."""
    if not groups:
        yield
        return
    previous = getattr(_thread, "group", None)
    _thread.group = groups[lane]
    try:
        yield
    finally:
        _thread.group = previous


class Alone:
    """A stand-in group of `size` devices for running a graph divided over tp in one process
    (measuring its regions' compute and saved bytes: `memory_model.run_regions`): the shapes of
    every collective, none of its data (all-reduces leave their input, gathers repeat it)."""

    def __init__(self, size: int):
        self.size, self.index = size, 0

    def all_reduce(self, t, op: str = "sum") -> None:
        pass

    def all_gather(self, x, dim: int):
        import torch

        return torch.cat([x] * self.size, dim)

    def reduce_scatter(self, x, dim: int):
        return x.chunk(self.size, dim)[0].contiguous()


@contextlib.contextmanager
def alone(size: int):
    """Run the body with `Alone(size)` as the calling thread's group (nothing without tp)."""
    if size <= 1:
        yield
        return
    previous = getattr(_thread, "group", None)
    _thread.group = Alone(size)
    try:
        yield
    finally:
        _thread.group = previous
