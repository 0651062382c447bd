"""The training options of `piper.compile` that every strategy shares: `precision=` and
`clip_grad_norm=`, checked before anything is captured or started.

    piper.compile(model, batch, strategy=..., precision="bf16", clip_grad_norm=1.0)
    piper.compile(model, batch, strategy=..., precision=piper.FP16(growth_interval=100))   # `loss_scaling.py`
"""
from __future__ import annotations

import math

import torch

from ..diagnostics import did_you_mean, error
from .loss_scaling import FP16

# precision= -> the dtype computes run in (None: the model's own dtype).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The 16-bit dtype `precision` computes in, or None for the model's own dtype ("fp32")."""
    if isinstance(precision, FP16):
        return torch.float16
    if not isinstance(precision, str) or precision not in PRECISIONS:
        shown = repr(precision)
        raise error("bad-precision", f"precision={shown} is not one of {', '.join(map(repr, PRECISIONS))}",
                    notes=("'bf16' and 'fp16' compute in 16 bits and keep the master weights, the optimizer "
                           "state and the gradient reductions in float32; 'fp32' computes in the model's own "
                           "dtype; 'fp16' scales the loss (dynamic loss scaling, set with piper.FP16(...))",),
                    hint=(did_you_mean(precision, PRECISIONS) if isinstance(precision, str) else None)
                    or "use precision='bf16' (8-bit integer training is not supported)")
    return PRECISIONS[precision]


NONFINITE = ("stop", "skip")


def check_nonfinite(value) -> str:
    """`nonfinite=`: "stop" (a step with a non-finite loss raises `non-finite`) or "skip" (its update is
    skipped on every device, as fp16's scaler skips one, and training goes on)."""
    if value not in NONFINITE:
        raise error("bad-nonfinite", f"nonfinite={value!r} is not one of {', '.join(map(repr, NONFINITE))}",
                    hint="nonfinite='stop' (the default) stops at the first step whose loss is inf or NaN; "
                         "nonfinite='skip' skips the updates of such steps and goes on")
    return value


def check_clip(value) -> float | None:
    """`clip_grad_norm=` as a float (None: no clipping); a positive finite number or a diagnostic."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise error("bad-clip", f"clip_grad_norm={value!r} must be a positive number",
                    hint="pass the largest global gradient norm to allow, e.g. clip_grad_norm=1.0, or None")
    return float(value)


class TrainingOptions:
    """What `piper.compile` hands each worker of `precision=`, `clip_grad_norm=` and the
    regions a strategy's `recompute` statements picked."""

    def __init__(self, dtype: torch.dtype | None = None, clip: float | None = None, scaling: FP16 | None = None,
                 nonfinite: str = "stop"):
        self.dtype = dtype
        self.clip = clip
        self.scaling = scaling        # fp16's loss scaling (`loss_scaling.py`), else None
        self.nonfinite = nonfinite    # "stop" or "skip": a step whose loss or gradients are inf/NaN

    def configure(self, spec, ir, program) -> None:
        """Set this job's options on one worker's spec."""
        spec.clip_grad_norm = self.clip
        spec.loss_scaling = self.scaling
        spec.skip_nonfinite = self.nonfinite == "skip"
        for r, region in spec.regions.items():
            region.recompute = r in ir.recompute
        spec.compute_dtype = self.dtype
        if self.dtype is not None:
            spec.buffers = {k: self.cast(v) for k, v in spec.buffers.items()}

    # -- precision= ----------------------------------------------------------------------------
    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """A floating-point tensor in the compute dtype (others, e.g. token ids, as they are)."""
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def capture_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the regions will compute: a meta-device copy in the compute dtype, so the
        graphs' own constants and casts follow it. In full precision, the model itself."""
        if self.dtype is None:
            return model
        from .capture import _meta_copy

        return _meta_copy(model).to(self.dtype)

    def master_specs(self, program, model: torch.nn.Module, inputs=()) -> None:
        """Keep the parameters' own dtypes (float32 masters) in `program.params`: the flat units,
        their shards and the optimizer are laid out from these. The batch keeps the dtypes the
        user passes too (`job.step` casts floating-point inputs on the way to the workers)."""
        if self.dtype is None:
            return
        from .capture import TensorSpec

        own = dict(model.named_parameters())
        program.params = {k: TensorSpec(v.shape, own[k].dtype) if k in own else v for k, v in program.params.items()}
        if len(inputs) == len(program.batch):
            program.batch = tuple(TensorSpec(spec.shape, x.dtype) for spec, x in zip(program.batch, inputs))
