"""Running a job's steps (and evaluations): the global batch cut per device and microbatch, and every
call to the workers.

Mixed into `piper.job.Job`.
"""
from __future__ import annotations

from ..frontend.batch_check import check_step_inputs
from ..frontend.capture import BATCH
from ..diagnostics import PiperError, error
from ..frontend.lr_schedules import scale_at


class JobSteps:
    """`step`, `evaluate`, and `_get`, the one way the driver waits for its workers (deadline, health)."""

    def _get(self, refs, what: str, limit: float | None = None):
        """ray.get with a deadline; a dead, stalled or failing worker closes the job with an error
        naming it (`runtime.health`)."""
        ranks = list(range(len(refs))) if len(refs) == len(self.actors) else [0] * len(refs)
        try:
            return self._watch.wait(refs, what, self.timeout if limit is None else limit, ranks)
        except BaseException as exc:
            self._broken = True     # its workers may be mid-collective: never kept for another job
            if isinstance(exc, PiperError):
                self.close()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise error("job-closed", "this job is closed", hint="compile a new job")

    def step(self, *batch, **named) -> float:
        """One optimizer step on the global batch; returns its mean loss.

        A job compiled with a dict of example inputs takes the batch by the same keywords."""
        payloads = self._payloads(batch, named)
        # The schedule's multiplier for this step, the same on every device (None: the base rates).
        scale = scale_at(self.lr_schedule, self.steps) if self.lr_schedule is not None else None
        refs = [actor.step.remote(payload, scale) for actor, payload in zip(self.actors, payloads)]
        losses = [loss for result in self._get(refs, "step") for loss in result]
        self.steps += 1
        return float(sum(losses) / len(losses))

    def evaluate(self, *batch, **named) -> float:
        """The mean loss of the global batch without any update: the forward half of every
        device's plan, on the same devices (`runtime.evaluation`). Parameters, optimizer state
        and the step count stay as they are.

            val_loss = job.evaluate(x, y)
        """
        payloads = self._payloads(batch, named)
        refs = [actor.evaluate.remote(payload) for actor, payload in zip(self.actors, payloads)]
        losses = [loss for result in self._get(refs, "evaluate") for loss in result]
        return float(sum(losses) / len(losses))

    def _payloads(self, batch: tuple, named: dict) -> list[dict]:
        """Per rank, the microbatches of each batch input its regions read: its data-parallel
        shard of the global batch, cut into microbatches."""
        self._check_open()
        if named:
            batch = _by_name(batch, named, self.program.input_names)
        check_step_inputs(batch, self.program.batch, self.batch_size, self.input_names)
        ir = self.compiled.ir
        per = self.batch_size // (self.microbatches * self.shards)
        axes = ir.batch_axes()
        payloads = []
        for rank in range(len(self.actors)):
            coords = self.mesh.coords(rank)
            shard = 0
            for a in axes:
                shard = shard * self.mesh.size(a) + coords[a]
            wanted = {i.ref for r in ir.regions if rank in ir.devices_of(r.index)
                      for i in self.program.regions[r.index].inputs if i.kind == BATCH}
            payload = {}
            for i in wanted:
                x = self.training.cast(batch[i].detach().cpu())
                start = shard * per * self.microbatches
                payload[i] = [x[start + m * per:start + (m + 1) * per].clone() for m in range(self.microbatches)]
            payloads.append(payload)
        return payloads


def _by_name(batch: tuple, named: dict, names: tuple[str, ...]) -> tuple:
    """The batch in capture's order from keyword inputs."""
    if batch or set(named) != set(names):
        expected = ", ".join(names) if names else "positional inputs"
        raise error("bad-inputs", f"step got {', '.join(named)} by keyword; this job takes {expected}",
                    hint="pass the batch the way example_inputs was passed (a dict for keywords)")
    return tuple(named[n] for n in names)
