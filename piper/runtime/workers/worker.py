"""The Ray actor that owns one device: it joins torch.distributed and runs an
`Executor` over its plan each step."""
from __future__ import annotations

import os
import socket

import ray
import torch

from ... import tensor_ops
from ..communication import collectives
from ..health import faults
from ..execution.executor import Executor
from .train_loop import TrainLoop
from .worker_queries import WorkerQueries


class Worker(WorkerQueries, TrainLoop):
    """One device's process: joins torch.distributed, runs its plan each step, and is kept or
    reset between jobs (`pool.py`). What the driver asks of a set-up worker is in `WorkerQueries`."""

    def __init__(self, rank: int, world_size: int, device: str):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.executor = None
        self.steps_done = 0
        if device == "cpu":
            # Ray gives actors one thread; keep torch in line so replicas don't oversubscribe.
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            if "GLOO_SOCKET_IFNAME" not in os.environ:
                # Gloo would bind to what the host name resolves to, often 127.0.0.1: peers on other
                # nodes could not connect. Use the interface of this node's Ray address.
                from ..launch.placement import interface_of

                interface = interface_of(ray.util.get_node_ip_address())
                if interface:
                    os.environ["GLOO_SOCKET_IFNAME"] = interface

    def rendezvous_address(self) -> str:
        """Rank 0 opens the store the others meet at, on a port the OS picks.

        Asking for port 0 and handing the bound store on leaves no window in
        which another process could take a port we only looked up.
        """
        import datetime

        import torch.distributed as dist

        # This node's address as Ray knows it, so peers on other nodes can reach the store.
        host = ray.util.get_node_ip_address() or socket.gethostbyname(socket.gethostname())
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=300))
        return f"{host}:{self._store.port}"

    def init(self, address: str, timeout_s: float) -> int:
        import datetime

        import torch.distributed as dist

        if self.device == "cuda":
            torch.cuda.set_device(0)   # Ray exposes exactly this actor's GPU as device 0
        store = getattr(self, "_store", None)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), self.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        collectives.init(self.rank, self.world_size, store, collectives.backend_for(self.device), timeout_s)
        return os.getpid()

    def setup(self, spec, init, fault: str | None = None) -> None:
        """Build this job's executor; `fault`, a test's `PIPER_FAULT` value (`health/faults.py`)."""
        device = "cuda:0" if self.device == "cuda" else "cpu"
        self.executor = Executor(spec, init, device)
        self.executor.fault = faults.trigger(fault, self.rank, lambda: self.steps_done)

    def step(self, batch, lr_scale: float | None = None):
        """One step of the plan on this device's part of `batch`; `lr_scale`, the learning-rate
        schedule's multiplier of every group's base rate for this step (None: the base rates)."""
        if lr_scale is not None:
            self.executor.set_lr_scale(lr_scale)
        with tensor_ops.deferred_vocab_checks() as vocab:      # ids outside a `shard vocab` vocabulary
            losses = self.executor.run_step(batch)
        self.steps_done += 1
        vocab.check()              # after the losses are read: no wait of its own on the device
        skipped = self.executor.skipped_updates()
        # Rare: said beside the losses only when a non-finite gradient skipped an update here.
        return {"losses": losses, "nonfinite": skipped} if skipped else losses

    def step_data(self, source: str, k: int, lr_scale: float | None = None):
        """`step` on this device's part of global batch `k` of a dataset, read here (`piper.data`)."""
        return self.step(self.executor.spec.readers[source].batch(k), lr_scale)

    def evaluate_data(self, source: str, k: int):
        """`evaluate` on this device's part of global batch `k` of a dataset, read here."""
        return self.evaluate(self.executor.spec.readers[source].batch(k))

    def evaluate(self, batch):
        """The losses of this device's forward-only plan on its part of `batch` (no update)."""
        with tensor_ops.deferred_vocab_checks() as vocab:
            losses = self.executor.run_eval(batch)
        vocab.check()
        return losses

    def where(self) -> dict:
        """Where this worker runs: pid, Ray node id and address, device (`cuda:N` is the physical GPU)."""
        ctx = ray.get_runtime_context()
        gpus = ray.get_gpu_ids() if self.device == "cuda" else []
        return {"pid": os.getpid(), "node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "device": f"cuda:{gpus[0]}" if gpus else self.device,
                "interface": os.environ.get("GLOO_SOCKET_IFNAME") if self.device == "cpu" else None}

    @ray.method(concurrency_group="health")
    def status(self) -> tuple[int, str | None]:
        """(steps finished, the action running now or None). Answered even while a step runs
        (its own concurrency group), so the driver can tell a busy worker from a stalled one."""
        executor = self.executor
        return self.steps_done, (executor.current if executor is not None else None)

    def reset(self) -> None:
        """Forget the job (plan, process groups, store) so the next job of the same shape can
        use this process (`pool.py`); rank and world stay, as the pool keeps bundles."""
        import gc

        import torch.distributed as dist

        from ... import expert_context, tensor_context

        self.executor = None
        self.steps_done = 0
        self._store = None
        expert_context.forget()
        tensor_context.forget()
        if dist.is_initialized():
            dist.destroy_process_group()      # every group of the job, the lanes' and experts' too
        gc.collect()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
