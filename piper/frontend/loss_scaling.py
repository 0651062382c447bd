"""fp16's dynamic loss scaling, as `piper.compile(..., precision=piper.FP16(...))` configures it.

    job = piper.compile(model, batch, strategy=..., precision="fp16")                 # the defaults
    job = piper.compile(model, batch, strategy=..., precision=piper.FP16(growth_interval=100))

float16 holds magnitudes from about 6e-8 to 65504, and small gradients
underflow to zero. So the backward starts from the loss times a scale S
(gradients come out S times larger), the float32 gradients are divided by S
before clipping and the optimizer, and a step whose gradients hold an inf or
a NaN anywhere in the model (any stage, any ZeRO shard) is skipped on every
device and S shrinks by `backoff_factor`; after `growth_interval` steps in a
row without one, S grows by `growth_factor`. This is `torch.amp.GradScaler`'s
rule, with its defaults. The runtime side is `piper/runtime/state/precision.py`;
`piper.loss_scale(job)` reads the state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..diagnostics import error


@dataclass(frozen=True)
class FP16:
    """fp16 compute (as `precision="fp16"`) with these loss-scaling settings (torch.amp.GradScaler's defaults)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        for name, ok, want in (
                ("init_scale", _finite(self.init_scale) and self.init_scale > 0, "a positive number"),
                ("growth_factor", _finite(self.growth_factor) and self.growth_factor > 1, "a number above 1"),
                ("backoff_factor", _finite(self.backoff_factor) and 0 < self.backoff_factor < 1,
                 "a number between 0 and 1"),
                ("growth_interval", isinstance(self.growth_interval, int) and not isinstance(
                    self.growth_interval, bool) and self.growth_interval >= 1, "a whole number of steps >= 1")):
            if not ok:
                raise error("bad-precision", f"piper.FP16({name}={getattr(self, name)!r}): {name} must be {want}",
                            hint="the defaults are torch.amp.GradScaler's: piper.FP16(init_scale=65536.0, "
                                 "growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def loss_scaling(precision) -> FP16 | None:
    """The loss-scaling settings `precision` asks for: FP16() for "fp16", the FP16 given, else None."""
    if isinstance(precision, FP16):
        return precision
    return FP16() if precision == "fp16" else None


def loss_scale(job, *, every_rank: bool = False):
    """The loss scaler's state after the last step of an fp16 `job`, else None:
    `{"scale": 32768.0, "skipped_steps": 1, "last_step_skipped": False, "good_steps": 3}`.
    Every device holds the same; `every_rank=True` gives the list, rank by rank."""
    job._check_open()
    states = job._get([a.__ray_call__.remote(_scaler_state) for a in job.actors], "loss_scale")
    return states if every_rank else states[0]


def _scaler_state(worker):
    scaler = worker.executor.clip
    return scaler.state() if hasattr(scaler, "state") else None


def checkpoint_state(job) -> dict | None:
    """What a checkpoint keeps of an fp16 job's scaler (as GradScaler.state_dict): the scale and
    the good steps in a row, so a resumed run neither restarts at `init_scale` nor loses its growth."""
    if job.training.scaling is None:
        return None
    state = loss_scale(job)
    return {"scale": state["scale"], "good_steps": state["good_steps"]}


def restore(job, state: dict | None) -> None:
    """Give every device the scaler state a checkpoint kept (nothing for a non-fp16 job or an
    fp32 checkpoint: the scale then starts at `init_scale`)."""
    if job.training.scaling is None or not state:
        return
    job._get([a.__ray_call__.remote(_set_scaler_state, float(state["scale"]), int(state["good_steps"]))
              for a in job.actors], "load")


def _set_scaler_state(worker, scale: float, good_steps: int) -> None:
    scaler = worker.executor.clip
    scaler.loss_scale, scaler.good_steps = scale, good_steps
