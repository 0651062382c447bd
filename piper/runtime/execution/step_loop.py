"""Driving one step of a device's plan: action by action, timing each compute.

Mixed into `Executor`. Each action runs as the method named for its op
(`_f`, `_bi`, `_send`, ...: `forward_actions`, `backward_actions`,
`comm_actions`); an overlapped slot runs in lanes (`lanes`).
"""
from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ... import tensor_context
from ...ir.dag import node_key
from .overheads import StepMarks
from .step_state import StepState

TRACE_STEPS = 2      # steps whose action spans `job.trace` can show (piper/compiler/trace.py)


class StepLoop(StepState):
    """`run_step` and `_run`, the driver of one action; needs the action methods, `_run_span`, `_wait`,
    `_settle_reductions` and `_sample`."""

    def _init_step_loop(self) -> None:
        self.timings: dict[str, float] = {}       # compute seconds per action, last step
        self._tp_seconds: dict[str, float] = {}   # TP collectives' seconds of passes whose TP node is to come
        # On a GPU the host only queues kernels, so a compute's host time says nothing of
        # its cost: CUDA events around it time it on the device, read once the step is over.
        self._events: dict[str, tuple] | None = {} if self.device.type == "cuda" else None
        self.cpu_timings: dict[str, float] = {}   # the same in this thread's CPU seconds (CPU devices)
        # Start/end of every action and when each communication completed, last steps (`job.trace`).
        self.traced: deque = deque(maxlen=TRACE_STEPS)
        self._spans_now: list = []
        self._done_at: dict[str, float] = {}
        self.current: str | None = None           # the action running now (`Worker.status`, health checks)
        self.fault = None                         # a test's injected fault (`faults.Trigger`), else None
        self._marks = StepMarks()                 # the thread's clocks per plan entry (`overheads`)

    def run_step(self, batch: dict[int, list[torch.Tensor]]) -> list[float]:
        cpu = time.process_time()
        self._marks.begin()
        try:
            return self._run_step(batch)
        finally:
            self._marks.done()
            # The whole process, every thread (lanes, communication): with the actions'
            # own CPU seconds this gives what the step costs outside them.
            self.cpu_timings["step"] = time.process_time() - cpu      # piper.compiler.simulate.STEP

    def _run_step(self, batch: dict[int, list[torch.Tensor]]) -> list[float]:
        self._spans_now, self._done_at = [], {}
        self.traced.append((time.perf_counter(), self._spans_now, self._done_at, threading.get_ident()))
        self._begin_step(batch)
        plan, i = self.spec.plan, 0
        mark = self._marks.mark
        while i < len(plan):
            mark(i)
            span = self._spans.get(i)
            if self._reducing and i in self._reads:
                self._settle_reductions(self._reads[i])
            if span is None:
                self._run(plan[i])
                self._let_go_values(plan[i].key)
                if not plan[i].node.is_compute:       # computes sample before they release (`_release`)
                    self._sample()
                i += 1
            else:
                self._run_span(span)
                for action in plan[i:span.stop]:     # once every lane is done with them
                    self._let_go_values(action.key)
                i = span.stop
        self._marks.loop_done()
        return self._end_step()

    def _run(self, action) -> tuple[float, float]:
        self.current = action.key
        if self.fault is not None:
            self.fault(action.key)
        if action.waits:
            waiting = time.perf_counter()
            for key in action.waits:
                self._wait(key)
            self._marks.waited += time.perf_counter() - waiting
        compute = action.node.is_compute
        cpu = time.thread_time() if compute else 0.0     # a system call: only where it is kept
        start = time.perf_counter()
        if compute and self._events is not None:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        if compute and self.experts is not None:
            self.experts.exchanged()          # count only this compute's all-to-alls
        if compute and self.tensor_groups:
            tensor_context.take_seconds()     # and only its tensor-parallel collectives
        getattr(self, "_" + action.node.op.lower())(action)
        end = time.perf_counter()
        self._spans_now.append((action.key, start, end, threading.get_ident()))
        if compute:
            self.timings[action.key] = end - start
            if self.experts is not None:      # its all-to-alls go to their ALL_TO_ALL node
                self.experts.account(action.node, self.timings)
            if self.tensor_groups:            # its TP collectives to its pass's TP node
                _account_tensor(action.node, self.timings, self._tp_seconds)
            if self._events is not None:
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                self._events[action.key] = (begin, done)
            # CPU seconds are what the action costs on a core of its own: the wall time above
            # also holds whatever other processes sharing the core took meanwhile.
            self.cpu_timings[action.key] = time.thread_time() - cpu
        return start, end


    def _let_go_values(self, key: str) -> None:
        """Drop the values whose last reader was action `key` (`value_lifetimes`)."""
        for entry in self._last_reads.get(key, ()):
            self.values.pop(entry, None)


def _account_tensor(node, timings: dict, pending: dict) -> None:
    """Move the seconds the compute `node` spent in TP collectives out of its own time, to its
    pass's `TP` node (`0TP_F3`, whose action files them: a cut pass's pieces add up first), so
    a simulation priced from `job.timings()` counts them once."""
    seconds = tensor_context.take_seconds()
    if seconds and node.op in ("F", "B", "BI"):
        key = node_key("TP", node.region, node.mb, node.op)
        pending[key] = pending.get(key, 0.0) + seconds
        timings[node.key] = max(0.0, timings[node.key] - seconds)
