"""The errors `Watch` raises: a worker that died, stalled or failed, named with its
place in the mesh and the action it was last seen running.

Mixed into `Watch` (`watch`).
"""
from __future__ import annotations

from ...diagnostics import PiperError, error


class FailureMessages:
    def _running(self, rank: int) -> str:
        steps, action = self.last.get(rank, (None, None))
        if action is None:
            return ""
        return f" while running {action} (step {steps})"

    def _positions(self, alive: dict) -> str:
        return "; ".join(f"rank {r} at {a or 'no action'}" for r, (_, a) in sorted(alive.items())) or "none"

    def _died(self, what: str, dead: dict, alive: dict) -> PiperError:
        lines = [f"{self.describe(r)} died during `{what}`{self._running(r)}: {reason}"
                 for r, reason in sorted(dead.items())]
        notes = ["the other workers were at: " + self._positions(alive)] if alive else []
        notes += lines[1:]
        return error("worker-died", lines[0], notes=tuple(notes),
                     hint="the job was closed; `piper run --max-restarts N` restarts a run from its last "
                          "checkpoint, or check the worker's memory use and logs, then compile a new job")

    def _stalled(self, what: str, silent: set, alive: dict, limit: float | None) -> PiperError:
        names = [f"{self.describe(r)} does not answer" + (f"; it was last seen{self._running(r)}"
                                                        if self._running(r) else "") for r in sorted(silent)]
        within = f"within {limit:.0f} s" if limit is not None else "in time"
        why = ("its process is stopped (SIGSTOP or a debugger)" if min(silent) in self.stopped
               else "stopped, swapping, or stuck outside Python")
        message = f"workers did not finish `{what}` {within}: {names[0]} ({why})"
        notes = [f"also not answering: {n}" for n in names[1:]]
        if alive:
            notes.append("the other workers answer, at: " + self._positions(alive))
        return error("worker-timeout", message, notes=tuple(notes),
                     hint="the job was closed; look at that process (e.g. `py-spy dump --pid PID`, or whether it "
                          "was stopped), or raise timeout= in piper.compile if it is only slow")

    def _failed(self, what: str, rank: int, exc: BaseException) -> PiperError:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, PiperError):
            return cause
        inner = cause or exc
        text = str(inner).strip().splitlines()
        trace = [line for line in str(exc).splitlines() if line.strip()][-8:]
        return error("worker-failed", f"{self.describe(rank)} failed during `{what}`"
                     f"{self._running(rank)}: {type(inner).__name__}: {text[-1] if text else ''}",
                     notes=("worker traceback (last lines):\n" + "\n".join(trace),),
                     hint="the job was closed; the message above comes from the worker")
