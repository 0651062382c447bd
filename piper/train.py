"""A training loop with live progress (loss, tokens/s), shared by `piper run`
and the examples."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def fit(job, batches, steps: int, *, tokens_per_batch: int, console: Console | None = None,
        unit: str = "tok") -> list[float]:
    """Run `steps` optimizer steps on `job`; show loss and throughput (`tokens_per_batch` of `unit`
    per step: "tok", or "samples" for a model that does not take tokens); return the losses."""
    console = console or Console()
    losses = []
    columns = (TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
               TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("[green]{task.fields[speed]} " + unit + "/s"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=steps, loss="-", speed="-")
        for step in range(steps):
            batch = next(batches)
            start = time.perf_counter()
            loss = job.step(*batch)
            elapsed = time.perf_counter() - start
            losses.append(loss)
            progress.update(task, advance=1, loss=f"{loss:.4f}", speed=f"{tokens_per_batch / elapsed:,.0f}")
            if step % 10 == 0 or step == steps - 1:
                progress.console.log(f"step {step:3d}  loss {loss:.4f}  {tokens_per_batch / elapsed:,.0f} {unit}/s")
    return losses
