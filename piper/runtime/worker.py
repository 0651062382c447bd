"""The Ray actor that owns one device: it joins torch.distributed and runs an
`Executor` over its plan each step."""
from __future__ import annotations

import os
import socket

import torch

from . import checkpoint, comm
from .executor import Executor


class Worker:
    def __init__(self, rank: int, world_size: int, device: str):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.executor = None
        if device == "cpu":
            # Ray gives actors one thread; keep torch in line so replicas don't oversubscribe.
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    def rendezvous_address(self) -> str:
        """Rank 0 opens the store the others meet at, on a port the OS picks.

        Asking for port 0 and handing the bound store on leaves no window in
        which another process could take a port we only looked up.
        """
        import datetime

        import torch.distributed as dist

        host = socket.gethostbyname(socket.gethostname()) if self.device != "cpu" else "127.0.0.1"
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
        comm.init(self.rank, self.world_size, store, comm.backend_for(self.device), timeout_s)
        return os.getpid()

    def setup(self, spec, init) -> None:
        device = "cuda:0" if self.device == "cuda" else "cpu"
        self.executor = Executor(spec, init, device)

    def step(self, batch):
        return self.executor.run_step(batch)

    def shards(self):
        return self.executor.shards()

    def memory(self):
        return self.executor.memory()

    # -- checkpoints (piper/runtime/checkpoint.py) --
    def save_checkpoint(self, path: str, extra: dict, aliases: dict) -> int:
        return checkpoint.save(self.executor, path, extra, aliases)

    def optimizer_layout(self, with_state: bool):
        return checkpoint.optimizer_layout(self.executor, with_state)

    def load_checkpoint(self, path: str, with_state: bool, buffers) -> None:
        checkpoint.load(self.executor, path, with_state, buffers)

    def timings(self, cpu: bool = False):
        return dict(self.executor.cpu_timings if cpu else self.executor.timings)

    def trace(self):
        """The last steps' action spans (`Executor.traced`) and this process's clocks, to line them up."""
        import time

        steps = [(t0, list(spans), dict(done), main) for t0, spans, done, main in self.executor.traced]
        return {"clock": (time.perf_counter(), time.time()), "steps": steps}

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
