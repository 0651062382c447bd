"""Measurement probes the harness installs inside worker processes.

Piper's runtime reports its own figures (`job.memory()` with
`activations_peak`, `job.timings()`), but the comparison with torch needs one
measuring method on both sides, so the harness installs the same probes into
each Piper worker through Ray's `actor.__ray_call__` (a function run inside
the actor with the actor as its first argument) and into the baselines:

- `time_compute`: wraps each region's forward graph, `torch.autograd.backward`
  / `torch.autograd.grad` and the optimizer step, and times `run_step`; what
  is not compute is runtime overhead (argument plumbing, issuing and waiting
  on communication, the plan loop).
- `SavedActivations`: a `torch.autograd.graph.saved_tensors_hooks` pair that
  counts the bytes of every storage autograd saves for backward (parameters
  excluded) while it is alive; the peak is the activation memory a schedule
  keeps. The packed handle's `__del__` fires when autograd frees the saved
  tensor, so the count follows the real lifetime.

The same `SavedActivations` probe wraps the torch baselines' stage modules.
"""
from __future__ import annotations

import time
from collections import Counter

import torch


class _Saved:
    """What the pack hook returns: the tensor plus a release on deletion."""

    __slots__ = ("tensor", "tracker", "ptr")

    def __init__(self, tensor, tracker, ptr):
        self.tensor, self.tracker, self.ptr = tensor, tracker, ptr

    def __del__(self):
        self.tracker._release(self.ptr)


class SavedActivations:
    """Live and peak bytes of storages autograd saved for backward (excluding parameters)."""

    def __init__(self):
        self.live: dict[int, list[int]] = {}      # storage pointer -> [bytes, handles]
        self.current = 0
        self.peak = 0
        self.params: set[int] = set()
        self.param_source = None                  # callable giving parameter tensors (refreshed per step)

    def reset(self) -> None:
        """Start a new step: the peak restarts from what is alive now."""
        self.peak = self.current
        if self.param_source is not None:
            self.params = {t.untyped_storage().data_ptr() for t in self.param_source()}

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter):
            return t
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in self.params:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [size, 1]
            self.current += size
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        # A detached alias: the tensor itself would tie a saved output to its own node, a cycle
        # through C++ that a split backward never frees (see piper/compiler/saved.py).
        return _Saved(t.detach(), self, ptr)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def wrap_module(self, module: torch.nn.Module) -> None:
        """Count what `module`'s forward saves (torch baselines)."""
        self.param_source = lambda: list(module.parameters())
        self.reset()
        forward = module.forward

        def tracked(*args, **kwargs):
            with self.hooks():
                return forward(*args, **kwargs)

        module.forward = tracked

    def wrap_callable(self, fn):
        def tracked(*args, **kwargs):
            with self.hooks():
                return fn(*args, **kwargs)

        return tracked


class ProbeState:
    """Per-worker counters, read back by `read_probes`."""

    def __init__(self):
        self.compute = 0.0
        self.run_step = 0.0
        self.ops: Counter = Counter()          # calls per kind (forward, backward, grad, optimizer)
        self.seconds: Counter = Counter()      # seconds per kind
        self.activations: SavedActivations | None = None


# -- functions run inside a Piper worker via actor.__ray_call__ ------------------------------------

def install_probes(worker, time_compute: bool = False, track_activations: bool = False) -> int:
    """Instrument `worker.executor` (a piper.runtime.execution.executor.Executor); returns the plan's length."""
    ex = worker.executor
    state = ProbeState()
    worker._bench_probes = state

    if track_activations:
        tracker = SavedActivations()
        tracker.param_source = lambda: [full for unit in ex.units.values() for full in unit.full]
        tracker.reset()
        for region in ex.spec.regions.values():
            region.graph = tracker.wrap_callable(region.graph)
        state.activations = tracker

    if time_compute:
        def timed(fn, what):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    dt = time.perf_counter() - t0
                    state.compute += dt
                    state.seconds[what] += dt
                    state.ops[what] += 1
            return wrapper

        for region in ex.spec.regions.values():
            region.graph = timed(region.graph, "forward")
        # The executor calls torch.autograd.backward / .grad for B, BI and BW: time those calls
        # (this worker process only), and the optimizer step of each unit.
        torch.autograd.backward = timed(torch.autograd.backward, "backward")
        torch.autograd.grad = timed(torch.autograd.grad, "grad")
        for unit in ex.units.values():
            unit.optimizer.step = timed(unit.optimizer.step, "optimizer")

    run_step = ex.run_step

    def probed_run_step(batch):
        state.compute = 0.0
        state.ops.clear()
        state.seconds.clear()
        if state.activations is not None:
            state.activations.reset()
        t0 = time.perf_counter()
        out = run_step(batch)
        state.run_step = time.perf_counter() - t0
        return out

    ex.run_step = probed_run_step
    return len(ex.spec.plan)


def read_probes(worker) -> dict:
    """The last step's numbers: seconds in run_step and in compute, op counts, peak saved activations."""
    state = worker._bench_probes
    return {"run_step": state.run_step, "compute": state.compute, "ops": dict(state.ops),
            "seconds": dict(state.seconds),
            "peak_activations": None if state.activations is None else state.activations.peak}


def resident_bytes(worker=None) -> int:
    """This process's resident memory after a full collection and handing freed heap back to the OS.

    glibc keeps freed blocks for reuse; `malloc_trim(0)` returns them, so what
    is left is what the process still holds.
    """
    import ctypes
    import gc
    import os

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:      # not glibc: the number keeps the allocator's cache
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes(worker=None) -> int:
    """Bytes of every CPU tensor storage still referenced in this process (each storage once)."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.device.type == "cpu" and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def noop(worker) -> None:
    """An empty call: the Ray round-trip floor."""
    return None


def in_workers(job, fn, *args, **kwargs) -> list:
    """`fn(worker, *args, **kwargs)` inside every worker of a Piper job (Ray's actor.__ray_call__), rank order."""
    import ray

    return ray.get([a.__ray_call__.remote(fn, *args, **kwargs) for a in job.actors], timeout=job.timeout)


def install(job, **kw) -> list[int]:
    """Install probes in every worker of a Piper job; returns each rank's plan length."""
    return in_workers(job, install_probes, **kw)


def read(job) -> list[dict]:
    return in_workers(job, read_probes)


# -- peak bytes in a step, the same probe on both sides (suite 14) ---------------------------------

def _high_water() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024


def _step_peak(step, held):
    """`step` wrapped so that each call records, in `.peak`, the bytes the process holds between
    steps (`held()`: parameters, gradients, optimizer state) plus how far its resident memory rose
    above its state before the step: everything the step allocates at its high-water mark (saved
    activations, gathered parameters, communication buffers, autograd's temporaries).

    The rise is the kernel's resident high-water mark (VmHWM, reset through
    /proc/self/clear_refs) less the resident set just before the step, after a full collection
    and glibc's `malloc_trim`, so memory the allocator kept from earlier steps is not reused
    unseen. Both systems run on one thread per process here, so nothing else allocates meanwhile.
    """
    import ctypes
    import gc

    def tracked(*args, **kwargs):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        before = resident_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                     # reset VmHWM to the current resident set
        out = step(*args, **kwargs)
        tracked.peak = held() + max(0, _high_water() - before)
        return out
    tracked.peak = None
    return tracked


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t          # an FSDP2 DTensor: this rank's shard
        storage = t.untyped_storage()
        if storage.size() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def piper_held(ex):
    """What a Piper worker's executor holds between steps: parameters, gradients, optimizer state."""
    return lambda: sum(ex.memory()[k] for k in ("params", "grads", "optimizer"))


def torch_held(worker):
    """What a torch baseline actor holds between steps: parameters, gradients, optimizer state."""
    def held():
        params = list(worker.model.parameters())
        state = [v for s in worker.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        return _bytes(params) + _bytes(p.grad for p in params) + _bytes(state)
    return held


def wrap_step(worker, probe) -> None:
    """Run the next step of a Piper worker or a torch baseline actor through `probe(step, held)`
    (`_step_peak`, `tp_probes._tensor_peak`), whose `.peak` `read_step_peak` reads."""
    if hasattr(worker, "executor"):
        ex = worker.executor
        if not hasattr(ex, "_untracked_run_step"):
            ex._untracked_run_step = ex.run_step
        ex.run_step = probe(ex._untracked_run_step, piper_held(ex))
    else:
        worker.step_probe = probe(worker._step, torch_held(worker))


def install_step_peak(worker) -> None:
    """Into a Piper worker (`__ray_call__`): its next `run_step` records `read_step_peak`."""
    wrap_step(worker, _step_peak)


def install_step_peak_torch(worker) -> None:
    """Into a torch baseline actor (`__ray_call__`): its next `step` records `read_step_peak`."""
    wrap_step(worker, _step_peak)


def read_step_peak(worker) -> int | None:
    """The peak bytes of the last step since `install_step_peak*`, which this removes."""
    if hasattr(worker, "executor"):
        step, worker.executor.run_step = worker.executor.run_step, worker.executor._untracked_run_step
    else:
        step, worker.step_probe = getattr(worker, "step_probe", None), None
    return getattr(step, "peak", None)
