"""A per-thread choice of process group, for ops inside a graph that issue collectives: the ops
ask `current()`, the runtime answers with `set_default` and, around one lane's compute,
`lane_group` (the items of an overlapped slot run in threads of their own, one group each:
two threads issuing collectives on one Gloo group give silently wrong results). It also
counts the seconds the calling thread spent in those collectives.

Pure Python, below the front end's ops and the runtime. `piper.expert_context` (the MoE
ops' expert groups) and `piper.tensor_context` (the TP ops' tensor groups) are one each.
"""
from __future__ import annotations

import contextlib
import threading


class LaneContext:
    def __init__(self):
        self._thread = threading.local()
        self._default = None      # lane 0's group (and threads that entered no lane: CUDA's autograd threads)

    def forget(self) -> None:
        """Drop the last job's groups (a kept worker's `reset`): a job without them must not find them."""
        self._default = None
        self._thread = threading.local()

    def set_default(self, group) -> None:
        """The group of threads that entered no lane (lane 0's; None where nothing is divided)."""
        self._default = group

    def current(self):
        """The calling thread's group; None on one device (the ops' local meaning)."""
        return getattr(self._thread, "group", None) or self._default

    def add_seconds(self, seconds: float) -> None:
        """Count time the calling thread spent in one of these collectives."""
        self._thread.seconds = getattr(self._thread, "seconds", 0.0) + seconds

    def take_seconds(self) -> float:
        """Seconds the calling thread spent in these collectives since it last asked (and reset them)."""
        seconds, self._thread.seconds = getattr(self._thread, "seconds", 0.0), 0.0
        return seconds

    @contextlib.contextmanager
    def lane_group(self, groups, lane: int):
        """Run the body with lane `lane`'s group (overlapped slots: one group per lane)."""
        if not groups:
            yield
            return
        previous = getattr(self._thread, "group", None)
        self._thread.group = groups[lane]
        try:
            yield
        finally:
            self._thread.group = previous

    @contextlib.contextmanager
    def standing_in(self, group):
        """Run the body with `group` as the calling thread's (a stand-in, outside any job)."""
        previous = getattr(self._thread, "group", None)
        self._thread.group = group
        try:
            yield
        finally:
            self._thread.group = previous
