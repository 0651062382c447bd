"""Training that outlives its workers: detect, tear down, restart, reload, replay.

    losses = train(start_job, StepData(lambda: module.training_batches(16)), steps=100,
                   max_restarts=2, checkpoints=Checkpoints("ckpt", every=10))

When a step fails because a worker or node was lost (`worker-died`) or stalled
(`worker-timeout`), the job is closed, a new one is started (on whatever nodes
the Ray cluster has then), the last checkpoint is loaded (or, without one, the
run starts over from the initial weights), and training replays from that step.
`StepData` gives the batch of step k however often it is asked, so a recovered
run sees the same data as an uninterrupted one and ends with the same weights.
"""
from __future__ import annotations

import itertools
import os
import shutil
import time
from dataclasses import dataclass, field

from ..diagnostics import PiperError

RECOVERABLE = ("worker-died", "worker-timeout")


class StepData:
    """The batch for each step, deterministic per step: `data(k)` is the k-th item of a fresh
    `make_stream()` (re-created and skipped forward when a restart goes back)."""

    def __init__(self, make_stream):
        self.make_stream = make_stream
        self._stream = None
        self._next = 0

    def __call__(self, step: int):
        if self._stream is None or step != self._next:
            self._stream = iter(self.make_stream())
            for _ in itertools.islice(self._stream, step):
                pass
        self._next = step + 1
        return tuple(next(self._stream))


class Checkpoints:
    """`DIR/step-N`, written with `job.save` every `every` steps, the last `keep` kept
    (`piper.job.checkpoint.save_step`); `restore` loads the newest into a new job."""

    def __init__(self, directory: str, every: int, keep: int = 2):
        self.directory, self.every, self.keep = directory, every, keep
        self.written = False          # saved by this run (only then does a restart load one unasked)

    def after_step(self, job, steps_done: int) -> None:
        """Every `every` steps: `job.save` to `DIR/step-N.partial`, renamed `DIR/step-N` once whole
        (the names `piper.job.checkpoint.checkpoints` lists), then all but the last `keep` deleted."""
        from .checkpoint import checkpoints

        if not self.every or steps_done % self.every:
            return
        final = os.path.join(self.directory, f"step-{steps_done}")
        partial = final + ".partial"
        os.makedirs(self.directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        job.save(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        self.written = True
        for _, old in checkpoints(self.directory)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def restore(self, job) -> int:
        """Load the newest checkpoint into `job`; the step to go on from (0 without one)."""
        from .checkpoint import checkpoints

        saved = checkpoints(self.directory)
        if not saved:
            return 0
        step, path = saved[-1]
        job.load(path)
        return step


@dataclass
class Restart:
    """One recovery: why, when, and how long until training went on."""
    error: PiperError
    failed_at: int              # the step that failed
    resumed_from: int           # the step training went on from (a checkpoint's, or 0)
    seconds: float              # from the failure to the new job being ready
    nodes: list[str] = field(default_factory=list)   # the new job's nodes
    detected_at: float = 0.0    # time.time() when the failed step raised


def train(start_job, data, steps: int, *, max_restarts: int = 0, checkpoints: Checkpoints | None = None,
          resume: bool = False, on_step=None, on_restart=None, finish=None) -> tuple[list[float], list[Restart]]:
    """Run `steps` steps on `start_job()`'s job, restarting up to `max_restarts` times.

    `resume` starts from the newest checkpoint in `checkpoints`; without it, a
    restart loads only checkpoints this run wrote. `data(step)` gives the step's batch; `on_step(step, loss, seconds)` and
    `on_restart(Restart)` report progress; `finish(job)` runs after the last step, before the job closes. Returns (the loss of every step, the restarts).
    Errors other than a lost or stalled worker, and the failure after the last
    allowed restart, are raised as they are.
    """
    restarts: list[Restart] = []
    losses: dict[int, float] = {}
    job = start_job()
    try:
        step = checkpoints.restore(job) if checkpoints is not None and resume else 0
        while step < steps:
            try:
                start = time.perf_counter()
                loss = job.step(*data(step))
            except PiperError as err:
                if err.code not in RECOVERABLE or len(restarts) >= max_restarts:
                    raise
                failed, detected_at = time.perf_counter(), time.time()
                job.close()
                job = start_job()
                reload = checkpoints is not None and (resume or checkpoints.written)
                resumed = checkpoints.restore(job) if reload else 0
                nodes = sorted({w["node"] for w in job.placement().values()})
                restarts.append(Restart(err, step, resumed, time.perf_counter() - failed, nodes, detected_at))
                if on_restart is not None:
                    on_restart(restarts[-1])
                step = resumed
                continue
            losses[step] = loss
            if on_step is not None:
                on_step(step, loss, time.perf_counter() - start)
            step += 1
            if checkpoints is not None:
                checkpoints.after_step(job, step)
        if finish is not None:
            finish(job)
    finally:
        job.close()
    return [losses[i] for i in range(steps)], restarts
