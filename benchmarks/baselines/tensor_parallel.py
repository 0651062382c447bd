"""torch's own tensor parallelism on examples/llama_tp.py's model (suite 16, `tensor-parallel`):
`parallelize_module` with ColwiseParallel/RowwiseParallel (and SequenceParallel), the loss under
`loss_parallel`, and the composition in torchtitan's order (TP, then FSDP2 per block, then
torch.distributed.pipelining with 1F1B).

The plans are torchtitan's Llama plan (before its 2026 refactor) on this model's module names:

    embed                  RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) | Replicate())
    blocks.*.attn_norm     SequenceParallel()                            (SP only; mlp_norm, norm too)
    blocks.*.attn / .mlp   PrepareModuleInput(Shard(1) -> Replicate())   (SP only: one all-gather each)
    q k v gate up          ColwiseParallel()
    o down                 RowwiseParallel(output_layouts=Shard(1) | Replicate())
    head                   ColwiseParallel(input_layouts=Shard(1) | Replicate(), output_layouts=Shard(-1),
                                           use_local_output=False)   -> cross_entropy under loss_parallel()

Ranks of the composition are laid out as torchtitan's mesh ("pp", "dp", "tp"): tp innermost,
`rank = stage * dp * tp + dp_index * tp + tp_index`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LlamaTPStage(nn.Module):
    """Stage `stage` of `stages` of a LlamaTP: its consecutive blocks, with the embedding on the
    first stage and the final norm and output layer on the last (the modules are shared)."""

    def __init__(self, net, stage: int, stages: int):
        super().__init__()
        per = len(net.blocks) // stages
        self.embed = net.embed if stage == 0 else None
        self.blocks = nn.ModuleList(net.blocks[stage * per:(stage + 1) * per])
        self.norm = net.norm if stage == stages - 1 else None
        self.head = net.head if stage == stages - 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))


def llama_loss(logits, targets):
    """The model's own loss (LlamaTP.forward's last line), on a stage's logits."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def plan(module: nn.Module, *, sequence: bool) -> dict:
    """torchtitan's plan for the LlamaTP (or stage) `module`: module path -> ParallelStyle."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    between = Shard(1) if sequence else Replicate()       # the residual stream between TP regions
    out: dict = {}
    if getattr(module, "embed", None) is not None:
        out["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    for i in range(len(module.blocks)):
        b = f"blocks.{i}"
        if sequence:
            out[f"{b}.attn_norm"] = SequenceParallel()
            out[f"{b}.mlp_norm"] = SequenceParallel()
            out[f"{b}.attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            out[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            out[f"{b}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.down"):
            out[f"{b}.{name}"] = RowwiseParallel(output_layouts=between)
    if getattr(module, "head", None) is not None:
        if sequence:
            out["norm"] = SequenceParallel()
        out["head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    return out


def loss_parallel_context():
    """A fresh `loss_parallel()` (cross_entropy on vocabulary shards), for each step."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def tensor_parallel(worker, m, *, sequence: bool = False, **_):
    """TP over every process (the whole batch on each): `parallelize_module` with `plan`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from .builds import Built

    mesh = init_device_mesh(worker.device.type, (worker.world,), mesh_dim_names=("tp",))
    model = parallelize_module(m.net, mesh, plan(m.net, sequence=sequence))
    return Built(model, list(model.parameters()), context=loss_parallel_context)


def tp_fsdp2_pipeline(worker, m, *, schedule: str, microbatches: int, pp: int, tp: int, sequence: bool = True,
                      **_):
    """torchtitan's order on a (pp, dp, tp) mesh: this rank's stage module parallelized over tp,
    then `fully_shard` per block and on the stage over dp (reshard_after_forward=False, torchtitan's
    default under pipelining), then a PipelineStage over pp under `schedule`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.tensor.parallel import parallelize_module

    from .builds import Built

    dp = worker.world // (pp * tp)
    mesh = init_device_mesh(worker.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    stage = worker.rank // (dp * tp)
    module = m.make_stage(stage)
    m.net = None
    module = parallelize_module(module, mesh["tp"], plan(module, sequence=sequence))
    for block in module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    module = fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    run = getattr(schedules, schedule)(PipelineStage(module, stage, pp, worker.device, group=mesh["pp"].get_group()),
                                       microbatches, loss_fn=m.loss_fn)
    return Built(module, list(module.parameters()), run, [stage], stage == 0, stage == pp - 1,
                 context=loss_parallel_context)
