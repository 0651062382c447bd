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

from ..diagnostics import PiperError, error

RECOVERABLE = ("worker-died", "worker-timeout")


class StepData:
    """The batch for each step, deterministic per step: `data(k)` is the k-th item of a fresh
    `make_stream()` (re-created and skipped forward when a restart goes back)."""

    def __init__(self, make_stream):
        self.make_stream = make_stream
        self._stream = None
        self._next = 0
        self._last = None             # the batch of step `_next - 1`, asked again by a job's start

    def __call__(self, step: int):
        if self._last is not None and step == self._next - 1:
            return self._last
        if self._stream is None or step != self._next:
            self._stream = iter(self.make_stream())
            for _ in itertools.islice(self._stream, step):
                pass
        self._next = step + 1
        self._last = tuple(next(self._stream))
        return self._last


def checkpoint_problem(path) -> str | None:
    """Why checkpoint directory `path` cannot be loaded as it stands, or None when it is whole.

    Whole is what `piper.job.checkpoint.verify_checkpoint` says: its `.metadata` reads as DCP's
    metadata and nothing else, and every file is there with the size and CRC-32 its manifest
    records (a shard lost, cut short or damaged is caught here, before any worker reads it).
    This is the one place `--resume` and restarts ask."""
    from .checkpoint import verify_checkpoint

    try:
        verify_checkpoint(path)
    except PiperError as err:
        return err.diagnostics[0].message
    return None


class Checkpoints:
    """`DIR/step-N`, written with `job.save` every `every` steps and after the last one, the last
    `keep` kept; `restore` loads the newest whole one into a new job.

    `on_save(path, seconds)` is told of each checkpoint written, `on_load(step, path)` of each one
    loaded, `on_skip(path, why)` of each newer one `restore` passed over because it is broken
    (`checkpoint_problem`), `on_save_failed(path, error, last_whole)` of each periodic save that could
    not be written (a full disk): training goes on and the next save tries again.

    A failed save is not a failed run: `job.save` leaves the folder's checkpoints as they were and
    the job running, so only the final save's failure ends the run, its error saying which steps no
    checkpoint holds."""

    def __init__(self, directory: str, every: int, keep: int = 2, *, on_save=None, on_load=None, on_skip=None,
                 on_save_failed=None):
        self.directory, self.every, self.keep = directory, every, keep
        self.on_save, self.on_load, self.on_skip = on_save, on_load, on_skip
        self.on_save_failed = on_save_failed
        self.failed: list[tuple[str, PiperError]] = []   # (path, error) of every save that could not be written
        self.written = False          # saved by this run (only then does a restart load one unasked)
        self.skipped: list[tuple[str, str]] = []      # (path, why) of every broken one passed over
        self.loaded: tuple[int, str] | None = None    # (step, path) of the last one `restore` loaded

    def after_step(self, job, steps_done: int, last: bool = False) -> str | None:
        """Every `every` steps, and after the `last` one: `job.save` to `DIR/step-N` (atomic: the
        names `piper.job.checkpoint.checkpoints` lists are whole), then all but the last `keep`
        deleted. Returns the checkpoint's path, or None when this step saves none."""
        from .checkpoint import checkpoints

        if not self.every or (steps_done % self.every and not last):
            return None
        began = time.perf_counter()
        final = os.path.join(self.directory, f"step-{steps_done}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            job.save(final)
        except OSError as exc:        # the folder itself cannot be made: as job.save reports its own
            return self._failed(final, error("checkpoint-save-failed", f"the checkpoint could not be written: "
                                             f"{type(exc).__name__}: {exc}"), steps_done, last)
        except PiperError as err:
            if err.code != "checkpoint-save-failed":
                raise
            return self._failed(final, err, steps_done, last)
        self.written = True
        for _, old in checkpoints(self.directory)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        if self.on_save is not None:
            self.on_save(final, time.perf_counter() - began)
        return final

    def _failed(self, path: str, err: PiperError, steps_done: int, last: bool) -> None:
        """A save that could not be written: said, and training goes on; after the last step, the
        error, with what no checkpoint holds."""
        from .checkpoint import checkpoints

        self.failed.append((path, err))
        whole = checkpoints(self.directory) if os.path.isdir(self.directory) else []
        kept = whole[-1] if whole else None
        lost = (f"steps {kept[0] + 1}-{steps_done} are in no checkpoint; the last one is {kept[1]}" if kept else
                f"steps 1-{steps_done} are in no checkpoint (none was written)")
        if last:
            d = err.diagnostics[0]
            raise error("checkpoint-save-failed", f"{d.message} (the final checkpoint, {path})",
                        notes=(f"{lost}: the run ends here, having trained them",),
                        hint=d.hint) from None
        if self.on_save_failed is not None:
            self.on_save_failed(path, err, lost)
        return None

    def restore(self, job) -> int:
        """Load the newest whole checkpoint into `job`; the step to go on from (0 without one).

        A newer one that is broken (a shard missing or cut short, unreadable metadata) is passed
        over for the one before it, and said so (`skipped`, `on_skip`)."""
        from .checkpoint import checkpoints

        for step, path in reversed(checkpoints(self.directory)):
            why = checkpoint_problem(path)
            if why is None:
                try:
                    job.load(path)
                except PiperError as err:
                    if err.code != "not-a-checkpoint" or getattr(job, "_closed", False):
                        raise
                    why = err.diagnostics[0].message
                else:
                    self.loaded = (step, path)
                    if self.on_load is not None:
                        self.on_load(step, path)
                    return step
            self.skipped.append((path, why))
            if self.on_skip is not None:
                self.on_skip(path, why)
        return 0


@dataclass
class Restart:
    """One recovery: why, when, and how long until training went on."""
    error: PiperError
    failed_at: int              # the step that failed (or that was being saved)
    resumed_from: int           # the step training went on from (a checkpoint's, or 0)
    seconds: float              # from the failure to the new job being ready
    nodes: list[str] = field(default_factory=list)   # the new job's nodes
    detected_at: float = 0.0    # time.time() when the failed call raised
    during: str = "step"        # what was running: "step", "save" (a checkpoint) or "finish"


def train(start_job, data, steps: int, *, max_restarts: int = 0, checkpoints: Checkpoints | None = None,
          resume: bool = False, on_step=None, on_restart=None, finish=None, worker_read: bool = False,
          eval_every: int | None = None, on_eval=None) -> tuple[list[float], list[Restart]]:
    """Run the job `start_job()` gives up to `steps` steps, restarting up to `max_restarts` times.

    `resume` starts from the newest whole checkpoint in `checkpoints`; without it, a restart
    loads only checkpoints this run wrote. `data(step)` gives the step's batch;
    `on_step(step, loss, seconds)` (the job's own step number, from 0; after the step's checkpoint,
    if one is due, is saved) and `on_restart(Restart)`
    report progress; `finish(job)` runs after the last step, before the job closes. A worker
    lost while a checkpoint is written or while `finish` runs restarts the job too: training
    goes on from the last checkpoint, then the save or `finish` runs again.

    With `worker_read` (a job whose workers read their own data) the steps run as `job.train`'s
    stretches, without a call per step, each ending where a checkpoint or an evaluation is due:
    `on_step(step, loss, seconds, metrics)` is told of each step as the workers report it, then
    the checkpoint is saved and `on_eval(steps done)` runs every `eval_every` steps, in that order.

    Returns (the loss of every step this run trained, from the step it started at (0, or the
    resumed checkpoint's: `checkpoints.loaded`), the restarts). Errors other than a lost or
    stalled worker, and the failure after the last allowed restart, are raised as they are.
    """
    restarts: list[Restart] = []
    losses: dict[int, float] = {}
    reached = 0                       # under `worker_read`: the last step the workers reported
    job = start_job()
    try:
        step = first = checkpoints.restore(job) if checkpoints is not None and resume else 0
        while True:
            during = "step"
            try:
                while worker_read and step < steps:
                    during = "step"
                    until = min([steps] + [(step // every + 1) * every for every in
                                           (checkpoints.every if checkpoints is not None else None, eval_every)
                                           if every])

                    def each(number, metrics):
                        nonlocal reached
                        if "loss" in metrics:
                            losses[number - 1], reached = metrics["loss"], number
                            if on_step is not None:
                                on_step(number - 1, metrics["loss"], metrics["seconds"], metrics)

                    job.train(until - step, on_metrics=each)
                    step = until
                    if checkpoints is not None:
                        during = "save"
                        checkpoints.after_step(job, step, last=step == steps)
                    if on_eval is not None and eval_every and step % eval_every == 0:
                        during = "step"
                        on_eval(step)
                while step < steps:
                    during = "step"
                    start = time.perf_counter()
                    loss = job.step(*data(step))
                    losses[step] = loss
                    seconds = time.perf_counter() - start
                    step += 1
                    if checkpoints is not None:
                        during = "save"
                        checkpoints.after_step(job, step, last=step == steps)
                    if on_step is not None:       # after the save: a failing evaluation keeps the checkpoint
                        during = "step"
                        on_step(step - 1, loss, seconds)
                during = "finish"
                if finish is not None:
                    finish(job)
                break
            except PiperError as err:
                if err.code not in RECOVERABLE or len(restarts) >= max_restarts:
                    raise
                step = max(step, reached)        # the last step a stretch reported before the failure
                failed, detected_at = time.perf_counter(), time.time()
                job.close()
                job = start_job()
                reload = checkpoints is not None and (resume or checkpoints.written)
                resumed = checkpoints.restore(job) if reload else 0
                nodes = sorted({w["node"] for w in job.placement().values()})
                restarts.append(Restart(err, step, resumed, time.perf_counter() - failed, nodes, detected_at,
                                        during))
                if on_restart is not None:
                    on_restart(restarts[-1])
                step = reached = resumed
    finally:
        job.close()
    return [losses[i] for i in range(first, steps)], restarts
