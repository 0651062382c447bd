"""What the driver hands each worker: its plan, regions, values and units (`WorkerSpec`).

Plain records, built by `piper.job` and read by the `Executor`; the input kinds
repeat `piper.frontend.capture`'s, so the runtime needs nothing from capture.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...compiler.flat_layout import UnitLayout

PARAM, BUFFER, BATCH, VALUE = "param", "buffer", "batch", "value"


@dataclass
class RegionSpec:
    index: int
    graph: object                 # PackedGraph; an fx.GraphModule once unpacked on the worker
    inputs: tuple                 # capture.RegionInput records
    outputs: tuple[int, ...]      # value ids
    loss: bool
    units: tuple[int, ...]        # owner regions whose parameters it reads
    recompute: bool = False       # keep only the inputs in forward, run it again in backward


@dataclass
class WorkerSpec:
    rank: int
    world_size: int
    plan: tuple                                   # compiler.Action records
    regions: dict[int, RegionSpec]
    values: dict[int, tuple]                      # id -> (producer, index, shape, dtype, differentiable)
    units: dict[int, UnitLayout]                  # units this rank holds
    zero: int
    optimizer: object                             # callable(params) -> torch.optim.Optimizer
    grad_scale: float                             # 1 / (microbatches * batch shards)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list = field(default_factory=list)    # every collective group, same order on all ranks
    slots: tuple = ()                             # `order` slots of several computes, as tuples of keys
    concurrent: bool = True                       # run an overlapped slot's items at once (CPU only, `lanes.py`)
    clip_grad_norm: float | None = None           # clip by the global gradient norm (`clip.py`)
    compute_dtype: torch.dtype | None = None      # 16-bit compute, float32 master (`precision.py`)
    loss_scaling: object = None                   # fp16's loss scaling (piper.FP16), else None
    skip_nonfinite: bool = False                  # skip updates whose gradients hold inf/NaN (`precision.py`)
    experts: object = None                        # runtime.moe.expert_groups.ExpertSpec under `shard experts`
    tensor: object = None                         # communication.tensor_groups.TensorSpec under tensor parallelism
    received: dict = field(default_factory=dict)  # RECV key -> SEND keys its arrival proves delivered (`received.py`)
    readers: dict = field(default_factory=dict)   # "train"/"val" -> piper.data.Reader: the rows it reads
