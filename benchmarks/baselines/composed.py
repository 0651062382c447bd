"""The FSDP2 x torch.distributed.pipelining baseline: dp x pp processes, each
pipeline stage an FSDP2 module sharded over its data-parallel group, run by a
pipelining schedule (suite 14, `training-features`).

The parts are applied in the order torchtitan applies them, each for a reason:

1. activation checkpointing (`checkpoint_wrapper` per block) first, so the
   wrapper sits inside the FSDP unit and recomputation re-runs the block on
   the parameters FSDP has gathered;
2. `fully_shard` per block, then on the stage's root module (whatever is left:
   embeddings, final norm, head), over the data-parallel group, with
   `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)` for bf16;
   `reshard_after_forward=False`, torchtitan's default under pipelining, so a
   stage does not gather its parameters again for every microbatch;
3. `PipelineStage` over the pipeline group, and the schedule with the loss.
   The stage knows FSDP: it syncs gradients on the last microbatch only and
   reshards at the end of the step.

Ranks are laid out `rank = dp_index * pp + stage`, so each pipeline is `pp`
consecutive ranks and each stage's data-parallel group strides by `pp`.
"""
from __future__ import annotations

import torch


def groups(rank: int, world: int, pp: int):
    """(dp group, pp group, dp index, stage) for `rank`; every rank makes every group, in one order."""
    import torch.distributed as dist

    if world % pp:
        raise ValueError(f"{world} processes do not split into pipelines of {pp}")
    dp = world // pp
    dp_groups = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
    pp_groups = [dist.new_group([d * pp + s for s in range(pp)]) for d in range(dp)]
    return dp_groups[rank % pp], pp_groups[rank // pp], rank // pp, rank % pp


def shard_stage(stage_module: torch.nn.Module, blocks, dp_group, device, *, precision: str,
                checkpoint: bool) -> torch.nn.Module:
    """Steps 1 and 2 on one stage's module (its `blocks`: a ModuleList it holds, changed in place)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    low = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    mesh = DeviceMesh.from_group(dp_group, device.type)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return fully_shard(stage_module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
