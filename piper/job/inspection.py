"""Looking into a running job: memory, timings, the gradient norm, a trace, the plans.

Mixed into `piper.job.Job`.
"""
from __future__ import annotations


class JobInspection:
    """`memory`, `timings`, `grad_norm`, `trace`, `show`; needs `_get` and `_check_open`."""

    def memory(self) -> dict[int, dict[str, int]]:
        """Per rank: bytes of parameters, gradients and optimizer state held between
        steps, `activations_peak`, the most bytes saved for backward at once in the last step, and
        `step_peak`, the most bytes of parameters, gradients, optimizer state and saved activations
        alive at once in the last step (sampled after every action: gathered parameters, gradient
        buffers and reduce-scatters in flight count; temporaries inside an action do not)."""
        self._check_open()
        return dict(enumerate(self._get([a.memory.remote() for a in self.actors], "memory")))

    def timings(self, cpu: bool = False) -> dict[int, dict[str, float]]:
        """Per rank: seconds each compute action took in the last step (`0F3`: 0.012, ...).

        An overlapped slot run in lanes also has an entry for the whole slot
        (`0F7&3BI3&3BW3`). `cpu=True` gives the worker thread's CPU seconds
        instead of wall-clock ones (CPU devices): the cost of each action on a
        core of its own, which `simulate(..., cores=N)` shares out when devices
        outnumber cores; its `step` entry is the whole worker process's CPU
        seconds in the step, every thread included."""
        self._check_open()
        return dict(enumerate(self._get([a.timings.remote(cpu) for a in self.actors], "timings")))

    def overheads(self, cpu: bool = False) -> dict[int, dict]:
        """Per rank: the worker thread's seconds in the last step outside its computes and its blocking
        waits for communication, `start` (before the first action), `end` (after the last) and per op of
        the plan (seconds, actions) (`piper/runtime/execution/overheads.py`); `cpu=True`: the thread's CPU seconds
        outside its computes. `piper.compiler.runtime_costs.RuntimeModel` makes a cost model of them."""
        self._check_open()
        from ..runtime.execution.overheads import read_overheads

        return dict(enumerate(self._get([a.__ray_call__.remote(read_overheads, cpu) for a in self.actors],
                                        "overheads")))

    def collective_costs(self) -> dict[tuple[str, int], tuple[float, float]]:
        """Per (op, group size) of the job's groups: a small collective's wall and CPU seconds per
        call (every thread of the process), the median over the ranks; run between steps
        (`piper.runtime.communication.collective_timing`, which `piper tune`'s calibration prices calls by)."""
        self._check_open()
        import statistics

        from ..runtime.communication.collective_timing import time_collectives

        per_rank = self._get([a.__ray_call__.remote(time_collectives) for a in self.actors], "collective_costs")
        keys = sorted({k for r in per_rank for k in r})
        return {k: (statistics.median(r[k][0] for r in per_rank if k in r),
                    statistics.median(r[k][1] for r in per_rank if k in r)) for k in keys}

    def traced(self) -> list[dict]:
        """Per rank, the last steps' action spans, communication completions and the worker's clocks
        (what `trace` draws), as data: `piper.compiler.runtime_costs.start_skews` and `receive_latencies` read it."""
        self._check_open()
        return self._get([a.trace.remote() for a in self.actors], "trace")

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (with `clip_grad_norm=`)."""
        self._check_open()
        return self._get([self.actors[0].__ray_call__.remote(_last_grad_norm)], "grad_norm")[0]

    def trace(self, path: str, steps: int | None = None) -> str:
        """Write the last steps (up to `piper.runtime.execution.executor.TRACE_STEPS`; `steps` to keep fewer) as a
        Chrome/Perfetto trace: one process per device, a track per lane and one for communication,
        flow arrows from each send to its receive (`piper/compiler/trace.py`). Returns `path`."""
        self._check_open()
        from ..compiler.trace import job_trace

        return job_trace(self, path, steps)

    def show(self) -> str:
        return self.compiled.show()


def _last_grad_norm(worker):
    clip = worker.executor.clip
    return clip.norm if clip is not None else None
