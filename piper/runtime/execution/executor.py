"""The executor: runs one device's plan, action by action.

It knows regions, values, parameter units and communication, and nothing of
pipelines or ZeRO: every strategy arrives as the same kind of plan.
Communication is issued asynchronously (sends, receives and collectives
return work handles) and an action waits only for the handles its plan
entry names. The items of an overlapped slot run at once, in lanes
(`slots`).

Each concern is one mixin, in the module named for what it holds: step_loop
(run_step, the driver of each action, timings), lanes (overlapped slots in
threads), forward_actions (F), backward_actions (B, BI, BW, UPD), comm_actions
(SEND, RECV and the collectives), memory_accounting (what is held, at most),
evaluation (`run_eval`, the forward-only plan).
An action runs as the method named for its op: `F` -> `_f`, `ALL_GATHER` ->
`_all_gather`.
"""
from __future__ import annotations

import torch

from ..launch.packed_graphs import unpack
from ..launch.specs import BATCH, BUFFER, PARAM, VALUE, RegionSpec, WorkerSpec
from ..communication import collectives, tensor_groups
from ..communication.comm_actions import CommActions
from ..state import optimizers
from ..state.clip import GlobalNormClip
from ..state.unit import Unit
from ..moe.expert_groups import Experts
from ..moe.pieces import cut_regions
from .backward_actions import BackwardActions
from .evaluation import Evaluation
from .forward_actions import ForwardActions
from .lanes import Lanes
from .memory_accounting import MemoryAccounting
from .saved_sizes import SavedSizes
from .step_loop import TRACE_STEPS, StepLoop
from .value_lifetimes import last_readers

# Imported from here by the driver (`piper.job`), `precision.py` and tests.
__all__ = ["Executor", "RegionSpec", "WorkerSpec", "Unit", "TRACE_STEPS", "PARAM", "BUFFER", "BATCH", "VALUE"]


# The pieces share one step's state (values, gradients, pending work, the lock the
# lanes share), so they are mixins reading `self` rather than objects handing that
# state to each other on every action.
class Executor(StepLoop, Lanes, ForwardActions, BackwardActions, CommActions, MemoryAccounting, Evaluation):
    """One device's plan on one worker: `run_step(batch)` per step, `run_eval(batch)` for a loss
    without an update; `shards`, `memory` between steps."""

    def __init__(self, spec: WorkerSpec, init: dict[int, list[torch.Tensor]], device: str = "cpu"):
        self.spec = spec
        self.rank = spec.rank
        self.device = torch.device(device)
        for region in spec.regions.values():
            region.graph = unpack(region.graph, self.device)
        # Under tp a plan's collective over a region's devices runs over this tp index's part of them.
        tensor = getattr(spec, "tensor", None)
        self.groups = tensor_groups.mine(spec.groups, tensor, spec.rank,
                                         collectives.new_groups(tensor_groups.split_groups(spec.groups, tensor)))
        self.tensor_groups = tensor_groups.make_groups(tensor, spec.rank)     # what the TP ops reduce over
        from ..state.precision import make_unit, with_loss_scaling

        make = make_unit(spec.compute_dtype)
        self.units = {u: make(layout, spec.rank, spec.zero, init[u], spec.optimizer, self.device)
                      for u, layout in spec.units.items()}
        for unit in self.units.values():
            unit.tensor_groups = self.tensor_groups     # "summed" buckets are all-reduced over tp first
        self.experts = (Experts(spec.experts, spec.rank, init.get("experts", {}), spec.optimizer, self.device)
                        if spec.experts is not None else None)
        self.pieces = cut_regions(spec, self.experts)     # regions run as pieces and exchanges (`moe.pieces`)
        self.buffers = {k: v.to(self.device) for k, v in spec.buffers.items()}
        self.by_value = {(p, i): v for v, (p, i, *_rest) in spec.values.items()}
        self._last_reads = last_readers(spec.plan, spec.regions, self.by_value)     # `_let_go_values`
        self.pending: dict[str, tuple[list, object]] = {}
        self.sends: dict[str, object] = {}     # SEND key -> its work, until waited for
        self._saved_sizes = SavedSizes()        # `_f`: saved bytes counted once per input signature
        self._init_step_loop()
        self._init_backward(spec)
        self._init_accounting()
        self._init_lanes(spec)
        self.clip = GlobalNormClip(spec.clip_grad_norm) if spec.clip_grad_norm is not None else None
        self.clip = with_loss_scaling(self.clip, spec.loss_scaling,     # fp16 (`precision.py`)
                                      skip_nonfinite=getattr(spec, "skip_nonfinite", False))

    def skipped_updates(self) -> list[str]:
        """What made the last step skip updates for a non-finite gradient (`_upd`, the clip's norm)."""
        found = list(getattr(self, "nonfinite", ()))
        if getattr(self.clip, "nonfinite", False):
            found.append(f"the global gradient norm ({self.clip.norm})")
        return found

    def set_lr_scale(self, scale: float) -> None:
        """Every optimizer's groups (units' and expert rows') at `scale` times their base rate."""
        opts = [unit.optimizer for unit in self.units.values()]
        if self.experts is not None:
            opts += list(self.experts.optimizers.values())
        optimizers.set_lr_scale(opts, scale)

    def shards(self) -> dict:
        out = {u: unit.shards() for u, unit in self.units.items()}
        if self.experts is not None:
            out["experts"] = self.experts.shards()     # this device's expert rows, by weight name
        return out
