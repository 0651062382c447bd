"""Several torch optimizers stepped as one: `piper.per_group`'s groups (Muon on the matrices,
AdamW on the rest) and a device that owns no parameter of a per-tensor group (none at all).

They share one `state` dict (keyed by parameter, so no two collide), and `param_groups`
lists every optimizer's groups, the same dicts, so setting a group's "lr" reaches its
optimizer: what the learning-rate schedule, checkpoints and `init_optimizer_state` read.
"""
from __future__ import annotations

from collections import defaultdict

import torch


class Combined:
    """`Combined([muon, adamw])`: `step()` steps each; `state` and `param_groups` are all of theirs."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        self.state: defaultdict = defaultdict(dict)
        for opt in self.optimizers:
            self.state.update(opt.state)
            opt.state = self.state

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def defaults(self) -> dict:
        return dict(self.optimizers[0].defaults) if self.optimizers else {}

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"Combined({', '.join(type(o).__name__ for o in self.optimizers)})"
