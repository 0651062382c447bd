"""What a tensor-parallel step communicates, counted on both sides (suite 16, `tensor-parallel`), and
what Gloo's collectives cost at an activation's size.

- Piper: `install_tp_counter` wraps the worker's `TensorGroup` collectives (the ones the TP
  exchanges between a cut region's pieces and the tp-summed gradients issue) for its next step;
  `read_tp_counter` gives {kind: [calls, bytes, seconds]} and restores them.
- torch: `install_comm_counter_torch` runs the actor's next step under a dispatch mode that
  lets DTensor desugar each op into local ops (as CommDebugMode does) and records every
  c10d / functional collective (calls, bytes of its input, seconds until its wait returns)
  and how many ops reached DTensor's dispatch; `read_comm_counter_torch` gives them.
- `gloo_costs` (in every actor of a torch group, over its world group): the median seconds of an
  all-reduce, an all-reduce + chunk (Piper's reduce-scatter on Gloo), torch's
  `reduce_scatter_tensor`, an all-gather and a clone, at one shape.

Each is run through `__ray_call__`, in a step that is not timed.
"""
from __future__ import annotations

import statistics
import time

import torch

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


# -- Piper ----------------------------------------------------------------------------------------

class _Timed:
    """A collective's work handle that adds the seconds from its issue until its wait returns."""

    def __init__(self, work, entry, start):
        self.work, self.entry, self.start = work, entry, start

    def wait(self):
        out = self.work.wait()
        self.entry[2] += time.perf_counter() - self.start
        return out


def install_tp_counter(worker) -> None:
    """Into a Piper worker: count its tensor-parallel collectives until `read_tp_counter` (each
    issued by `TensorGroup.*_async`, from a TP exchange of a cut region, an in-graph TP op or the
    tp-summed gradients), with the seconds from each one's issue until its wait returned."""
    from piper.runtime.communication.tensor_groups import TensorGroup

    counts: dict[str, list] = {}
    originals = {name: getattr(TensorGroup, f"{name}_async") for name in KINDS}

    def counted(name, fn):
        def wrapper(self, x, *args, **kwargs):
            kind = f"{name} (max)" if kwargs.get("op", args[0] if args else "sum") == "max" else name
            entry = counts.setdefault(kind, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += x.numel() * x.element_size()
            out = fn(self, x, *args, **kwargs)
            if isinstance(out, tuple):
                return _Timed(out[0], entry, time.perf_counter()), out[1]
            return _Timed(out, entry, time.perf_counter())
        return wrapper

    for name, fn in originals.items():
        setattr(TensorGroup, f"{name}_async", counted(name, fn))
    worker._tp_counter = (counts, originals)


def read_tp_counter(worker) -> dict:
    from piper.runtime.communication.tensor_groups import TensorGroup

    counts, originals = worker._tp_counter
    for name, fn in originals.items():
        setattr(TensorGroup, f"{name}_async", fn)
    del worker._tp_counter
    return counts


# -- torch ----------------------------------------------------------------------------------------

def _collectives_mode():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        """Every collective a step issues (after DTensor desugars its ops), and DTensor's op count."""

        def __init__(self):
            super().__init__()
            self.counts: dict[str, list] = {}
            self.dtensor_ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(t is DTensor or issubclass(t, DTensor) for t in types):
                self.dtensor_ops += 1
                return NotImplemented          # let DTensor run; its local ops come back here
            name = getattr(func, "namespace", "")
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            op = func._overloadpacket.__name__
            if name in ("_c10d_functional", "c10d", "_c10d_functional_autograd") and not op.startswith("_"):
                kind = "wait" if "wait" in op else op.rstrip("_")
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is None:
                    first = next((t for a in args if isinstance(a, (list, tuple)) for t in a
                                  if isinstance(t, torch.Tensor)), None)
                entry = self.counts.setdefault(kind, [0, 0, 0.0])
                entry[0] += 1
                entry[1] += 0 if first is None or kind == "wait" else first.numel() * first.element_size()
                entry[2] += time.perf_counter() - t0
            return out

    return Collectives()


def install_comm_counter_torch(worker) -> None:
    """Into a torch baseline actor: its next `step` records what `read_comm_counter_torch` returns."""
    def counted(x, y):
        mode = _collectives_mode()
        with mode:
            out = worker._step(x, y)
        counted.found = {"collectives": mode.counts, "dtensor_ops": mode.dtensor_ops}
        return out
    counted.found = None
    worker.step_probe = counted


def read_comm_counter_torch(worker) -> dict | None:
    step, worker.step_probe = getattr(worker, "step_probe", None), None
    return getattr(step, "found", None)


# -- Gloo's costs at one shape ----------------------------------------------------------------------

def gloo_costs(worker, shape: tuple[int, ...], dim: int = 1, repeats: int = 30) -> dict[str, float]:
    """Median seconds of each way to reduce, scatter and gather a float32 tensor of `shape` over the
    actor's world group (every actor calls this at once)."""
    import torch.distributed as dist

    from piper.runtime.communication.tensor_groups import TensorGroup

    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(shape)
    out = torch.empty_like(x.chunk(world, dim)[0]).contiguous()
    piper_group = TensorGroup(None, tuple(range(world)), rank)        # Piper's own calls, on the world group

    def piper_reduce_scatter():
        work, result = piper_group.reduce_scatter_async(x, dim)
        work.wait()
        return result()

    def torch_reduce_scatter():
        # reduce_scatter_tensor splits dim 0: move `dim` to the front as DTensor's Shard(dim) does.
        dist.reduce_scatter_tensor(out.movedim(dim, 0).contiguous(), x.movedim(dim, 0).contiguous())

    def all_gather():
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out)
        return torch.cat(parts, dim)

    def piper_all_gather():
        work, result = piper_group.all_gather_async(out, dim)
        work.wait()
        return result()

    def all_reduce():
        dist.all_reduce(x.clone())

    ways = {"all_reduce": all_reduce, "all_reduce_chunk": piper_reduce_scatter,
            "reduce_scatter_tensor": torch_reduce_scatter, "all_gather": all_gather,
            "broadcasts": piper_all_gather, "clone": x.clone}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():
        fn()
    # Round-robin, each after a barrier: a loaded machine's drift falls on every way alike.
    for _ in range(repeats):
        for name, fn in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


# -- the tensor-level peak of one step, the same way on both sides ------------------------------------

def allocation_rise(prof) -> int:
    """The largest sum of the CPU allocator's allocations less its frees, in time order, over a
    profiled step (torch's profiler, `profile_memory=True`: one event per allocation and free)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    now = peak = 0
    for _, size in events:
        now += size
        peak = max(peak, now)
    return peak


def _tensor_peak(step, held):
    """`step` wrapped so that its next call records, in `.peak`, the bytes held between steps
    (`held()`) plus the largest rise of live tensor bytes during the step, from every allocation
    and free of the CPU allocator (torch's profiler): what the tensors hold, without what the
    allocator, the communication library or Python keep beside them."""
    from torch.profiler import ProfilerActivity, profile

    def tracked(*args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = step(*args, **kwargs)
        tracked.peak = held() + allocation_rise(prof)
        return out
    tracked.peak = None
    return tracked


def install_tensor_peak(worker) -> None:
    """Into a Piper worker or a torch baseline actor: its next step records the tensor peak
    (`probes.read_step_peak` reads it)."""
    from .probes import wrap_step

    wrap_step(worker, _tensor_peak)
