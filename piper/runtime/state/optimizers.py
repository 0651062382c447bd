"""Building a device's optimizer over its flat shards, with parameter groups, and the
learning-rate schedule's multiplier set on it before each step.

Without groups the job's `optimizer` is a callable taking a list of tensors.
With groups (`piper.param_groups`, or a function of the named parameters) the
driver hands every worker a `Grouped` record: the optimizer class, its
defaults, each group's own options and the group of every parameter. The
flat layout keeps each group's parameters in buckets of their own
(`piper.compiler.flat_layout.layout_unit`), so a ZeRO shard never mixes two groups: each shard joins
the torch param group of its bucket, and every element is stepped with exactly
its group's options.

A per-tensor optimizer (Muon, Adafactor: `frontend.optim_check.update_kind`) is built over
the parameters themselves instead, each a view of the flat shard in its own shape (`unit.Unit`),
those this member owns under ZeRO; a member owning none holds an empty `Combined`, as does a
`piper.per_group` job one `Combined` of its optimizers.
"""
from __future__ import annotations

import torch

from ...frontend.combined_optimizer import Combined
from ...frontend.param_groups import Grouped


def build(optimizer, tensors: list[torch.Tensor], groups: list[int | None]) -> torch.optim.Optimizer:
    """The optimizer over `tensors` (flat shards or expert leaves), `groups[i]` the parameter
    group of `tensors[i]` (None without groups). Every group remembers its base learning rate
    as `initial_lr` (torch's LambdaLR keeps it there too) for `set_lr_scale`."""
    if isinstance(optimizer, Grouped):
        built = optimizer.make(tensors, groups)
    elif not tensors:      # a member that owns no parameter of a per-tensor optimizer's bucket
        built = Combined([])
    else:
        built = optimizer(tensors)
    for group in built.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return built


def set_lr_scale(optimizers, scale: float) -> None:
    """Every group's learning rate to its base rate times `scale` (one step of a LambdaLR)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * scale
