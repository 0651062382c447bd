"""Learning-rate schedules for `piper.compile(..., lr_schedule=FN)`: `FN(step)` is the multiplier
of every parameter group's base learning rate at optimizer step `step` (0, 1, ...), as
torch's `LambdaLR` means it; the driver computes it and every device applies it before
that step.

    lr_schedule=piper.warmup_cosine(warmup=100, total=2000, min_ratio=0.1)
    lr_schedule=lambda step: min(1.0, (step + 1) / 100)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..diagnostics import error


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup over `warmup` steps, then a cosine from 1 down to `min_ratio` at step
    `total`, and `min_ratio` after (nanoGPT's and torchtitan's recipe).

        WarmupCosine(2, 10)(0) == 1/3;  WarmupCosine(2, 10)(2) == 1.0;  WarmupCosine(2, 10)(10) == 0.1
    """

    warmup: int
    total: int
    min_ratio: float = 0.1

    def __post_init__(self):
        if not (isinstance(self.warmup, int) and isinstance(self.total, int)) or self.warmup < 0 \
                or self.total < self.warmup:
            raise error("bad-lr-schedule", f"warmup_cosine(warmup={self.warmup!r}, total={self.total!r}) needs "
                        "whole numbers of steps with 0 <= warmup <= total",
                        hint="e.g. piper.warmup_cosine(100, 2000): 100 warmup steps of a 2000-step run")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise error("bad-lr-schedule", f"min_ratio={self.min_ratio!r} is not between 0 and 1",
                        hint="min_ratio is the final fraction of the base learning rate, e.g. 0.1")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if step >= self.total:
            return self.min_ratio
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return self.min_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - self.min_ratio)


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1) -> WarmupCosine:
    """The usual LLM schedule: `warmup` steps of linear warmup, a cosine decay to `min_ratio` of
    the base learning rate at step `total`."""
    return WarmupCosine(warmup, total, min_ratio)


def check_schedule(schedule) -> None:
    """bad-lr-schedule unless `schedule` is None or callable."""
    if schedule is not None and not callable(schedule):
        raise error("bad-lr-schedule", f"lr_schedule={schedule!r} is not a function of the step",
                    hint="pass e.g. lr_schedule=piper.warmup_cosine(100, 2000), or lambda step: multiplier")


def scale_at(schedule, step: int) -> float:
    """`schedule(step)`, checked to be a finite number >= 0."""
    try:
        value = schedule(step)
    except Exception as exc:  # noqa: BLE001 - the user's function, reported with its words
        raise error("bad-lr-schedule", f"lr_schedule({step}) raised {type(exc).__name__}: {exc}",
                    hint="the schedule is called with the optimizer step (0, 1, ...) and returns the "
                         "multiplier of the base learning rate") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise error("bad-lr-schedule", f"lr_schedule({step}) returned {value!r}, not a finite number >= 0",
                    hint="return the multiplier of the base learning rate, e.g. 1.0 for the base rate")
    return float(value)
