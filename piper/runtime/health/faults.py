"""Fault injection for tests: make a chosen rank die, stall or fail at a chosen action.

Set `PIPER_FAULT` for the workers (`piper.compile(..., worker_env={"PIPER_FAULT":
"rank=1 action=1F0 do=kill"})`, or in the driver's environment). The driver hands it to
each worker with its set-up rather than into the process environment, so workers kept
for the next job (`runtime/launch/pool.py`) serve jobs with and without a fault alike.
Fields, space or comma separated:

    rank=R      the rank that misbehaves (required)
    do=KIND     kill (SIGKILL itself), stop (SIGSTOP itself), raise (a RuntimeError),
                exit (os._exit(1)), pause (only the delay: time to remove its node mid-step)
    action=KEY  the plan action to misbehave at, e.g. 1F0 (default: the first of the step),
                or `save` (only when named): in a checkpoint save, once this rank's data files
                are written
    step=N      the worker's N-th step, counting from 0 (default: 0)
    delay=S     run the action's prelude S seconds first (the driver sees the rank at KEY)
    once=PATH   write "node_id pid" to PATH and act only if PATH did not exist yet, so
                workers restarted with the same environment do not fail again

A worker without `PIPER_FAULT` pays nothing: the executor's hook is None.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV = "PIPER_FAULT"
KINDS = ("kill", "stop", "raise", "exit", "pause")


@dataclass(frozen=True)
class Fault:
    rank: int
    kind: str
    action: str | None = None
    step: int = 0
    delay: float = 0.0
    once: str | None = None

    @staticmethod
    def parse(text: str) -> "Fault":
        """`Fault.parse("rank=1 action=1F0 do=kill")`."""
        fields = dict(part.split("=", 1) for part in text.replace(",", " ").split() if "=" in part)
        unknown = set(fields) - {"rank", "do", "action", "step", "delay", "once"}
        if unknown or "rank" not in fields or fields.get("do") not in KINDS:
            raise ValueError(f"{ENV}={text!r}: want rank=R do={'|'.join(KINDS)} [action=KEY] [step=N] "
                             f"[delay=S] [once=PATH]")
        return Fault(int(fields["rank"]), fields["do"], fields.get("action"), int(fields.get("step", 0)),
                     float(fields.get("delay", 0)), fields.get("once"))


class Trigger:
    """Called by the executor before each action; fires once, at the chosen step and action."""

    def __init__(self, fault: Fault, steps_done):
        self.fault = fault
        self.steps_done = steps_done        # callable: how many steps this worker finished
        self.fired = False

    def __call__(self, key: str) -> None:
        f = self.fault
        if self.fired or self.steps_done() != f.step or (f.action is not None and key != f.action):
            return
        self.fired = True
        if f.once is not None:
            try:
                fd = os.open(f.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            import ray

            os.write(fd, f"{ray.get_runtime_context().get_node_id()} {os.getpid()}\n".encode())
            os.close(fd)
        if f.delay:
            time.sleep(f.delay)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "exit":
            os._exit(1)
        elif f.kind == "raise":
            raise RuntimeError(f"injected fault at {key} ({ENV})")


def trigger(text: str | None, rank: int, steps_done) -> Trigger | None:
    """The trigger for this rank from a `PIPER_FAULT` value, or None when there is none or it names
    another rank."""
    if not text:
        return None
    fault = Fault.parse(text)
    return Trigger(fault, steps_done) if fault.rank == rank else None
