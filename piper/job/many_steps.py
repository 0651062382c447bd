"""`job.train(steps)`: the workers run the steps on their own, reading their own data, and the driver
makes a few calls per `train`, not one per step (`runtime/workers/train_loop.py` is the workers' side).

    metrics = job.train(1000, eval_every=100, eval_batches=10, save_every=500, save_dir="ckpt",
                        on_metrics=lambda step, m: print(step, m["loss"]))

Saves and evaluations split the steps into stretches: at a step where a save or an evaluation is due,
the stretch ends, the driver saves (first: a failing evaluation must not cost the checkpoint) and
evaluates, and the next stretch starts. The driver's calls grow with the saves and evaluations asked
for, never with the steps. While a stretch runs, the driver reads each worker's finished steps from
the health concurrency group (`train_progress`), averages their losses in rank order as `job.step()`
does, and hands each step's metrics to `on_metrics` as they arrive; a worker that dies or stops
answering is named by the same watch as a step's, its deadline counted from the last step that
finished, not from the stretch's start.

Mixed into `piper.job.Job`.
"""
from __future__ import annotations

import math

from ..diagnostics import error
from ..frontend.lr_schedules import scale_at
from .steps import SKIPPED_IN_A_ROW, check_finite


class JobTrain:
    """`train`: many steps in one call to each worker."""

    def train(self, steps: int, *, eval_every: int | None = None, eval_batches: int | None = None,
              save_every: int | None = None, save_dir=None, on_metrics=None) -> list[dict]:
        """Run `steps` steps of the job's `data=` on the workers and return each step's metrics
        (`step`, the job's step number after it; `loss`; `tokens`; `seconds`, the slowest device's;
        `skipped`, the non-finite steps skipped so far; `lr_scale`, the schedule's multiplier;
        `grad_norm`, the global gradient norm before clipping with `clip_grad_norm=`, else None), with
        `eval_loss` on the steps where an evaluation ran. Every `eval_every` steps (of the job's
        count) the loss of the first `eval_batches` batches of `val_data=` is measured, and every
        `save_every` steps the job is saved as `save_dir/step-N` (the last two kept, as `piper run`
        keeps them). Losses and parameters equal `steps` calls of `job.step()`."""
        self._check_open()
        _check_arguments(self, steps, eval_every, eval_batches, save_every, save_dir)
        out: list[dict] = []
        end = self.steps + steps
        while self.steps < end:
            stop = min([end] + [_next(self.steps, every) for every in (eval_every, save_every) if every])
            ran = self._stretch(stop - self.steps, out, on_metrics)
            if ran and self.steps % (save_every or math.inf) == 0:
                from .checkpoint import save_step
                save_step(self, save_dir)
            if ran and self.steps % (eval_every or math.inf) == 0:
                out[-1]["eval_loss"] = self.evaluate(batches=eval_batches or 1)
                if on_metrics is not None:
                    on_metrics(self.steps, {"eval_loss": out[-1]["eval_loss"]})
        return out

    def _stretch(self, count: int, out: list[dict], on_metrics) -> bool:
        """`count` steps in one call to each worker; their metrics appended to `out` (and handed to
        `on_metrics`) as every worker reports them. Raises `non-finite` where `job.step()` would."""
        first, base = self.data_position, self.steps
        scales = [scale_at(self.lr_schedule, base + i) if self.lr_schedule is not None else None
                  for i in range(count)]
        skip = self.training.nonfinite == "skip"
        in_a_row = getattr(self, "nonfinite_in_a_row", 0)
        refs = [actor.train_data.remote(first, scales, skip, in_a_row, SKIPPED_IN_A_ROW) for actor in self.actors]
        self.sent_bytes = 0
        reports = _Reports(self.actors)
        done = first_out = len(out)
        skipped = getattr(self, "skipped_steps", 0)     # `check_finite` counts them again below

        def deliver() -> bool:
            """Hand on the steps every worker has reported; True when one was."""
            nonlocal done, skipped
            steps = reports.complete()
            for i in range(len(out) - first_out, len(steps)):
                out.append(self._metrics(base + i, steps[i]))
                skipped += skip and not math.isfinite(out[-1]["loss"])
                out[-1]["skipped"] = skipped
                if on_metrics is not None:
                    on_metrics(out[-1]["step"], out[-1])
            moved = len(out) - done > 0
            done = len(out)
            return moved

        def poll() -> bool:
            reports.ask()
            return deliver()

        results = self._get(refs, "train", on_poll=poll)
        reports.final(results)
        deliver()
        ran = len(results[0])
        for i in range(ran):                      # the driver's own account, step by step, as job.step's
            self.steps += 1
            self.data_position += 1
            entry = out[len(out) - ran + i]
            check_finite(self, entry["loss"], {r: rec[i]["nonfinite"] for r, rec in enumerate(results)
                                               if rec[i]["nonfinite"]})
        return ran > 0

    def _metrics(self, index: int, records: list[dict]) -> dict:
        losses = [loss for rec in records for loss in rec["losses"]]
        return {"step": index + 1, "loss": float(sum(losses) / len(losses)), "tokens": self._tokens(),
                "seconds": max(rec["seconds"] for rec in records), "lr_scale": records[0]["lr_scale"],
                "grad_norm": records[0]["grad_norm"]}

    def _tokens(self) -> int:
        """Tokens (elements of the first input) in one global batch of the job's data."""
        if getattr(self, "_tokens_per_batch", None) is None:
            sample = self.data.dataset[0][0]
            self._tokens_per_batch = int(getattr(sample, "numel", lambda: 1)()) * self.batch_size
        return self._tokens_per_batch


class _Reports:
    """Each worker's finished steps of the running stretch, asked for without blocking the wait."""

    def __init__(self, actors):
        self.actors = actors
        self.steps: list[list[dict]] = [[] for _ in actors]
        self.asked: dict = {}          # ref -> rank

    def ask(self) -> None:
        import ray

        if self.asked:
            ready, _ = ray.wait(list(self.asked), num_returns=len(self.asked), timeout=0)
            for ref in ready:
                rank = self.asked.pop(ref)
                try:
                    self.steps[rank] += ray.get(ref)
                except Exception:    # noqa: BLE001 - a dead worker is the watch's to name
                    pass
        pending = set(self.asked.values())
        for rank, actor in enumerate(self.actors):
            if rank not in pending:
                self.asked[actor.train_progress.remote(len(self.steps[rank]))] = rank

    def final(self, results: list[list[dict]]) -> None:
        self.steps = [list(r) for r in results]
        self.asked.clear()

    def complete(self) -> list[list[dict]]:
        """Per step every worker has reported: each worker's record of it, in rank order."""
        count = min(len(s) for s in self.steps)
        return [[s[i] for s in self.steps] for i in range(count)]


def _next(step: int, every: int) -> int:
    """The first multiple of `every` after `step`."""
    return (step // every + 1) * every


def _check_arguments(job, steps, eval_every, eval_batches, save_every, save_dir) -> None:
    if job.data is None:
        raise error("bad-inputs", "train() runs on the job's own data, and this job was compiled without data=",
                    hint="compile with data=DATASET, batch_size=B (piper.data.TokenFile), or call job.step(*batch)")
    for name, value in (("steps", steps), ("eval_every", eval_every), ("eval_batches", eval_batches),
                        ("save_every", save_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (name == "steps" and 0 or 1)):
            raise error("bad-inputs", f"train({name}={value!r}): expected a whole number of at least "
                        f"{0 if name == 'steps' else 1}", hint=f"pass {name} as an int, e.g. {name}=100")
    if eval_every and job.val_data is None:
        raise error("bad-inputs", "train(eval_every=...) needs a job compiled with val_data=",
                    hint="compile with val_data=DATASET, or leave eval_every out")
    if save_every and save_dir is None:
        raise error("bad-inputs", "train(save_every=...) needs save_dir=, where the checkpoints go",
                    hint="pass save_dir='checkpoints' (each save is save_dir/step-N)")
