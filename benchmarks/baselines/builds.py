"""What a baseline process builds (`TorchWorker.setup`): the model a benchmark names, then one
baseline of it — a torch.distributed.pipelining schedule, DDP, FSDP2, FSDP2 under a pipeline, or
eager on one process — each written as its tutorial shows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .tensor_parallel import tensor_parallel, tp_fsdp2_pipeline

# Schedules whose ranks hold several stages, and how stages map to ranks.
MULTI_STAGE = {"ScheduleInterleaved1F1B": "loop", "ScheduleLoopedBFS": "loop",
               "ScheduleInterleavedZeroBubble": "loop", "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}


def stages_of(schedule: str, rank: int, world: int) -> list[int]:
    """The stage indices rank `rank` holds: [r] for single-stage schedules, [r, r+p] looped, [r, 2p-1-r] V-shaped."""
    style = MULTI_STAGE.get(schedule)
    if style is None:
        return [rank]
    if style == "loop":
        return [rank, rank + world]
    return [rank, 2 * world - 1 - rank]


class WithLoss(torch.nn.Module):
    """`body` followed by `loss_fn(out, target)`: a model called as model(x, y) -> loss."""

    def __init__(self, body: torch.nn.Module, loss_fn):
        super().__init__()
        self.body, self.loss_fn = body, loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.body(x), y)


@dataclass
class Model:
    """The model a benchmark names, and how to cut it into stages."""

    name: str                                   # "gpt", "chain", "hf" or "family:NAME"
    net: torch.nn.Module
    n_stages: int
    make_stage: Callable[[int], torch.nn.Module]
    loss_fn: Callable


@dataclass
class Built:
    """One baseline, ready to step."""

    model: torch.nn.Module
    params: list
    schedule: object = None                     # pipelines only
    stage_ids: list[int] | None = None
    first: bool = True
    last: bool = True
    context: Callable | None = None             # a context each step runs in (loss_parallel)


def make_model(model: str, model_kw: dict, *, kind: str, schedule: str | None, world: int) -> Model:
    """model: 'gpt' (examples.gpt, `model_kw` for make_model), 'chain' (LinearChain, `model_kw` for
    make_chain), 'llama_tp' (examples/llama_tp.py in float32, `model_kw` its sizes and `stages`),
    'family:NAME' (benchmarks/harness/families.py, `model_kw` = {"cfg": ..., "regions": R}) or
    'hf' (fsdp2 kinds only: `benchmarks.harness.workloads.make_hf`, `model_kw` = HFWorkload's fields and
    "stages"; its forward returns the loss)."""
    from ..harness.workloads import ChainStage, GPTStage, chain_loss, gpt_loss, make_chain, make_gpt

    if model == "chain":
        net = make_chain(**model_kw)
        n_stages = world * (2 if schedule in MULTI_STAGE else 1)
        return Model(model, net, n_stages, lambda s: ChainStage(net, s, n_stages), chain_loss)
    if model.startswith("family:"):
        from ..harness.families import FAMILIES

        family = FAMILIES[model.removeprefix("family:")]
        net = family.make(model_kw["cfg"], regions=model_kw["regions"])
        return Model(model, net, model_kw["regions"], lambda s: family.stage(net, s), family.loss)
    if model == "llama_tp":
        from examples.llama_tp import make_model as make_llama

        from .tensor_parallel import LlamaTPStage, llama_loss

        net = make_llama(torch.float32, **model_kw)
        return Model(model, net, net.stages, lambda s: LlamaTPStage(net, s, net.stages), llama_loss)
    if model == "hf":
        if kind not in ("fsdp2", "fsdp2_pipeline"):
            raise ValueError("the Hugging Face baseline runs under fsdp2 and fsdp2_pipeline only")
        from ..harness.llama_stage import LlamaStage
        from ..harness.workloads import HFWorkload, make_hf

        kw = dict(model_kw)
        stages = kw.pop("stages", 1)
        net = make_hf(HFWorkload(**kw), stages)[0]
        return Model(model, net, stages, lambda s: LlamaStage(net, s, stages), gpt_loss)
    net, cfg = make_gpt(model_kw)
    return Model(model, net, cfg.n_regions, lambda s: GPTStage(net, s), gpt_loss)


def pipeline(worker, m: Model, *, schedule: str, microbatches: int, **_) -> Built:
    from torch.distributed.pipelining import PipelineStage, schedules

    stage_ids = stages_of(schedule, worker.rank, worker.world)
    modules = [m.make_stage(s) for s in stage_ids]
    if worker.tracker is not None:
        for module in modules:
            worker.tracker.wrap_module(module)
    stages = [PipelineStage(module, s, m.n_stages, worker.device) for module, s in zip(modules, stage_ids)]
    run = getattr(schedules, schedule)(stages if schedule in MULTI_STAGE else stages[0], microbatches,
                                       loss_fn=m.loss_fn)
    return Built(torch.nn.ModuleList(modules), [p for module in modules for p in module.parameters()], run,
                 stage_ids, 0 in stage_ids, m.n_stages - 1 in stage_ids)


def fsdp2_pipeline(worker, m: Model, *, schedule: str, microbatches: int, precision: str, checkpoint: bool,
                   pp: int, **_) -> Built:
    """`pp` stages, each an FSDP2 module over its data-parallel group of world/pp ranks
    (benchmarks/baselines/composed.py)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    from .composed import groups, shard_stage

    dp_group, pp_group, _, stage = groups(worker.rank, worker.world, pp)
    module = m.make_stage(stage)
    blocks = module.layers if m.name == "hf" else module.blocks
    module = shard_stage(module, blocks, dp_group, worker.device, precision=precision, checkpoint=checkpoint)
    m.net = None                 # the other stages' modules go with it
    if worker.tracker is not None:
        worker.tracker.wrap_module(module)
    run = getattr(schedules, schedule)(PipelineStage(module, stage, pp, worker.device, group=pp_group),
                                       microbatches, loss_fn=m.loss_fn)
    return Built(module, list(module.parameters()), run, [stage], stage == 0, stage == pp - 1)


def eager(worker, m: Model, **_) -> Built:
    if worker.world != 1:
        raise ValueError("the eager baseline runs on one process")
    # The chain as one stage plus its loss: plain PyTorch, without piper.annotate scopes
    # (on one process n_stages is 1, so stage 0 is every layer).
    model = WithLoss(m.make_stage(0), m.loss_fn) if m.name == "chain" else m.net
    return Built(model, list(model.parameters()))


def ddp(worker, m: Model, **_) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    on_gpu = worker.device.type == "cuda"
    model = DistributedDataParallel(m.net, device_ids=[worker.device.index] if on_gpu else None)
    return Built(model, list(model.parameters()))


def fsdp2(worker, m: Model, *, precision: str, checkpoint: bool, **_) -> Built:
    """`precision="bf16"` is `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`;
    `checkpoint=True` wraps every block in torch.utils.checkpoint (non-reentrant)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..harness.workloads import region_modules

    net = m.net
    blocks = net.m.model.layers if m.name == "hf" else net.blocks
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    low = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    # One FSDP unit per Piper region (the same flat units ZeRO-3 gathers), then the root:
    # the GPT's regions, or the Hugging Face model's blocks (its `L` regions).
    units = [blocks[i] for i in range(len(blocks))] if m.name == "hf" else [
        region_modules(net, region) for region in range(m.n_stages)]
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    model = fully_shard(net, mp_policy=policy)
    return Built(model, list(model.parameters()))


BUILDS = {"pipeline": pipeline, "fsdp2_pipeline": fsdp2_pipeline, "eager": eager, "ddp": ddp, "fsdp2": fsdp2,
          "tp": tensor_parallel, "tp_fsdp2_pipeline": tp_fsdp2_pipeline}
