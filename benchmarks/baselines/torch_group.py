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

import contextlib
import os
import socket
import time
from datetime import timedelta

import torch

from ..harness import probes
from .builds import BUILDS, make_model, stages_of

PIPELINED = ("pipeline", "fsdp2_pipeline", "tp_fsdp2_pipeline")

class _GroupMember:
    """Joins one torch.distributed process group (Gloo on CPU, NCCL on CUDA) over TCP."""

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


class TorchWorker(_GroupMember):
    """One baseline process: joins a process group once, then hosts one baseline at a time."""

    def __init__(self, rank: int, world: int, device: str = "cpu"):
        self.rank, self.world = rank, world
        # Ray shows a GPU actor exactly its own GPU, as device 0.
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.kind = None
        self.tracker = None

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, kind: str, *, model_kw: dict, model: str = "gpt", microbatches: int = 1,
              schedule: str | None = None, lr: float = 1e-3, track_activations: bool = False,
              precision: str = "fp32", checkpoint: bool = False, pp: int = 1, tp: int = 1,
              sequence: bool = False) -> dict:
        """Build a baseline and return what this rank holds.

        kind: 'pipeline' (a torch.distributed.pipelining schedule), 'ddp', 'fsdp2',
        'fsdp2_pipeline' (`pp` FSDP2 stages under `schedule`), 'tp' (parallelize_module over every
        process; `sequence`: with SequenceParallel), 'tp_fsdp2_pipeline' (TP over `tp`, FSDP2, then `pp`
        stages) or 'eager' (one process, a plain loop over microbatches); model: see `builds.make_model`.
        """
        import torch.distributed as dist

        build = BUILDS.get(kind)
        if build is None:
            raise ValueError(f"unknown baseline {kind!r}")
        self.teardown()
        self.kind, self.microbatches = kind, microbatches
        m = make_model(model, model_kw, kind=kind, schedule=schedule, world=self.world)
        m.net.to(self.device)        # stages share the model's modules, so they move with it
        self.tracker = probes.SavedActivations() if track_activations else None
        built = build(self, m, schedule=schedule, microbatches=microbatches, precision=precision,
                      checkpoint=checkpoint, pp=pp, tp=tp, sequence=sequence)
        self.model, self.stage_ids, self.first, self.last = built.model, built.stage_ids, built.first, built.last
        self.context = built.context or contextlib.nullcontext
        if built.schedule is not None:
            self.schedule = built.schedule
        if self.tracker is not None and kind not in PIPELINED:
            self.tracker.wrap_module(self.model)
        self.optimizer = torch.optim.AdamW(built.params, lr=lr)
        dist.barrier()
        return {"pid": os.getpid(), "stages": self.stage_ids}

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
        with self.context():
            loss = self._forward_backward(x, y)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss, time.perf_counter() - t0

    def _forward_backward(self, x, y):
        loss = None
        if self.kind in PIPELINED:
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
        return loss

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
        self.kind, self.schedule, self.pp, self.tp = kind, kw.get("schedule"), kw.get("pp", 1), kw.get("tp", 1)
        self.info = self._get([a.setup.remote(kind, **kw) for a in self.actors])

    def inputs_for(self, rank: int, x, y):
        """What rank `rank` needs of the global batch: first/last pipeline stage, or its data-parallel shard."""
        if self.kind in ("eager", "tp"):
            return x, y
        if self.kind == "tp_fsdp2_pipeline":       # rank = stage * dp * tp + dp index * tp + tp index
            pp, tp = self.pp, self.tp
            dp = self.world // (pp * tp)
            per = x.shape[0] // dp
            stage, d = rank // (dp * tp), rank % (dp * tp) // tp
            shard = slice(d * per, (d + 1) * per)
            return (x[shard].clone() if stage == 0 else None), (y[shard].clone() if stage == pp - 1 else None)
        if self.kind == "fsdp2_pipeline":          # rank = dp index * pp + stage (benchmarks/baselines/composed.py)
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

    from ..harness.results import short_error

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
