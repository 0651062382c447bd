"""Running a job's steps (and evaluations): the global batch cut per device and microbatch, and every
call to the workers.

Mixed into `piper.job.Job`.
"""
from __future__ import annotations

import math
import pickle

from ..frontend.batch_check import check_step_inputs
from ..frontend.capture import BATCH
from ..diagnostics import PiperError, error
from ..frontend.lr_schedules import scale_at
from ..runtime.launch import wire


class JobSteps:
    """`step`, `evaluate`, and `_get`, the one way the driver waits for its workers (deadline, health)."""

    def _get(self, refs, what: str, limit: float | None = None, on_poll=None):
        """ray.get with a deadline; a dead, stalled or failing worker closes the job with an error
        naming it (`runtime.health.watch`). `on_poll`, called while waiting, returns True when the
        workers made progress, which moves the deadline (`job.train`'s steps)."""
        ranks = list(range(len(refs))) if len(refs) == len(self.actors) else [0] * len(refs)
        try:
            return self._watch.wait(refs, what, self.timeout if limit is None else limit, ranks, on_poll)
        except BaseException as exc:
            self._broken = True     # its workers may be mid-collective: never kept for another job
            if isinstance(exc, PiperError):
                self.close()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise error("job-closed", "this job is closed", hint="compile a new job")

    def step(self, *batch, **named) -> float:
        """One optimizer step on the global batch; returns its mean loss. With no batch, on
        a job compiled with `data=`, the next global batch, which the workers read themselves.

        A job compiled with a dict of example inputs takes the batch by the same keywords."""
        self._check_open()
        # The schedule's multiplier for this step, the same on every device (None: the base rates).
        scale = scale_at(self.lr_schedule, self.steps) if self.lr_schedule is not None else None
        if not batch and not named and self.data is not None:
            k = self.data_position
            refs = [actor.step_data.remote("train", k, scale) for actor in self.actors]
            self.sent_bytes = len(pickle.dumps(("train", k, scale))) * len(self.actors)
            self.data_position += 1
        else:
            payloads = self._payloads(batch, named)
            refs = [actor.step.remote(payload, scale) for actor, payload in zip(self.actors, payloads)]
            self.sent_bytes = sum(wire.nbytes(x) for p in payloads for mbs in p.values() for x in mbs)
        results = self._get(refs, "step")
        skipped = {rank: r["nonfinite"] for rank, r in enumerate(results) if isinstance(r, dict)}
        losses = [loss for r in results for loss in (r["losses"] if isinstance(r, dict) else r)]
        self.steps += 1
        loss = float(sum(losses) / len(losses))
        check_finite(self, loss, skipped)
        return loss


    def evaluate(self, *batch, batches: int = 1, **named) -> float:
        """The mean loss of the global batch without any update: the forward half of every
        device's plan, on the same devices (`runtime.execution.evaluation`). Parameters, optimizer state
        and the step count stay as they are. With no batch, on a job compiled with `val_data=`,
        the mean over its first `batches` global batches (the same ones every time), read by
        the workers.

            val_loss = job.evaluate(x, y)
            val_loss = job.evaluate(batches=20)
        """
        self._check_open()
        if not batch and not named:
            if self.val_data is None:
                raise error("bad-inputs", "evaluate() without a batch needs a job compiled with val_data=",
                            hint="pass the batch, job.evaluate(x, y), or compile with val_data=DATASET")
            losses = []
            for k in range(batches):
                refs = [actor.evaluate_data.remote("val", k) for actor in self.actors]
                losses += [loss for result in self._get(refs, "evaluate") for loss in result]
            return float(sum(losses) / len(losses))
        payloads = self._payloads(batch, named)
        refs = [actor.evaluate.remote(payload) for actor, payload in zip(self.actors, payloads)]
        losses = [loss for result in self._get(refs, "evaluate") for loss in result]
        return float(sum(losses) / len(losses))

    def _place(self, rank: int) -> tuple[int, set[int]]:
        """(the first row of the global batch that `rank` reads, the batch inputs its regions take)."""
        ir = self.compiled.ir
        per = self.batch_size // (self.microbatches * self.shards)
        coords = self.mesh.coords(rank)
        shard = 0
        for a in ir.batch_axes():
            shard = shard * self.mesh.size(a) + coords[a]
        wanted = {i.ref for r in ir.regions if rank in ir.devices_of(r.index)
                  for i in self.program.regions[r.index].inputs if i.kind == BATCH}
        return shard * per * self.microbatches, wanted

    def _payloads(self, batch: tuple, named: dict) -> list[dict]:
        """Per rank, the microbatches of each batch input its regions read: its data-parallel
        shard of the global batch, cut into microbatches, packed for the wire (`wire.pack`)."""
        if named:
            batch = _by_name(batch, named, self.program.input_names)
        check_step_inputs(batch, self.program.batch, self.batch_size, self.input_names)
        per = self.batch_size // (self.microbatches * self.shards)
        payloads = []
        for rank in range(len(self.actors)):
            start, wanted = self._place(rank)
            payload = {}
            for i in wanted:
                x = self.training.cast(batch[i].detach().cpu())
                payload[i] = [wire.pack(x[start + m * per:start + (m + 1) * per].clone())
                              for m in range(self.microbatches)]
            payloads.append(payload)
        return payloads

    def _readers(self, rank: int) -> dict:
        """The `piper.data.Reader`s of `rank` ("train" for data=, "val" for val_data=)."""
        from ..data import Reader

        start, wanted = self._place(rank)
        per = self.batch_size // (self.microbatches * self.shards)
        out = {}
        sets = {"train": self.data, "val": self.val_data}
        for name, source in sets.items():
            if source is None:
                continue
            dataset, shuffle, seed = ((source.dataset, source.shuffle, source.seed) if name == "train"
                                      else (source, False, 0))
            out[name] = Reader(dataset, self.batch_size, shuffle, seed, start, per, self.microbatches,
                               tuple(sorted(wanted)), self.training.dtype)
        return out


# `nonfinite="skip"`: this many skipped steps in a row stop the run all the same. Their updates were
# skipped, so the parameters are what they were before them: a loss that stays inf or NaN for so long
# comes from the data or from parameters already non-finite (an update with finite gradients can
# still make them so: an infinite learning rate), and skipping more would only hide it.
SKIPPED_IN_A_ROW = 25


def check_finite(job, loss: float, skipped: dict | None = None) -> None:
    """After step `job.steps` (numbered from 1, as every message numbers steps): raise `non-finite` naming
    it when its loss is inf or NaN, or when
    a device found an inf or NaN in the gradients it was about to step with (`skipped`: rank ->
    what held it; that device skipped the update), under `nonfinite="skip"` only after
    `SKIPPED_IN_A_ROW` such steps in a row, the others skipped."""
    step = job.steps
    if skipped and math.isfinite(loss):       # a non-finite loss says more: reported below
        where = "; ".join(f"rank {rank}: {', '.join(what)}" for rank, what in sorted(skipped.items()))
        raise error("non-finite", f"the gradients of step {step} hold inf or NaN ({where}), its loss {loss}",
                    notes=("the devices that found them skipped that step's update; the others (whose own "
                           "gradients were finite) applied it, so the job's parameters are not one step's "
                           "any more: a checkpoint saved before it is unaffected",),
                    hint="lower the learning rate, clip the gradients (clip_grad_norm=1.0, --clip-grad-norm "
                         "1.0) or check the data; to skip such steps on every device and go on, pass "
                         "nonfinite='skip' (piper run --skip-nonfinite)")
    if math.isfinite(loss):
        job.nonfinite_in_a_row = 0
        return
    job.nonfinite_in_a_row = getattr(job, "nonfinite_in_a_row", 0) + 1
    job.skipped_steps = getattr(job, "skipped_steps", 0) + (job.training.nonfinite == "skip")
    if job.training.nonfinite == "skip" and job.nonfinite_in_a_row < SKIPPED_IN_A_ROW:
        return
    if job.nonfinite_in_a_row > 1:
        first = step - job.nonfinite_in_a_row + 1
        notes = (f"steps {first}-{step} all had a non-finite loss; their updates were skipped, so the "
                 "parameters are non-finite themselves or the data is",)
    elif step > 1:
        notes = (f"step {step - 1}'s loss was finite: its update made the parameters non-finite (a learning "
                 "rate too large, e.g. --lr inf), or this step's batch holds inf/NaN, or the model overflows",)
    else:
        notes = ("the first step: the initial parameters or the batch hold inf/NaN, or the model overflows",)
    if job.training.nonfinite != "skip" and skipped:
        notes += (f"ranks {', '.join(map(str, sorted(skipped)))} found inf/NaN in their gradients and skipped "
                  "that step's update, the others applied it; a checkpoint saved before it is unaffected",)
    elif job.training.nonfinite != "skip":
        notes += ("the job's parameters now hold that step's update; a checkpoint saved before it is "
                  "unaffected",)
    raise error("non-finite", f"the loss of step {step} is {loss}", notes=notes,
        hint="lower the learning rate, clip the gradients (clip_grad_norm=1.0, --clip-grad-norm 1.0) or check "
             "the data; to skip such steps and go on, pass nonfinite='skip' (piper run --skip-nonfinite)")


def _by_name(batch: tuple, named: dict, names: tuple[str, ...]) -> tuple:
    """The batch in capture's order from keyword inputs."""
    if batch or set(named) != set(names):
        expected = ", ".join(names) if names else "positional inputs"
        raise error("bad-inputs", f"step got {', '.join(named)} by keyword; this job takes {expected}",
                    hint="pass the batch the way example_inputs was passed (a dict for keywords)")
    return tuple(named[n] for n in names)

