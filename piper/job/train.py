"""A training loop with live progress (loss, tokens/s), shared by `piper run`
and the examples."""
from __future__ import annotations

import json
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def fit(job, batches, steps: int, *, tokens_per_batch: int, console: Console | None = None,
        unit: str = "tok", metrics: str | None = None, after_step=None) -> list[float]:
    """Run `steps` optimizer steps on `job`; show step, loss, step time and throughput (`tokens_per_batch`
    of `unit` per step: "tok", or "samples" for a model that does not take tokens); return the losses.

    `metrics`: a file that gets one JSON line per step (`step`, `loss`, `step_s`, `tokens_per_s`,
    `tokens` so far (`samples_per_s`, `samples` for other models), `time`: seconds since the first
    step began), written as each step ends. `after_step(steps done, loss, step seconds, tokens/s,
    unit)` runs after each step (evaluation, TensorBoard: `piper.job.recipe.Observer`)."""
    console = console or Console()
    losses = []
    columns = (TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
               TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("[magenta]{task.fields[step_s]} s/step"),
               TextColumn("[green]{task.fields[speed]} " + unit + "/s"), TimeElapsedColumn())
    what = "tokens" if unit == "tok" else unit          # the metrics' name for what a step processes
    out = open(metrics, "w", encoding="utf-8") if metrics else None
    began = time.perf_counter()
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("train", total=steps, loss="-", speed="-", step_s="-")
            for step in range(steps):
                batch = next(batches)
                start = time.perf_counter()
                loss = job.step(*batch)
                end = time.perf_counter()
                elapsed = end - start
                losses.append(loss)
                progress.update(task, advance=1, loss=f"{loss:.4f}", speed=f"{tokens_per_batch / elapsed:,.0f}",
                                step_s=f"{elapsed:.3f}")
                if out is not None:
                    out.write(json.dumps({"step": step, "loss": loss, "step_s": elapsed,
                                          f"{what}_per_s": tokens_per_batch / elapsed,
                                          what: tokens_per_batch * (step + 1), "time": end - began}) + "\n")
                    out.flush()
                if after_step is not None:
                    after_step(getattr(job, "steps", step + 1), loss, elapsed, tokens_per_batch / elapsed, unit)
                if step % 10 == 0 or step == steps - 1:
                    progress.console.log(f"step {step:3d}  loss {loss:.4f}  {elapsed:.3f} s  "
                                         f"{tokens_per_batch / elapsed:,.0f} {unit}/s")
    finally:
        if out is not None:
            out.close()
    return losses
