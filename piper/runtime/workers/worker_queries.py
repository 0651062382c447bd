"""What the driver asks of a worker whose job is set up: shards, memory, timings, traces, and
checkpoints (`runtime/state/checkpoint.py`, imported on use, since torch.distributed.checkpoint costs a
worker about a second of CPU at start-up)."""
from __future__ import annotations


class WorkerQueries:
    """Mixed into `Worker`; each call reads the job's `Executor`."""

    def shards(self):
        return self.executor.shards()

    def memory(self):
        return self.executor.memory()

    def save_checkpoint(self, path: str, extra: dict, aliases: dict, skip=(), checksums: bool = True) -> dict:
        """`checkpoint.save`'s result, or {"error": why} when writing failed (a full disk): DCP
        hands one rank's failure to every rank, so all return and the job goes on."""
        from ..state import checkpoint
        try:
            return checkpoint.save(self.executor, path, extra, aliases, skip, checksums)
        except BaseException as exc:
            return _failed(exc)

    def optimizer_layout(self, with_state: bool):
        from ..state import checkpoint
        return checkpoint.optimizer_layout(self.executor, with_state)

    def load_checkpoint(self, path: str, with_state: bool, buffers) -> dict | None:
        """None once read, or {"error": why, "unsafe": whether a file named code} (see `save_checkpoint`)."""
        from ..state import checkpoint
        try:
            checkpoint.load(self.executor, path, with_state, buffers)
        except BaseException as exc:
            return _failed(exc)
        return None

    def timings(self, cpu: bool = False):
        return dict(self.executor.cpu_timings if cpu else self.executor.timings)

    def trace(self):
        """The last steps' action spans (`Executor.traced`) and this process's clocks, to line them up."""
        import time

        steps = [(t0, list(spans), dict(done), main) for t0, spans, done, main in self.executor.traced]
        return {"clock": (time.perf_counter(), time.time()), "steps": steps}


def _failed(exc: BaseException) -> dict:
    """{"error": a line per failing rank, "unsafe": whether a file named code} for an exception
    out of DCP (its CheckpointException gathers every rank's); other BaseExceptions (an
    interrupt) are raised again."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ..state.checkpoint_files import UnsafeFile

    if not isinstance(exc, (Exception, CheckpointException)):
        raise exc
    failures = exc.failures if isinstance(exc, CheckpointException) else {None: (exc, None)}
    lines, unsafe = [], False
    for rank, (cause, _) in sorted(failures.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        unsafe = unsafe or isinstance(cause, UnsafeFile)
        text = str(cause).splitlines()[0] if str(cause) else ""
        lines.append(("" if rank is None else f"rank {rank}: ") + f"{type(cause).__name__}: {text}")
    return {"error": "; ".join(lines), "unsafe": unsafe}
