"""A job's state: checkpoints (`save`, `load`, see `piper.job.checkpoint`) and the full parameters (`state_dict`).

Mixed into `piper.job.Job`.
"""
from __future__ import annotations

import torch

from . import checkpoint
from ..ir.experts import expert_state
from ..runtime.state.flat_buffers import unflatten
from .tensor_units import layouts_by_index, whole


class JobState:
    """`save`, `load`, `state_dict`; needs `_get`, the unit layouts and the buffers."""

    def save(self, path) -> str:
        """Write a checkpoint directory (torch.distributed.checkpoint format) at `path`: every
        worker writes its own shards; parameters and optimizer state per parameter under
        model.state_dict() names, the step count, strategy and mesh. See `piper.job.checkpoint`."""
        return checkpoint.save(self, path)

    def load(self, path) -> dict:
        """Load a checkpoint saved by any job of the same model, whatever its strategy and mesh:
        parameters, optimizer state and step count, resharded. Returns its `piper` metadata."""
        return checkpoint.load(self, path)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded parameters (and buffers), keyed as model.state_dict(), on CPU."""
        self._check_open()
        shards = self._get([a.shards.remote() for a in self.actors], "state_dict")
        out: dict[str, torch.Tensor] = {}
        for u in self.layouts:
            by_index = []
            for layout in layouts_by_index(self, u):        # one per tp index (one without tp)
                held = {}
                for b, bucket in enumerate(layout.buckets):
                    held.update(unflatten(bucket, torch.cat([shards[rank][u][b] for rank in layout.group])))
                by_index.append(held)
            out.update(whole(self.program.tensor, by_index) if self.program.tensor is not None else by_index[0])
        if self._expert_weights:
            out.update(expert_state(self.compiled.ir, self.program, self._expert_weights, shards))
        out.update({k: v.clone() for k, v in self._buffers.items()})
        # model.state_dict()'s keys: a tied weight under each name, no non-persistent buffers.
        return {k: out[src] for k, src in self._state_keys.items() if src in out}
