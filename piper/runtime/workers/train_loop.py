"""Many steps in one call: each worker reads its own batches and steps on, without a call from the
driver per step (`Job.train`). The driver's call and wait cost 1.6-2 ms a step on our machines, which
torchrun-style loops never pay.

Every worker must stop at the same step, where `job.step()` would have raised: after each step one
all-reduce over every device adds up the step's losses and counts, and whether any device skipped its
update for an inf or NaN. With that sum each worker applies the same rule (`stops`). Each records its
own losses of the step, which the driver reads as they come (`train_progress`, answered from the
health concurrency group while steps run) and averages over the devices in rank order, as
`job.step()` does, so the losses are the same to the bit.
"""
from __future__ import annotations

import math
import time

import ray
import torch

# `nonfinite="skip"`: this many skipped steps in a row stop the run all the same (the driver's
# `piper.job.steps.SKIPPED_IN_A_ROW`, passed in so the two never differ).


def stops(loss: float, any_skipped: bool, skip_mode: bool, in_a_row: int, limit: int) -> tuple[bool, int]:
    """(whether the step ends the run, the count of non-finite losses in a row after it), by the rule
    `piper.job.steps.check_finite` applies on the driver to the same step.

    >>> stops(1.0, False, False, 0, 25), stops(float("nan"), True, True, 3, 25)
    ((False, 0), (False, 4))
    """
    if any_skipped and math.isfinite(loss):
        return True, in_a_row
    if math.isfinite(loss):
        return False, 0
    in_a_row += 1
    return (not skip_mode) or in_a_row >= limit, in_a_row


class TrainLoop:
    """Mixed into `Worker`: `train_data` runs steps; `train_progress` reports them while it does."""

    def train_data(self, first: int, scales: list, skip_mode: bool, in_a_row: int, limit: int) -> list[dict]:
        """Steps on global batches `first`, `first + 1`, ... of the job's training data, one per entry
        of `scales` (each step's learning-rate multiplier, or None), until they are done or a step
        stops the run (`stops`). Returns each step's record here: this device's losses, the seconds
        the step took, what made this device skip its update (if anything), the multiplier, the global
        gradient norm before clipping (with `clip_grad_norm=`; None without)."""
        import torch.distributed as dist

        self.train_log = []
        device = "cuda:0" if self.device == "cuda" else "cpu"
        for i, scale in enumerate(scales):
            start = time.perf_counter()
            result = self.step_data("train", first + i, scale)
            losses, skipped = (result["losses"], result["nonfinite"]) if isinstance(result, dict) else (result, [])
            agreed = torch.tensor([math.fsum(losses), float(len(losses)), float(bool(skipped))],
                                  dtype=torch.float64, device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(agreed)
            total, count, skipping = agreed.tolist()
            stop, in_a_row = stops(total / count, skipping > 0, skip_mode, in_a_row, limit)
            clip = self.executor.clip
            self.train_log.append({"losses": list(losses), "seconds": time.perf_counter() - start,
                                   "nonfinite": list(skipped), "lr_scale": scale,
                                   "grad_norm": clip.norm if clip is not None else None})
            if stop:
                break
        return list(self.train_log)

    @ray.method(concurrency_group="health")
    def train_progress(self, since: int) -> list[dict]:
        """The metrics of the steps the running `train_data` call has finished, from the `since`-th."""
        return list(getattr(self, "train_log", ())[since:])
