"""The executor: runs one device's plan, action by action.

It knows regions, values, parameter units and communication, and nothing of
pipelines or ZeRO: every strategy arrives as the same kind of plan.
Communication is issued asynchronously (sends, receives and collectives
return work handles) and an action waits only for the handles its plan
entry names. The items of an overlapped slot run at once, in lanes
(`slots`).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from dataclasses import dataclass, field

import torch

from . import comm, recompute, tied
from .clip import GlobalNormClip
from .experts import Experts, lane_group
from .flat import UnitLayout
from .graphs import unpack
from .saved import SavedBytes
from .slots import spans, whole_backwards
from .split_backward import backward_inputs, backward_weights, can_split

PARAM, BUFFER, BATCH, VALUE = "param", "buffer", "batch", "value"
TRACE_STEPS = 2      # steps whose action spans `job.trace` can show (piper/trace.py)


@dataclass
class RegionSpec:
    index: int
    graph: object                 # PackedGraph; an fx.GraphModule once unpacked on the worker
    inputs: tuple                 # capture.RegionInput records
    outputs: tuple[int, ...]      # value ids
    loss: bool
    units: tuple[int, ...]        # owner regions whose parameters it reads
    recompute: bool = False       # keep only the inputs in forward, run it again in backward


@dataclass
class WorkerSpec:
    rank: int
    world_size: int
    plan: tuple                                   # compiler.Action records
    regions: dict[int, RegionSpec]
    values: dict[int, tuple]                      # id -> (producer, index, shape, dtype, differentiable)
    units: dict[int, UnitLayout]                  # units this rank holds
    zero: int
    optimizer: object                             # callable(params) -> torch.optim.Optimizer
    grad_scale: float                             # 1 / (microbatches * batch shards)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list = field(default_factory=list)    # every collective group, same order on all ranks
    slots: tuple = ()                             # `order` slots of several computes, as tuples of keys
    concurrent: bool = True                       # run an overlapped slot's items at once (CPU only, see below)
    clip_grad_norm: float | None = None           # clip by the global gradient norm (`clip.py`)
    compute_dtype: torch.dtype | None = None      # 16-bit compute, float32 master (`precision.py`)
    loss_scaling: object = None                   # fp16's loss scaling (piper.FP16), else None
    experts: object = None                        # runtime.experts.ExpertSpec under `shard experts`


class Unit:
    """One owner region's parameters on this rank: flat buffers, shards, optimizer.

    Each parameter is a leaf tensor viewing the flat buffer `full`, and its
    `.grad` views the flat gradient buffer, so autograd accumulates straight
    into the buffer the collectives reduce (DDP's gradient-as-bucket-view).
    A view of one flat leaf would instead make every parameter's backward
    write a full-size gradient.
    """

    def __init__(self, layout: UnitLayout, rank: int, zero: int, init: list[torch.Tensor], optimizer, device):
        self.layout = layout
        self.zero = zero
        self.index = layout.group.index(rank)
        self.device = device
        self.full: list[torch.Tensor] = []        # flat parameters (storage freed between uses in ZeRO-3)
        self.shard: list[torch.Tensor] = []       # what the optimizer updates
        self.flat_grad: list[torch.Tensor | None] = []
        self.grad_shard: list[torch.Tensor | None] = []
        self.in_flight: list[list[torch.Tensor]] = []   # ZeRO-2/3 gradient buffers being reduce-scattered
        self.leaves: dict[str, torch.Tensor] = {}
        self._by_bucket: list[list[tuple[torch.Tensor, object]]] = []
        for bucket, data in zip(layout.buckets, init):
            data = data.to(device)
            lo, hi = bucket.bounds(self.index)
            if zero == 3:
                shard = torch.nn.Parameter(data.clone())
                full = torch.zeros(bucket.padded, dtype=bucket.dtype, device=device)
            else:
                full = data.clone()
                shard = torch.nn.Parameter(full if zero == 0 else full[lo:hi])   # shares full's storage
            self.full.append(full)
            self.shard.append(shard)
            self.flat_grad.append(None)
            self.grad_shard.append(None)
            leaves = []
            for e in bucket.entries:
                leaf = full[e.offset:e.offset + e.numel].view(e.shape).requires_grad_()
                self.leaves[e.name] = leaf
                leaves.append((leaf, e))
            self._by_bucket.append(leaves)
        self.optimizer = optimizer(self.shard)
        if zero == 3:
            self.release()          # views made; the parameters come back on each gather
        self.count()

    def _tensors(self) -> dict[str, list]:
        """What the unit holds, by kind (None where a buffer is not allocated)."""
        return {"params": [*self.full, *self.shard],
                "grads": [*self.flat_grad, *self.grad_shard, *(g for sent in self.in_flight for g in sent)],
                "optimizer": [v for state in self.optimizer.state.values() for v in state.values()
                              if torch.is_tensor(v) and v.dim() > 0]}    # not Adam's step counts

    def count(self) -> None:
        """Recount `held`, the bytes of everything in `_tensors` alive now. Called where buffers
        are allocated or freed, not per action."""
        seen: set[int] = set()
        self.held = sum(_storage_bytes(ts, seen) for ts in self._tensors().values())

    # -- parameters ---------------------------------------------------------------------
    def views(self) -> dict[str, torch.Tensor]:
        return self.leaves

    def weights(self) -> list[torch.Tensor]:
        return list(self.leaves.values())

    def refresh(self) -> None:
        """Before a step: bring any compute copy of the parameters up to date (`precision.py`)."""

    def gather(self, group):
        """ZeRO-3: refill the full buffers from every member's shard (async)."""
        works = []
        for bucket, full, shard in zip(self.layout.buckets, self.full, self.shard):
            storage = full.untyped_storage()
            if storage.size() == 0:
                storage.resize_(bucket.padded * full.element_size())
            # `.data` has its own version counter: refilling the storage must not look like
            # an in-place change to the parameters autograd saved in forward.
            works.append(comm.all_gather_into(full.data, shard.detach(), group))
        self.count()
        return works

    def release(self) -> None:
        """ZeRO-3: free the gathered parameters (saved activations keep the storage object)."""
        for full in self.full:
            full.untyped_storage().resize_(0)
        self.count()

    def gather_updated(self, group):
        """ZeRO-1/2: share every member's updated slice."""
        works = []
        for full, shard in zip(self.full, self.shard):
            works.append(comm.all_gather_into(full.data, shard.detach().clone(), group))
        return works

    # -- gradients ----------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Point every parameter's `.grad` into a zeroed flat buffer, if it has none.

        Replicated gradients keep theirs across steps (as DDP); ZeRO-2/3 get a
        new one before each backward that follows a reduce-scatter."""
        for i, (bucket, leaves) in enumerate(zip(self.layout.buckets, self._by_bucket)):
            if self.flat_grad[i] is None:
                self.flat_grad[i] = torch.zeros(bucket.padded, dtype=bucket.dtype, device=self.device)
                for leaf, e in leaves:
                    leaf.grad = self.flat_grad[i][e.offset:e.offset + e.numel].view(e.shape)
                self.count()

    def reduce(self, group):
        """Reduce the gradients over the group: (works, what to run once they are done).

        ZeRO-2/3 reduce-scatter the current buffers and let go of them at once,
        so the next backward writes into a new buffer while this one is in
        flight (`in_flight` until done). The shard of the sum lands in
        `grad_shard` itself: this member first adds what earlier reduce-scatters
        gave it into its own slice of the buffer, which only it contributes to
        its shard, and so needs no shard-sized output beside `grad_shard`. With
        an earlier reduce-scatter of this unit still in flight (the runtime
        finishes one before the next backward into the unit, so only a plan
        that reduces twice in a row has that), the shard is not final yet: the
        result goes to a new tensor, added once both are done.
        """
        if self.zero <= 1:
            return [comm.all_reduce(flat, group) for flat in self.flat_grad], None
        self.attach_grads()        # every member issues the collective, even with nothing new
        direct = not self.in_flight
        outs = []
        for i, (bucket, flat) in enumerate(zip(self.layout.buckets, self.flat_grad)):
            if direct and self.grad_shard[i] is not None:
                lo, hi = bucket.bounds(self.index)
                flat[lo:hi].add_(self.grad_shard[i])
                outs.append(self.grad_shard[i])
            else:
                outs.append(torch.empty(bucket.shard_size, dtype=bucket.dtype, device=self.device))
        works = [comm.reduce_scatter_into(out, flat, group) for out, flat in zip(outs, self.flat_grad)]
        sent = [*self.flat_grad, *outs]     # in flight: the buffers read and the shards being filled
        self.in_flight.append(sent)
        self.flat_grad = [None] * len(self.flat_grad)
        for leaves in self._by_bucket:
            for leaf, _ in leaves:
                leaf.grad = None
        self.count()

        def done():
            self.in_flight = [x for x in self.in_flight if x is not sent]
            for i, out in enumerate(outs):
                if self.grad_shard[i] is None:
                    self.grad_shard[i] = out
                elif out is not self.grad_shard[i]:
                    self.grad_shard[i].add_(out)
            self.count()
        return works, done

    def step(self) -> None:
        for i, (bucket, shard) in enumerate(zip(self.layout.buckets, self.shard)):
            if self.zero == 0:
                shard.grad = self.flat_grad[i]
            elif self.zero == 1:
                lo, hi = bucket.bounds(self.index)
                shard.grad = self.flat_grad[i][lo:hi]
            else:
                shard.grad = self.grad_shard[i]
        self.optimizer.step()
        for i, shard in enumerate(self.shard):
            shard.grad = None
            if self.flat_grad[i] is not None:
                self.flat_grad[i].zero_()       # replicated gradients stay allocated, as in DDP
            if self.grad_shard[i] is not None:
                self.grad_shard[i].zero_()
        self.count()              # the optimizer's state appears at its first step

    def shards(self) -> list[torch.Tensor]:
        """This member's slice of each bucket, on CPU."""
        out = []
        for bucket, full, shard in zip(self.layout.buckets, self.full, self.shard):
            lo, hi = bucket.bounds(self.index)
            out.append((shard.detach() if self.zero == 3 else full[lo:hi]).cpu().clone())
        return out

    def memory(self) -> dict[str, int]:
        """Bytes held between steps: parameters, gradients, optimizer state."""
        seen: set[int] = set()
        return {kind: _storage_bytes(ts, seen) for kind, ts in self._tensors().items()}


def _storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the allocated storages behind `tensors` (None skipped) not already in `seen`."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.size() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class Executor:
    def __init__(self, spec: WorkerSpec, init: dict[int, list[torch.Tensor]], device: str = "cpu"):
        self.spec = spec
        self.rank = spec.rank
        self.device = torch.device(device)
        for region in spec.regions.values():
            region.graph = unpack(region.graph, self.device)
        self.groups = comm.new_groups(spec.groups)
        from .precision import make_unit, with_loss_scaling

        make = make_unit(spec.compute_dtype)
        self.units = {u: make(layout, spec.rank, spec.zero, init[u], spec.optimizer, self.device)
                      for u, layout in spec.units.items()}
        self.experts = (Experts(spec.experts, spec.rank, init.get("experts", {}), spec.optimizer, self.device)
                        if spec.experts is not None else None)
        self.buffers = {k: v.to(self.device) for k, v in spec.buffers.items()}
        self.by_value = {(p, i): v for v, (p, i, *_rest) in spec.values.items()}
        self.pending: dict[str, tuple[list, object]] = {}
        self.sends: list = []
        self.timings: dict[str, float] = {}       # compute seconds per action, last step
        # On a GPU the host only queues kernels, so a compute's host time says nothing of
        # its cost: CUDA events around it time it on the device, read once the step is over.
        self._events: dict[str, tuple] | None = {} if self.device.type == "cuda" else None
        self.cpu_timings: dict[str, float] = {}   # the same in this thread's CPU seconds (CPU devices)
        self._can_split: dict[int, bool] = {}     # region -> BW resumes from BI (same graph every microbatch)
        self.activation_peak = 0                  # bytes saved for backward, at most, last step
        self.step_peak = 0                        # bytes of units + saved activations, at most, last step
        self._unit_list = list(self.units.values())
        self._param_storages = {full.untyped_storage()._cdata for u in self.units.values() for full in u.full}
        self._param_storages |= {s for u in self.units.values() for s in getattr(u, "storages", list)()}
        self._whole, self._skip = whole_backwards(spec.plan, spec.slots)
        # Overlapped slots run their items in threads on CPU, where Gloo matches messages by
        # tag. NCCL matches point-to-point messages by issue order and its communicators
        # must not be called from two threads at once, so CUDA runs the items in turn.
        concurrent = spec.concurrent and self.device.type == "cpu"
        units_of = {r: set(region.units) for r, region in spec.regions.items()}
        feeds = {r: {spec.values[i.ref][0] for i in region.inputs if i.kind == VALUE}
                 for r, region in spec.regions.items()}
        self._spans = spans(spec.plan, spec.slots, units_of, feeds) if concurrent else {}
        # Units the compute (or overlapped slot) starting at each plan position reads (`_settle_reductions`).
        self._reads = {i: frozenset(spec.regions[a.node.region].units) for i, a in enumerate(spec.plan)
                       if a.node.is_compute}
        for i, s in self._spans.items():
            self._reads[i] = frozenset(u for lane in s.lanes for a in lane if a.node.is_compute
                                       for u in spec.regions[a.node.region].units)
        lanes = max((len(s.lanes) for s in self._spans.values()), default=1)
        self._pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="piper-lane") if lanes > 1 else None
        self._lock = threading.Lock()             # activation accounting and gradient sums, shared by lanes
        self.clip = GlobalNormClip(spec.clip_grad_norm) if spec.clip_grad_norm is not None else None
        self.clip = with_loss_scaling(self.clip, spec.loss_scaling)     # fp16 (`precision.py`)
        # Start/end of every action and when each communication completed, last steps (`job.trace`).
        self.traced: deque = deque(maxlen=TRACE_STEPS)
        self._spans_now: list = []
        self._done_at: dict[str, float] = {}
        self.current: str | None = None           # the action running now (`Worker.status`, health checks)
        self.fault = None                         # a test's injected fault (`faults.Trigger`), else None

    # -- one step -------------------------------------------------------------------------
    def run_step(self, batch: dict[int, list[torch.Tensor]]) -> list[float]:
        cpu = time.process_time()
        try:
            return self._run_step(batch)
        finally:
            # The whole process, every thread (lanes, communication): with the actions'
            # own CPU seconds this gives what the step costs outside them.
            self.cpu_timings["step"] = time.process_time() - cpu      # piper.simulate.STEP

    def _run_step(self, batch: dict[int, list[torch.Tensor]]) -> list[float]:
        self._spans_now, self._done_at = [], {}
        self.traced.append((time.perf_counter(), self._spans_now, self._done_at, threading.get_ident()))
        self.batch = {i: [t.to(self.device) for t in mbs] for i, mbs in batch.items()}
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_out: dict[tuple[int, int, int], torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: list[torch.Tensor] = []
        self.saved_bytes: dict[tuple[int, int], int] = {}
        self._reducing: dict[str, tuple] = {}         # reduce-scatter in flight -> (computes since, unit)
        for unit in self.units.values():
            unit.refresh()
            if unit.zero <= 1:
                unit.attach_grads()
        self.activations = self.activation_peak = self.step_peak = 0
        if self._events:                              # left by a step that failed
            self._events.clear()
        plan, i = self.spec.plan, 0
        while i < len(plan):
            span = self._spans.get(i)
            if self._reducing and i in self._reads:
                self._settle_reductions(self._reads[i])
            if span is None:
                self._run(plan[i])
                if not plan[i].node.is_compute:       # computes sample before they release (`_release`)
                    self._sample()
                i += 1
            else:
                self._run_span(span)
                i = span.stop
        for key in list(self.pending):
            self._wait(key)
        for work in self.sends:
            work.wait()
        self.sends.clear()
        if self.clip is not None:        # the updates it held back, after clipping
            self.clip.finish(self._unit_list, self._run, self.experts.gradients() if self.experts else ())
            for key in list(self.pending):
                self._wait(key)
        losses = [float(x) for x in self.losses]
        self.current = None
        if self._events:
            self._device_timings()
        del self.values, self.grads, self.grad_out, self.saved, self.batch
        return losses

    def _run(self, action) -> tuple[float, float]:
        self.current = action.key
        if self.fault is not None:
            self.fault(action.key)
        for key in action.waits:
            self._wait(key)
        compute = action.node.is_compute
        cpu = time.thread_time() if compute else 0.0     # a system call: only where it is kept
        start = time.perf_counter()
        if compute and self._events is not None:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        if compute and self.experts is not None:
            self.experts.exchanged()          # count only this compute's all-to-alls
        getattr(self, "_" + action.node.op.lower())(action)
        end = time.perf_counter()
        self._spans_now.append((action.key, start, end, threading.get_ident()))
        if compute:
            self.timings[action.key] = end - start
            if self.experts is not None:      # its all-to-alls go to their ALL_TO_ALL node
                self.experts.account(action.node, self.timings)
            if self._events is not None:
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                self._events[action.key] = (begin, done)
            # CPU seconds are what the action costs on a core of its own: the wall time above
            # also holds whatever other processes sharing the core took meanwhile.
            self.cpu_timings[action.key] = time.thread_time() - cpu
        return start, end

    def _device_timings(self) -> None:
        """Replace the computes' host times with their CUDA-event times (the step is over)."""
        for key, (begin, done) in self._events.items():
            done.synchronize()
            self.timings[key] = begin.elapsed_time(done) / 1e3
        self._events.clear()

    def _run_lane(self, lane, number: int = 0) -> tuple[float, float]:
        """Run a lane's actions; (start of its first compute, end of its last)."""
        with lane_group(self.experts and self.experts.lanes, number):   # its own expert all-to-all group
            busy = [self._run(a) for a in lane]
        computes = [t for a, t in zip(lane, busy) if a.node.is_compute]
        return computes[0][0], computes[-1][1]

    def _run_span(self, span) -> None:
        """An overlapped slot: its items at once, one per lane (see `slots`)."""
        for action in span.before:
            self._run(action)
        first, *rest = span.lanes
        futures = [self._pool.submit(self._run_lane, lane, k) for k, lane in enumerate(rest, 1)]
        try:
            times = [self._run_lane(first)]
        finally:
            errors = [f.exception() for f in futures]    # never leave a lane running behind an error
        for exc in errors:
            if exc is not None:
                raise exc
        times += [f.result() for f in futures]
        # The slot's cost as the simulator counts it: computing, from the first lane's
        # start to the last lane's end (waits for inputs before that are not its cost).
        self.timings[span.key] = max(end for _, end in times) - min(start for start, _ in times)
        # In CPU seconds the slot costs both lanes: a device is one core's worth of work in
        # the cost model, which lets lanes use an idle core only through `cores=`.
        self.cpu_timings[span.key] = sum(self.cpu_timings[a.key] for lane in span.lanes for a in lane
                                         if a.node.is_compute)
        for action in span.after:
            self._run(action)

    def _wait(self, key: str) -> None:
        if key not in self.pending:       # a reduce-scatter `_settle_reductions` already finished
            return
        works, then = self.pending.pop(key)
        for w in works:
            w.wait()
        self._done_at[key] = time.perf_counter()
        if then is not None:
            then()

    # -- compute --------------------------------------------------------------------------
    def _args(self, region: RegionSpec, mb: int):
        views = {}
        for u in region.units:
            views.update(self.units[u].views())
            if self.experts is not None:
                views.update(self.experts.views(u))
        args, leaves = [], {}
        for inp in region.inputs:
            if inp.kind == PARAM:
                args.append(views[inp.ref])
            elif inp.kind == BUFFER:
                args.append(self.buffers[inp.ref])
            elif inp.kind == BATCH:
                args.append(self.batch[inp.ref][mb])
            else:
                src = self.values[(inp.ref, mb)]
                leaf = src.detach()
                if self.spec.values[inp.ref][4]:
                    leaf.requires_grad_()
                    leaves[inp.ref] = leaf
                args.append(leaf)
        return args, leaves

    def _f(self, action) -> None:
        node = action.node
        region = self.spec.regions[node.region]
        args, leaves = self._args(region, node.mb)
        if region.recompute:
            outs, kept, size = recompute.forward(region.graph, args, self.device, self._param_storages)
        else:
            with torch.enable_grad(), SavedBytes(self._param_storages) as saved:
                outs = region.graph(*args)
            size, kept = saved.size, outs
        self.saved_bytes[(node.region, node.mb)] = size
        with self._lock:
            self.activations += size
            self.activation_peak = max(self.activation_peak, self.activations)
        for v, out in zip(region.outputs, outs):
            self.values[(v, node.mb)] = out
        if region.loss:
            self.losses.append(outs[-1].detach())
        self.saved[(node.region, node.mb)] = (kept, leaves)
        self._release(action)

    def _recomputed(self, region: RegionSpec, node, outs):
        """A `recompute` region's outputs, with their graph: its forward again (else `outs`)."""
        if not isinstance(outs, recompute.Kept):
            return outs
        views = {}
        for u in region.units:             # the parameters as this backward sees them (gathered again)
            views.update(self.units[u].views())
        outs.args = [views[i.ref] if i.kind == PARAM else a for i, a in zip(region.inputs, outs.args)]
        outs, size = recompute.rerun(region.graph, outs, self.device, self._param_storages)
        with self._lock:
            self.saved_bytes[(node.region, node.mb)] = self.saved_bytes.get((node.region, node.mb), 0) + size
            self.activations += size
            self.activation_peak = max(self.activation_peak, self.activations)
        return outs

    def _backward_targets(self, region: RegionSpec, mb: int, outs):
        tensors, grads = [], []
        for v, out in zip(region.outputs, outs):
            g = self.grads.pop((v, mb), None)
            if g is not None and out.requires_grad:
                tensors.append(out)
                grads.append(g)
        if region.loss:
            loss = outs[-1]
            tensors.append(loss)
            grads.append(torch.full_like(loss, self.spec.grad_scale * getattr(self.clip, "loss_scale", 1.0)))
        return tensors, grads

    def _deliver_input_grads(self, node, leaves: dict, grads: dict) -> None:
        """Route each input value's gradient to its producer: locally or via SEND_B."""
        for v, leaf in leaves.items():
            g = grads.get(v)
            if g is None:
                g = torch.zeros_like(leaf)
            producer = self.spec.values[v][0]
            if producer in self.spec.regions:
                self._accumulate((v, node.mb), g)
            else:
                self.grad_out[(v, node.mb, node.region)] = g

    def _accumulate(self, key, g) -> None:
        with self._lock:
            if key in self.grads:
                self.grads[key] = self.grads[key] + g
            else:
                self.grads[key] = g

    def _b(self, action) -> None:
        node = action.node
        region = self.spec.regions[node.region]
        outs, leaves = self.saved.pop((node.region, node.mb))
        outs = self._recomputed(region, node, outs)
        tensors, grads = self._backward_targets(region, node.mb, outs)
        self._grads_for(region)
        if tensors:
            torch.autograd.backward(tensors, grads)
        with self._lock:
            self.activations -= self.saved_bytes.pop((node.region, node.mb), 0)
        self._deliver_input_grads(node, leaves, {v: leaf.grad for v, leaf in leaves.items()})
        self._release(action)

    def _bi(self, action) -> None:
        if action.key in self._whole:      # the item was a whole `B(...)`: one autograd pass
            return self._b(action)
        node = action.node
        region = self.spec.regions[node.region]
        outs, leaves = self.saved[(node.region, node.mb)]
        outs = self._recomputed(region, node, outs)
        tensors, grads = self._backward_targets(region, node.mb, outs)
        keys = list(leaves)
        weights = self._weights(region)
        if tensors:
            inputs = [leaves[k] for k in keys]
            split = self._can_split.get(node.region)
            if split is None:
                split = self._can_split[node.region] = can_split(tensors, inputs, weights)
            result, state = backward_inputs(tensors, grads, inputs, weights, split=split)
        else:
            result, state = [], ("graph", ([], []))
        self.saved[(node.region, node.mb)] = state
        self._deliver_input_grads(node, leaves, dict(zip(keys, result)))
        self._release(action)

    def _bw(self, action) -> None:
        node = action.node
        if action.key not in self._skip:   # else its BI ran the whole backward
            region = self.spec.regions[node.region]
            state = self.saved.pop((node.region, node.mb))
            self._grads_for(region)
            backward_weights(self._weights(region), state)
            with self._lock:
                self.activations -= self.saved_bytes.pop((node.region, node.mb), 0)
        self._release(action)

    def _weights(self, region: RegionSpec) -> list[torch.Tensor]:
        weights = [w for u in region.units for w in self.units[u].weights()]
        if self.experts is not None:
            weights += [w for u in region.units for w in self.experts.weights(u)]
        return weights

    def _upd(self, action) -> None:
        if self.clip is not None and self.clip.defer(action):
            return
        self.units[action.node.region].step()
        if self.experts is not None:
            self.experts.step(action.node.region)
        self._sample()

    def _release(self, action) -> None:
        self._sample()
        for u in action.release:
            self.units[u].release()

    def _sample(self) -> None:
        """Raise `step_peak` to what is held now: every unit's buffers plus the saved activations.

        Sampled after each action (a compute's gathered parameters before they go), so a
        transient inside an action (autograd's own temporaries) is not seen."""
        held = self.activations
        for unit in self._unit_list:
            held += unit.held
        if self.experts is not None:
            held += self.experts.held
        if held > self.step_peak:           # lanes sample too: raise it under the lock
            with self._lock:
                self.step_peak = max(self.step_peak, held)

    # -- communication ---------------------------------------------------------------------
    def _value_of(self, node) -> int:
        producer = node.region if (node.op == "SEND") == (node.phase == "F") else node.peer
        return self.by_value[(producer, node.value)]

    def _send(self, action) -> None:
        node = action.node
        if node.phase == "T":                  # a tied weight's gradient (runtime/tied.py)
            return tied.send(self, action)
        v = self._value_of(node)
        if node.phase == "F":
            tensor = self.values[(v, node.mb)].detach()
        else:
            tensor = self.grad_out.pop((v, node.mb, node.region))
        self.sends.append(torch.distributed.isend(tensor.contiguous(), action.peer, tag=action.tag))

    def _recv(self, action) -> None:
        node = action.node
        if node.phase == "T":
            return tied.recv(self, action)
        v = self._value_of(node)
        _, _, shape, dtype, _ = self.spec.values[v]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = torch.distributed.irecv(buf, action.peer, tag=action.tag)
        key = (v, node.mb)
        if node.phase == "F":
            then = lambda: self.values.__setitem__(key, buf)  # noqa: E731
        else:
            then = lambda: self._accumulate(key, buf)  # noqa: E731
        self.pending[action.key] = ([work], then)

    def _all_reduce(self, action) -> None:
        unit = self.units[action.node.region]
        self.pending[action.key] = unit.reduce(self.groups[action.group])

    def _reduce_scatter(self, action) -> None:
        self.pending[action.key] = self.units[action.node.region].reduce(self.groups[action.group])
        self._reducing[action.key] = (0, action.node.region)

    def _settle_reductions(self, reads: frozenset) -> None:
        """Before a compute that reads the units `reads`: finish the reduce-scatters issued
        before the previous compute, and those of the units it reads.

        Each overlaps at most one compute, and never one that uses its unit: with a region per
        block the next block's backward hides it; with a region per stage the stage's next
        forward would hold the gradients in flight next to its gathered parameters and new
        activations, so those are finished first. Finishing one frees its gradient buffer now,
        not at the update.
        """
        for key, (computes, unit) in list(self._reducing.items()):
            if computes >= 1 or unit in reads:
                del self._reducing[key]
                self._wait(key)
            else:
                self._reducing[key] = (computes + 1, unit)

    def _grads_for(self, region: RegionSpec) -> None:
        """Before a backward: every unit it writes gradients into has a buffer (ZeRO-2/3 get a
        new one after each reduce-scatter)."""
        for u in region.units:
            if self.units[u].zero >= 2:
                self.units[u].attach_grads()

    def _all_to_all(self, action) -> None:
        """The compute before it issued these all-to-alls from its graph (`piper.experts.add_all_to_alls`)."""

    def _all_gather(self, action) -> None:
        if not action.node.phase and self.clip is not None and self.clip.defer(action):
            return                        # ZeRO-1/2's gather of updated shards follows its UPD
        unit = self.units[action.node.region]
        group = self.groups[action.group]
        works = unit.gather(group) if action.node.phase else unit.gather_updated(group)
        self.pending[action.key] = (works, None)

    # -- inspection ------------------------------------------------------------------------
    def shards(self) -> dict:
        out = {u: unit.shards() for u, unit in self.units.items()}
        if self.experts is not None:
            out["experts"] = self.experts.shards()     # this device's expert rows, by weight name
        return out

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held between steps,
        and the peak of activations saved for backward during the last step."""
        total = {"params": 0, "grads": 0, "optimizer": 0}
        for unit in self.units.values():
            for k, v in unit.memory().items():
                total[k] += v
        if self.experts is not None:
            for k, v in self.experts.memory().items():
                total[k] += v
        total["activations_peak"] = self.activation_peak
        total["step_peak"] = self.step_peak
        return total
