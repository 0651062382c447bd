"""Mixed precision on a worker (`piper.compile(..., precision="bf16")`).

A unit keeps its float32 parameters (the master weights, which the optimizer
steps), its float32 gradient buffers and its optimizer state exactly as in
full precision, and adds a 16-bit copy of its flat parameters that the
regions compute with. Each parameter reaches a region as `_Cast(master,
low)`: the 16-bit view in forward, whose gradient autograd hands back to the
float32 master leaf in float32. So gradients accumulate over microbatches and
are reduced (all-reduce, reduce-scatter) in float32, FSDP2's
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`.

Under ZeRO-3 the float32 full buffer is never allocated: each gather casts
the member's float32 shard to 16 bits and all-gathers that, so a gathered unit
costs half the bytes and half the traffic. Replicated and ZeRO-1/2 units
refresh their 16-bit copy from the float32 parameters at the start of each
step (they hold both between steps, as autocast's weight cache does).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .clip import Deferring, drop_gradients
from .unit import Unit


class _Cast(torch.autograd.Function):
    """Forward: the 16-bit parameter. Backward: its gradient, in the master's dtype, to the master."""

    @staticmethod
    def forward(ctx, master, low):
        ctx.dtype = master.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class LowPrecisionUnit(Unit):
    """A `Unit` whose regions compute with a `dtype` copy of its parameters."""

    def __init__(self, layout, rank, zero, init, optimizer, device, *, dtype: torch.dtype):
        self.dtype = dtype
        self.low: list[torch.Tensor] = []
        self.low_views: dict[str, torch.Tensor] = {}
        super().__init__(layout, rank, zero, init, optimizer, device)
        for bucket in layout.buckets:
            low = torch.zeros(bucket.padded, dtype=dtype, device=device)
            self.low.append(low)
            for e in bucket.entries:
                self.low_views[e.name] = low[e.offset:e.offset + e.numel].view(e.shape)
        if zero == 3:
            for low in self.low:
                low.untyped_storage().resize_(0)
        else:
            self.refresh()
        self.count()

    def _tensors(self) -> dict[str, list]:
        found = super()._tensors()
        found["params"] = found["params"] + list(self.low)
        return found

    def storages(self) -> list[int]:
        """The `_cdata` of the 16-bit buffers (parameters, not activations, when autograd saves them)."""
        return [low.untyped_storage()._cdata for low in self.low]

    def refresh(self) -> None:
        """Replicated and ZeRO-1/2 units: the 16-bit copy of the current float32 parameters."""
        if self.zero < 3:
            for low, full in zip(self.low, self.full):
                low.data.copy_(full)

    def views(self) -> dict[str, torch.Tensor]:
        if torch.is_grad_enabled():
            return {name: _Cast.apply(leaf, self.low_views[name]) for name, leaf in self.leaves.items()}
        return self.low_views

    def gather(self, group):
        """ZeRO-3: all-gather the 16-bit cast of every member's float32 shard."""
        return self._gather_into(self.low, (shard.detach().to(self.dtype) for shard in self.shard), group)

    def release(self) -> None:
        for low in getattr(self, "low", ()):       # Unit.__init__ releases before `low` exists
            low.untyped_storage().resize_(0)
        if self.zero == 3 and self.full and self.full[0].untyped_storage().size():
            super().release()                     # the float32 buffer Unit.__init__ made, once
        self.count()


def make_unit(dtype: torch.dtype | None):
    """The unit class for a worker: plain `Unit` in full precision."""
    if dtype is None:
        return Unit
    return lambda *args: LowPrecisionUnit(*args, dtype=dtype)


# -- fp16: dynamic loss scaling (`piper/frontend/loss_scaling.py`) -----------------------------------------------

class DynamicLossScale(Deferring):
    """Per worker: torch.amp.GradScaler's rule over the whole job.

    The backward of each loss starts from `loss_scale` times its usual seed, so
    every gradient comes out scaled. At the end of the step, once every
    reduction is done, each device divides the gradients it holds by the scale
    and notes whether any of them is inf or NaN; one all-reduce (MAX) over all
    devices makes that one answer for every stage and shard. Then every device
    either skips its updates (gradients zeroed, the scale times
    `backoff_factor`) or clips (with `clip_grad_norm=`) and steps, the scale
    growing by `growth_factor` after `growth_interval` good steps in a row.
    Like `GlobalNormClip`, it holds the updates back until then (`defer`).
    """

    def __init__(self, config, clip=None):
        super().__init__()
        self.config = config
        self.clip = clip                      # a GlobalNormClip, or None
        self.loss_scale = float(config.init_scale)
        self.good_steps = 0                   # steps in a row without an inf/NaN
        self.skipped = 0                      # steps skipped since the job started
        self.last_skipped = False

    @property
    def norm(self) -> float | None:
        """The clip's last global norm (`job.grad_norm()`), of the unscaled gradients."""
        return self.clip.norm if self.clip is not None else None

    def finish(self, units, run, experts=()) -> None:
        """Unscale, agree on inf/NaN across every device, then step (or skip) and update the scale."""
        from .clip import run_deferred, scaled_gradients

        expert_grads = [g for g in experts if g is not None]
        grads = [g for unit in units for g in scaled_gradients(unit)] + expert_grads
        device = grads[0].device if grads else next(
            (full.device for u in units for full in u.full), torch.device("cpu"))
        found = torch.zeros(1, dtype=torch.float32, device=device)
        # GradScaler's kernel and its reciprocal: 1/scale in float64, then float32.
        inv = torch.full((1,), self.loss_scale, dtype=torch.float64, device=device).reciprocal().float()
        by_dtype: dict[torch.dtype, list] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.last_skipped = bool(found.item())
        if self.last_skipped:
            self.deferred = []                # no update, and so no gather of updated shards
            for unit in units:
                drop_gradients(unit)
            for g in expert_grads:
                g.zero_()
            self.skipped += 1
            self.good_steps = 0
            self.loss_scale *= self.config.backoff_factor
            return
        self.good_steps += 1
        if self.good_steps == self.config.growth_interval:
            self.good_steps = 0
            self.loss_scale *= self.config.growth_factor
        if self.clip is not None:
            self.clip.clip(units, experts)
        run_deferred(self, run)

    def state(self) -> dict:
        return {"scale": self.loss_scale, "skipped_steps": self.skipped, "last_step_skipped": self.last_skipped,
                "good_steps": self.good_steps}


class _KeepScale:
    """`DynamicLossScale` settings that never scale: a scale of 1 that neither grows nor shrinks,
    so only the scaler's skip of a step with inf/NaN gradients is left
    (`piper.compile(..., nonfinite="skip")` in full or bf16 precision)."""
    init_scale = 1.0
    growth_factor = 1.0
    backoff_factor = 1.0
    growth_interval = 2 ** 62


def with_loss_scaling(clip, config, *, skip_nonfinite: bool = False):
    """What the executor holds back its updates with: `clip` alone, or fp16's loss scaler around it
    (which skips a step whose gradients hold an inf or a NaN; `skip_nonfinite` without fp16: the
    scaler's skip alone, at a scale of 1, so the gradients are exactly the unscaled ones)."""
    if config is None and skip_nonfinite:
        config = _KeepScale()
    return clip if config is None else DynamicLossScale(config, clip)
