"""Gradient clipping by the global norm (`piper.compile(..., clip_grad_norm=1.0)`).

The norm is over every parameter of the model, whatever the strategy: each
device adds the squares of the gradient elements it owns, one all-reduce over
all devices sums them, and every device scales its gradients by the same
factor before its optimizer steps. "Owns" makes each element count once: a
unit's flat gradient buffer is cut into the same slices ZeRO shards it into
(`Bucket.bounds`), so a replicated unit (dp, ZeRO-1, after its all-reduce)
counts its slice on each replica and a ZeRO-2/3 unit counts its shard. The
result equals `torch.nn.utils.clip_grad_norm_` on one device.

The updates (and ZeRO-1/2's gathers of the updated shards after them) wait
until the end of the step: a unit's gradients may be final long before other
stages finish their backwards, and no device may step until the norm over
all of them is known. Nothing later in a step reads an updated parameter, so
holding the updates back changes no other action.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class Deferring:
    """Holds a step's updates back until `finish` knows what every device found."""

    def __init__(self):
        self.deferred: list = []      # UPD and ALL_GATHER-after-UPD actions, in plan order
        self.flushing = False

    def defer(self, action) -> bool:
        """True if `action` is held back until `finish` (the executor then skips it for now)."""
        if self.flushing:
            return False
        self.deferred.append(action)
        return True


class GlobalNormClip(Deferring):
    """Per worker: holds the step's updates back, then clips and runs them (`finish`)."""

    def __init__(self, max_norm: float):
        super().__init__()
        self.max_norm = float(max_norm)
        self.norm: float | None = None   # the last step's global gradient norm, before clipping
        self.nonfinite = False           # the last step's norm was inf or NaN: its updates were skipped

    def finish(self, units, run, experts=()) -> None:
        """Clip every unit's gradients by the global norm, then run the held-back actions with `run`.

        `experts`: this device's expert-row gradients under `shard experts` (each row lives on one
        device only, so every device counts and scales all of its own).
        Called on every device at the end of the step, once every reduction is done. A non-finite
        norm (the same on every device) skips every update of the step instead, on every device:
        `nonfinite` says so and the driver stops (`nonfinite="skip"` runs the loss scaler's check
        instead, before this)."""
        self.clip(units, experts)
        self.nonfinite = not math.isfinite(self.norm)
        if self.nonfinite:
            self.deferred = []
            for unit in units:
                drop_gradients(unit)
            for g in experts:
                if g is not None:
                    g.zero_()
            return
        run_deferred(self, run)

    def clip(self, units, experts=()) -> None:
        """Scale every gradient this device holds by the global-norm factor (one all-reduce)."""
        squares = torch.zeros((), dtype=torch.float64)
        device = None
        experts = [g for g in experts if g is not None]
        for grad in [g for unit in units for g in owned_gradients(unit)] + experts:
            device = grad.device
            squares = squares.to(grad.device) + grad.double().pow(2).sum()
        if device is None:
            device = next((full.device for u in units for full in u.full), torch.device("cpu"))
            squares = squares.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        total = squares.sqrt()
        self.norm = float(total)
        # torch.nn.utils.clip_grad_norm_'s factor, clamped so gradients only ever shrink.
        factor = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        for grad in [g for unit in units for g in scaled_gradients(unit)] + experts:
            grad.mul_(factor.to(grad.dtype))


def run_deferred(holder, run) -> None:
    """Run the actions `holder` (a GlobalNormClip or a loss scaler) held back, in plan order."""
    actions, holder.deferred = holder.deferred, []
    holder.flushing = True
    try:
        for action in actions:
            run(action)
    finally:
        holder.flushing = False


def drop_gradients(unit) -> None:
    """A skipped step: let go of the unit's gradients as its `step` would after the optimizer."""
    unit.release_grads()


def gradients_finite(grads) -> bool:
    """Whether every element of `grads` (tensors, None skipped) is finite: one sync per device.

    torch's AMP check (`GradScaler`'s) with a scale of 1, which leaves every value as it is: one
    fused pass over a device's tensors of a dtype, where an `isfinite` and an `all` per tensor
    were two kernel launches and two Python calls each (on one H200, 2.4 ms of a 23 ms step of a
    small model with a unit per parameter)."""
    groups: dict = {}
    for g in grads:
        if g is not None:
            groups.setdefault((g.device, g.dtype), []).append(g)
    found: dict = {}
    for (device, _), tensors in groups.items():
        if device not in found:
            found[device] = (torch.zeros(1, dtype=torch.float32, device=device),
                             torch.ones(1, dtype=torch.float32, device=device))
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, *found[device])
    return not any(flag.item() for flag, _ in found.values())


def owned_gradients(unit):
    """The gradient elements this member of the unit's group counts towards the norm."""
    for i, bucket in enumerate(unit.layout.buckets):
        if not bucket.counted:          # a tied weight's second copy: its first copy counts the sum
            continue
        if unit.zero >= 2:
            if unit.grad_shard[i] is not None:
                yield unit.grad_shard[i]
        elif unit.flat_grad[i] is not None:
            lo, hi = bucket.bounds(unit.index)
            yield unit.flat_grad[i][lo:hi]


def scaled_gradients(unit):
    """The gradient buffers `Unit.step` hands the optimizer (all of them: each replica scales its own)."""
    for i in range(len(unit.layout.buckets)):
        grad = unit.grad_shard[i] if unit.zero >= 2 else unit.flat_grad[i]
        if grad is not None:
            yield grad
