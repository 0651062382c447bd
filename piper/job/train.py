"""A training loop with live progress (loss, tokens/s), shared by `piper run`
and the examples; `StepReport` is its progress and `--metrics` lines, by the job's real step."""
from __future__ import annotations

import json
import math
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StepReport:
    """What a run shows and records per step: a progress bar, a line for its first step, every 10th
    and the last, and with `metrics` one JSON line per step (`step`: the job's own step number, from 1
    as everywhere a user reads one, also after a resume or a restart; `loss`, `step_s`, `tokens_per_s`,
    `tokens` processed by the job up to that step (`samples_per_s`, `samples` for other models),
    `time`: seconds since this run's first step began, `restarts`: the restarts so far). A step
    replayed after a restart gets a line again. With `append` (a resumed run) the lines go on after
    the earlier run's, so one file holds the whole training.

        with StepReport(100, tokens_per_batch=1024, console=console, metrics="m.jsonl") as report:
            report.step(step, loss, seconds)      # `step`: the steps done before it (job.steps), from 0
    """

    def __init__(self, steps: int, *, tokens_per_batch: int, console: Console | None = None,
                 unit: str = "tok", metrics: str | None = None, append: bool = False):
        self.steps, self.tokens_per_batch, self.unit = steps, tokens_per_batch, unit
        self.console = console or Console(log_path=False)
        self.metrics, self.append = metrics, append
        self.done = None                  # the steps done when the last one reported ended
        # MFU beside the throughput (`piper.job.mfu`): the model's training FLOPs per token (or sample)
        # and the peak FLOP/s of all devices together; 0 leaves it out.
        self.flops_per_item = self.peak_flops = 0.0
        self.restarts = 0
        self.what = "tokens" if unit == "tok" else unit          # the metrics' name for what a step processes
        self._progress = self._task = self._out = None
        self._began = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _open(self, step: int) -> None:
        columns = (TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                   TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("[magenta]{task.fields[step_s]} s/step"),
                   TextColumn("[green]{task.fields[speed]} " + self.unit + "/s"), TimeElapsedColumn())
        self._progress = Progress(*columns, console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.steps, completed=step, loss="-", speed="-",
                                             step_s="-")
        self._out = open(self.metrics, "a" if self.append else "w", encoding="utf-8") if self.metrics else None
        self._began = time.perf_counter()

    def step(self, step: int, loss: float, seconds: float) -> None:
        """The step after `step` done (the job's own count, `job.steps` before it: step `step + 1` as
        shown) ended with `loss` after `seconds`."""
        first = self._progress is None
        if first:
            self._open(step)
            self._began -= seconds            # `time` counts from when the first step began
        number = self.done = step + 1
        speed = self.tokens_per_batch / seconds if seconds > 0 else float("inf")
        self._progress.update(self._task, completed=number, loss=f"{loss:.4f}", speed=f"{speed:,.0f}",
                              step_s=f"{seconds:.3f}")
        mfu = self.flops_per_item * speed / self.peak_flops if self.peak_flops and math.isfinite(speed) else None
        if self._out is not None:
            row = {"step": number, "loss": loss, "step_s": seconds, f"{self.what}_per_s": speed,
                   self.what: self.tokens_per_batch * number, "time": time.perf_counter() - self._began,
                   "restarts": self.restarts}
            if mfu is not None:
                row["mfu"] = mfu
            self._out.write(json.dumps(row) + "\n")
            self._out.flush()
        if first or number % 10 == 0 or number == self.steps:
            # A plain line, not `console.log`: that adds this file's name and line (`train.py:66`), which
            # tell a user nothing, and lays the line out as a table cut at the console's width.
            self._progress.console.print(
                f"[{time.strftime('%H:%M:%S')}] step {number:3d}  loss {loss:.4f}  {seconds:.3f} s  "
                f"{speed:,.0f} {self.unit}/s" + (f"  MFU {100 * mfu:.3g}%" if mfu is not None else ""),
                markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._out is not None:
            self._out.close()
        self._progress = self._out = None


def fit(job, batches, steps: int, *, tokens_per_batch: int, console: Console | None = None,
        unit: str = "tok", metrics: str | None = None, after_step=None) -> list[float]:
    """Run `steps` optimizer steps on `job`; show step, loss, step time and throughput (`tokens_per_batch`
    of `unit` per step: "tok", or "samples" for a model that does not take tokens); return the losses.

    Steps are numbered from the job's own count (`job.steps`: a loaded checkpoint's step), the first
    trained being `job.steps + 1`, and `metrics` gets one JSON line per step as it ends (`StepReport`). `after_step(steps done, loss,
    step seconds, tokens/s, unit)` runs after each step (evaluation, TensorBoard:
    `piper.run_recipe.Observer`)."""
    losses = []
    first = int(getattr(job, "steps", 0) or 0)
    with StepReport(first + steps, tokens_per_batch=tokens_per_batch, console=console, unit=unit,
                    metrics=metrics) as report:
        for step in range(first, first + steps):
            batch = next(batches)
            start = time.perf_counter()
            loss = job.step(*batch)
            losses.append(loss)
            elapsed = time.perf_counter() - start
            report.step(step, loss, elapsed)
            if after_step is not None:
                after_step(step + 1, loss, elapsed, tokens_per_batch / elapsed, unit)
    return losses
