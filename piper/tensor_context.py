"""Which tensor-parallel group the calling thread's TP ops reduce over.

    with lane_group(groups, lane):   # the runtime, around one lane's compute
        current()                    # `piper.tensor_ops`' collectives: that lane's group (None on one device)

Pure Python, below both the ops (`piper.tensor_ops`) and the runtime that makes the
groups (`piper.runtime` sets the default and the lanes): the ops ask, the runtime
answers (`piper.lane_context`), one group per lane, as for the expert groups.
"""
from __future__ import annotations

import contextlib

from .lane_context import LaneContext

_context = LaneContext()
forget, set_default, current = _context.forget, _context.set_default, _context.current
add_seconds, take_seconds, lane_group = _context.add_seconds, _context.take_seconds, _context.lane_group


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
        # A copy, never a view: a custom op's output may not alias its input (a batch of one's
        # chunk along dim 1 is contiguous already).
        return x.chunk(self.size, dim)[0].clone()


@contextlib.contextmanager
def alone(size: int):
    """Run the body with `Alone(size)` as the calling thread's group (nothing without tp)."""
    if size <= 1:
        yield
        return
    with _context.standing_in(Alone(size)):
        yield
