"""What the driver asks of a worker whose job is set up: shards, memory, timings, traces, and
checkpoints (`runtime/checkpoint.py`, imported on use, since torch.distributed.checkpoint costs a
worker about a second of CPU at start-up)."""
from __future__ import annotations


class WorkerQueries:
    """Mixed into `Worker`; each call reads the job's `Executor`."""

    def shards(self):
        return self.executor.shards()

    def memory(self):
        return self.executor.memory()

    def save_checkpoint(self, path: str, extra: dict, aliases: dict, skip=()) -> int:
        from . import checkpoint
        if self.executor.fault is not None:      # a test's fault at a save (`faults.py`, action=SAVE)
            self.executor.fault("SAVE")
        return checkpoint.save(self.executor, path, extra, aliases, skip)

    def optimizer_layout(self, with_state: bool):
        from . import checkpoint
        return checkpoint.optimizer_layout(self.executor, with_state)

    def load_checkpoint(self, path: str, with_state: bool, buffers) -> None:
        from . import checkpoint
        checkpoint.load(self.executor, path, with_state, buffers)

    def timings(self, cpu: bool = False):
        return dict(self.executor.cpu_timings if cpu else self.executor.timings)

    def trace(self):
        """The last steps' action spans (`Executor.traced`) and this process's clocks, to line them up."""
        import time

        steps = [(t0, list(spans), dict(done), main) for t0, spans, done, main in self.executor.traced]
        return {"clock": (time.perf_counter(), time.time()), "steps": steps}
