"""The PyTorch baselines: torch.distributed (Gloo on CPU, NCCL on CUDA), one Ray
actor per process, the same process count, model code, microbatching and
optimizer (AdamW) as Piper.

    group = TorchGroup(world=2)                       # 2 actors, one Gloo process group
    group.setup("pipeline", schedule="Schedule1F1B", model_kw=..., microbatches=8)
    loss = group.step(x, y)                           # one optimizer step on the global batch
    group.close()

Each baseline is a few lines of ordinary PyTorch, written as its tutorial
shows (PipelineStage + a schedule; DistributedDataParallel; FSDP2
`fully_shard`). Like Piper's workers, each actor runs torch on one thread
(Ray sets OMP_NUM_THREADS=1 in actors). With device="cuda" each actor holds
one GPU, as Piper's workers do.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch

from . import probes

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


class TorchWorker:
    """One baseline process: joins a process group once, then hosts one baseline at a time."""

    def __init__(self, rank: int, world: int, device: str = "cpu"):
        self.rank, self.world = rank, world
        # Ray shows a GPU actor exactly its own GPU, as device 0.
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.kind = None
        self.tracker = None

    def rendezvous_address(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"

    def init(self, address: str, timeout_s: float) -> int:
        import torch.distributed as dist

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        return os.getpid()

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, kind: str, *, model_kw: dict, model: str = "gpt", microbatches: int = 1,
              schedule: str | None = None, lr: float = 1e-3, track_activations: bool = False,
              precision: str = "fp32", checkpoint: bool = False, pp: int = 1) -> dict:
        """Build a baseline and return what this rank holds.

        kind: 'pipeline' (a torch.distributed.pipelining schedule), 'ddp',
        'fsdp2', or 'eager' (one process, a plain loop over microbatches).
        model: 'gpt' (examples.gpt, `model_kw` for make_model), 'chain'
        (LinearChain, `model_kw` for make_chain) or 'family:NAME'
        (benchmarks/families.py, `model_kw` = {"cfg": ..., "regions": R}); 'hf' ('fsdp2*' only: the
        Hugging Face model of `benchmarks.workloads.make_hf`, `model_kw` = HFWorkload's fields
        and "stages"; its forward returns the loss). For 'fsdp2':
        `precision="bf16"` is `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`,
        and `checkpoint=True` wraps every block in torch.utils.checkpoint (non-reentrant).
        'fsdp2_pipeline' (model 'gpt' or 'hf'): `pp` stages, each an FSDP2 module over its
        data-parallel group of world/pp ranks, run by `schedule` (benchmarks/composed.py);
        `precision` and `checkpoint` as for 'fsdp2'.
        """
        import torch.distributed as dist

        from .workloads import ChainStage, GPTStage, chain_loss, gpt_loss, make_chain, make_gpt, region_modules

        self.teardown()
        self.kind, self.microbatches = kind, microbatches
        if model == "chain":
            net = make_chain(**model_kw)
            n_stages = self.world * (2 if schedule in MULTI_STAGE else 1)
            make_stage, loss_fn = (lambda s: ChainStage(net, s, n_stages)), chain_loss
        elif model.startswith("family:"):       # benchmarks/families.py; model_kw: {"cfg": ..., "regions": R}
            from .families import FAMILIES

            family = FAMILIES[model.removeprefix("family:")]
            net = family.make(model_kw["cfg"], regions=model_kw["regions"])
            n_stages = model_kw["regions"]
            make_stage, loss_fn = (lambda s: family.stage(net, s)), family.loss
        elif model == "hf":
            from .workloads import HFWorkload, make_hf

            if kind not in ("fsdp2", "fsdp2_pipeline"):
                raise ValueError("the Hugging Face baseline runs under fsdp2 and fsdp2_pipeline only")
            from .composed import LlamaStage

            kw = dict(model_kw)
            stages = n_stages = kw.pop("stages", 1)
            net = make_hf(HFWorkload(**kw), stages)[0]
            make_stage, loss_fn = (lambda s: LlamaStage(net, s, stages)), gpt_loss
        else:
            net, cfg = make_gpt(model_kw)
            n_stages = cfg.n_regions
            make_stage, loss_fn = (lambda s: GPTStage(net, s)), gpt_loss
        net.to(self.device)        # stages share the model's modules, so they move with it
        self.tracker = probes.SavedActivations() if track_activations else None
        if kind == "pipeline":
            from torch.distributed.pipelining import PipelineStage, schedules

            self.stage_ids = stages_of(schedule, self.rank, self.world)
            modules = [make_stage(s) for s in self.stage_ids]
            if self.tracker is not None:
                for m in modules:
                    self.tracker.wrap_module(m)
            stages = [PipelineStage(m, s, n_stages, self.device) for m, s in zip(modules, self.stage_ids)]
            cls = getattr(schedules, schedule)
            self.schedule = cls(stages if schedule in MULTI_STAGE else stages[0], microbatches, loss_fn=loss_fn)
            self.first = 0 in self.stage_ids
            self.last = n_stages - 1 in self.stage_ids
            params = [p for m in modules for p in m.parameters()]
            self.model = torch.nn.ModuleList(modules)
        elif kind == "fsdp2_pipeline":
            from torch.distributed.pipelining import PipelineStage, schedules

            from .composed import groups, shard_stage

            dp_group, pp_group, _, stage = groups(self.rank, self.world, pp)
            module = make_stage(stage)
            blocks = module.layers if model == "hf" else module.blocks
            module = shard_stage(module, blocks, dp_group, self.device, precision=precision, checkpoint=checkpoint)
            del net                 # the other stages' modules go with it
            if self.tracker is not None:
                self.tracker.wrap_module(module)
            self.stage_ids, self.first, self.last = [stage], stage == 0, stage == pp - 1
            self.schedule = getattr(schedules, schedule)(
                PipelineStage(module, stage, pp, self.device, group=pp_group), microbatches, loss_fn=loss_fn)
            self.model = module
            params = list(module.parameters())
        elif kind == "eager":
            if self.world != 1:
                raise ValueError("the eager baseline runs on one process")
            # The chain as one stage plus its loss: plain PyTorch, without piper.annotate scopes
            # (on one process n_stages is 1, so stage 0 is every layer).
            self.model = WithLoss(make_stage(0), loss_fn) if model == "chain" else net
            params = list(self.model.parameters())
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            on_gpu = self.device.type == "cuda"
            self.model = DistributedDataParallel(net, device_ids=[self.device.index] if on_gpu else None)
            params = list(self.model.parameters())
        elif kind == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            blocks = net.m.model.layers if model == "hf" else net.blocks
            if checkpoint:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

                for i, block in enumerate(blocks):
                    blocks[i] = checkpoint_wrapper(block)
            low = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
            policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
            # One FSDP unit per Piper region (the same flat units ZeRO-3 gathers), then the root:
            # the GPT's regions, or the Hugging Face model's blocks (its `L` regions).
            units = [blocks[i] for i in range(len(blocks))] if model == "hf" else [
                region_modules(net, region) for region in range(cfg.n_regions)]
            for unit in units:
                fully_shard(unit, mp_policy=policy)
            self.model = fully_shard(net, mp_policy=policy)
            params = list(self.model.parameters())
        else:
            raise ValueError(f"unknown baseline {kind!r}")
        if self.tracker is not None and kind not in ("pipeline", "fsdp2_pipeline"):
            self.tracker.wrap_module(self.model)
        self.optimizer = torch.optim.AdamW(params, lr=lr)
        dist.barrier()
        return {"pid": os.getpid(), "stages": getattr(self, "stage_ids", None)}

    def teardown(self) -> None:
        for name in ("schedule", "model", "optimizer"):
            if hasattr(self, name):
                delattr(self, name)
        self.kind = None

    # -- one step -------------------------------------------------------------------------------
    def step(self, x, y):
        """One optimizer step; x/y are this rank's inputs (None where it needs none). Returns (loss|None, seconds)."""
        probe = getattr(self, "step_probe", None)        # probes.install_step_peak_torch
        return probe(x, y) if probe is not None else self._step(x, y)

    def _step(self, x, y):
        if self.tracker is not None:
            self.tracker.reset()
        x, y = (None if t is None else t.to(self.device) for t in (x, y))
        t0 = time.perf_counter()
        loss = None
        if self.kind in ("pipeline", "fsdp2_pipeline"):
            losses: list[torch.Tensor] = []
            args = (x,) if self.first else ()
            kwargs = {"target": y, "losses": losses} if self.last else {}
            self.schedule.step(*args, **kwargs)
            if self.last:
                loss = float(torch.stack(losses).mean())
        elif self.kind == "eager":
            # Gradient accumulation over the microbatches, as a single device runs a pipeline's work.
            total = 0.0
            for xm, ym in zip(x.chunk(self.microbatches), y.chunk(self.microbatches)):
                out = self.model(xm, ym)
                (out / self.microbatches).backward()
                total += float(out.detach())
            loss = total / self.microbatches
        else:
            # DDP / FSDP2: the whole local shard is one microbatch (as Piper's dp with no `split`).
            out = self.model(x, y)
            out.backward()
            loss = float(out.detach())
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss, time.perf_counter() - t0

    def peak_activations(self) -> int | None:
        return None if self.tracker is None else self.tracker.peak

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()


class TorchGroup:
    """`world` TorchWorker actors sharing one process group (Gloo; NCCL with device="cuda")."""

    def __init__(self, world: int, *, timeout: float = 300.0, device: str = "cpu"):
        import ray

        self.world, self.timeout = world, timeout
        actor = ray.remote(num_cpus=0, num_gpus=1 if device == "cuda" else 0)(TorchWorker)
        self.actors = [actor.remote(r, world, device) for r in range(world)]
        try:
            address = self._get([self.actors[0].rendezvous_address.remote()])[0]
            self.pids = self._get([a.init.remote(address, timeout) for a in self.actors])
        except BaseException:
            self.close()
            raise
        self.kind = None

    def _get(self, refs):
        import ray

        return ray.get(refs, timeout=self.timeout)

    def setup(self, kind: str, **kw) -> None:
        self.kind, self.schedule, self.pp = kind, kw.get("schedule"), kw.get("pp", 1)
        self.info = self._get([a.setup.remote(kind, **kw) for a in self.actors])

    def inputs_for(self, rank: int, x, y):
        """What rank `rank` needs of the global batch: first/last pipeline stage, or its data-parallel shard."""
        if self.kind == "eager":
            return x, y
        if self.kind == "fsdp2_pipeline":          # rank = dp index * pp + stage (benchmarks/composed.py)
            pp = self.pp
            per = x.shape[0] // (self.world // pp)
            d, stage = divmod(rank, pp)
            shard = slice(d * per, (d + 1) * per)
            return (x[shard].clone() if stage == 0 else None), (y[shard].clone() if stage == pp - 1 else None)
        if self.kind == "pipeline":
            stages = stages_of(self.schedule, rank, self.world)
            last = max(max(i["stages"]) for i in self.info)
            return (x if 0 in stages else None), (y if last in stages else None)
        per = x.shape[0] // self.world
        return x[rank * per:(rank + 1) * per].clone(), y[rank * per:(rank + 1) * per].clone()

    def step(self, x, y) -> float:
        refs = [a.step.remote(*self.inputs_for(r, x, y)) for r, a in enumerate(self.actors)]
        losses = [loss for loss, _ in self._get(refs) if loss is not None]
        return sum(losses) / len(losses)

    def peak_activations(self) -> list[int | None]:
        return self._get([a.peak_activations.remote() for a in self.actors])

    def close(self) -> None:
        import ray

        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except Exception:
            pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def set_up_group(ctx, group: TorchGroup | None, world: int, timeout: float, *args, **kwargs):
    """`group` (started on first use) set up for the next comparison: (group, None); or, if that
    fails, (None, the error for the table), the group closed so the next comparison starts afresh."""
    import traceback

    from .harness import short_error

    try:
        if group is None:
            group = TorchGroup(world, timeout=timeout, device=ctx.device)
        group.setup(*args, **kwargs)
        return group, None
    except Exception as exc:
        ctx.log(traceback.format_exc())
        if group is not None:
            group.close()
        return None, f"failed: {short_error(exc)}"
