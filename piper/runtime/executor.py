"""The executor: runs one device's plan, action by action.

It knows regions, values, parameter units and communication, and nothing of
pipelines or ZeRO: every strategy arrives as the same kind of plan.
Communication is issued asynchronously (sends, receives and collectives
return work handles) and an action waits only for the handles its plan
entry names.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import comm
from .flat import UnitLayout
from .graphs import unpack
from .split_backward import backward_inputs, backward_weights

PARAM, BUFFER, BATCH, VALUE = "param", "buffer", "batch", "value"


@dataclass
class RegionSpec:
    index: int
    graph: object                 # PackedGraph; an fx.GraphModule once unpacked on the worker
    inputs: tuple                 # capture.RegionInput records
    outputs: tuple[int, ...]      # value ids
    loss: bool
    units: tuple[int, ...]        # owner regions whose parameters it reads


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


class Unit:
    """One owner region's parameters on this rank: flat buffers, shards, optimizer."""

    def __init__(self, layout: UnitLayout, rank: int, zero: int, init: list[torch.Tensor], optimizer, device):
        self.layout = layout
        self.zero = zero
        self.index = layout.group.index(rank)
        self.full: list[torch.Tensor] = []        # flat leaves autograd accumulates into
        self.shard: list[torch.Tensor] = []       # what the optimizer updates
        self.grad_shard: list[torch.Tensor | None] = []
        for bucket, data in zip(layout.buckets, init):
            data = data.to(device)
            lo, hi = bucket.bounds(self.index)
            if zero == 3:
                shard = torch.nn.Parameter(data.clone())
                full = torch.zeros(bucket.padded, dtype=bucket.dtype, device=device).requires_grad_()
                full.untyped_storage().resize_(0)
            else:
                full = data.clone().requires_grad_()
                shard = full if zero == 0 else torch.nn.Parameter(full.detach()[lo:hi])
            self.full.append(full)
            self.shard.append(shard)
            self.grad_shard.append(None)
        self.optimizer = optimizer(self.shard)
        self.live = False

    # -- parameters ---------------------------------------------------------------------
    def views(self) -> dict[str, torch.Tensor]:
        out = {}
        for bucket, full in zip(self.layout.buckets, self.full):
            for e in bucket.entries:
                out[e.name] = full[e.offset:e.offset + e.numel].view(e.shape)
        return out

    def gather(self, group):
        """ZeRO-3: refill the full buffers from every member's shard (async)."""
        works = []
        for bucket, full, shard in zip(self.layout.buckets, self.full, self.shard):
            storage = full.untyped_storage()
            if storage.size() == 0:
                storage.resize_(bucket.padded * full.element_size())
            # `.data` has its own version counter: refilling the storage must not look like
            # an in-place change to the views autograd saved in forward.
            works.append(comm.all_gather_into(full.data, shard.detach(), group))
        self.live = True
        return works

    def release(self) -> None:
        """ZeRO-3: free the gathered parameters (saved activations keep the storage object)."""
        for full in self.full:
            full.untyped_storage().resize_(0)
        self.live = False

    def gather_updated(self, group):
        """ZeRO-1/2: share every member's updated slice."""
        works = []
        for full, shard in zip(self.full, self.shard):
            works.append(comm.all_gather_into(full.data, shard.detach().clone(), group))
        return works

    # -- gradients ----------------------------------------------------------------------
    def reduce(self, group):
        works = []
        for i, (bucket, full) in enumerate(zip(self.layout.buckets, self.full)):
            if full.grad is None:
                full.grad = torch.zeros_like(full)
            if self.zero <= 1:
                works.append(comm.all_reduce(full.grad, group))
            else:
                out = torch.empty(bucket.shard_size, dtype=bucket.dtype, device=full.device)
                self.grad_shard[i] = out
                works.append(comm.reduce_scatter_into(out, full.grad, group))
        return works

    def after_reduce(self) -> None:
        if self.zero >= 2:
            for full in self.full:
                full.grad = None          # only the shard of the gradient is kept

    def step(self) -> None:
        for i, (bucket, full, shard) in enumerate(zip(self.layout.buckets, self.full, self.shard)):
            if full.grad is None and self.grad_shard[i] is None:
                full.grad = torch.zeros_like(full)   # a unit no microbatch touched
            if self.zero == 1:
                lo, hi = bucket.bounds(self.index)
                shard.grad = full.grad[lo:hi]
            elif self.zero >= 2:
                shard.grad = self.grad_shard[i]
        self.optimizer.step()
        for i, (full, shard) in enumerate(zip(self.full, self.shard)):
            if full.grad is not None:
                full.grad.zero_()       # replicated gradients stay allocated, as in DDP
            if shard is not full:
                shard.grad = None
            if self.zero >= 2 and self.grad_shard[i] is not None:
                self.grad_shard[i].zero_()

    def shards(self) -> list[torch.Tensor]:
        """This member's slice of each bucket, on CPU."""
        out = []
        for bucket, full, shard in zip(self.layout.buckets, self.full, self.shard):
            lo, hi = bucket.bounds(self.index)
            src = shard if self.zero == 3 else full
            out.append((src.detach()[lo:hi] if self.zero != 3 else src.detach()).cpu().clone())
        return out

    def memory(self) -> dict[str, int]:
        """Bytes held between steps: parameters, gradients, optimizer state."""
        seen, out = set(), {"params": 0, "grads": 0, "optimizer": 0}

        def count(kind, t):
            if t is None:
                return
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.size() == 0:
                return
            seen.add(storage.data_ptr())
            out[kind] += storage.size()

        for full, shard, gshard in zip(self.full, self.shard, self.grad_shard):
            count("params", full)
            count("params", shard)
            count("grads", full.grad)
            count("grads", gshard)
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    count("optimizer", value)
        return out


class Executor:
    def __init__(self, spec: WorkerSpec, init: dict[int, list[torch.Tensor]], device: str = "cpu"):
        self.spec = spec
        self.rank = spec.rank
        self.device = torch.device(device)
        for region in spec.regions.values():
            region.graph = unpack(region.graph, self.device)
        self.groups = comm.new_groups(spec.groups)
        self.units = {u: Unit(layout, spec.rank, spec.zero, init[u], spec.optimizer, self.device)
                      for u, layout in spec.units.items()}
        self.buffers = {k: v.to(self.device) for k, v in spec.buffers.items()}
        self.by_value = {(p, i): v for v, (p, i, *_rest) in spec.values.items()}
        self.pending: dict[str, tuple[list, object]] = {}
        self.sends: list = []
        self.timings: dict[str, float] = {}       # compute seconds per action, last step
        self.activation_peak = 0                  # bytes saved for backward, at most, last step
        self._param_storages = {full.untyped_storage()._cdata for u in self.units.values() for full in u.full}

    # -- one step -------------------------------------------------------------------------
    def run_step(self, batch: dict[int, list[torch.Tensor]]) -> list[float]:
        self.batch = {i: [t.to(self.device) for t in mbs] for i, mbs in batch.items()}
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_out: dict[tuple[int, int, int], torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: list[torch.Tensor] = []
        self.saved_bytes: dict[tuple[int, int], int] = {}
        self.activations = self.activation_peak = 0
        clock = time.perf_counter
        for action in self.spec.plan:
            for key in action.waits:
                self._wait(key)
            start = clock()
            getattr(self, "_" + action.node.op.lower())(action)
            if action.node.is_compute:
                self.timings[action.key] = clock() - start
        for key in list(self.pending):
            self._wait(key)
        for work in self.sends:
            work.wait()
        self.sends.clear()
        losses = [float(x) for x in self.losses]
        del self.values, self.grads, self.grad_out, self.saved, self.batch
        return losses

    def _wait(self, key: str) -> None:
        works, then = self.pending.pop(key)
        for w in works:
            w.wait()
        if then is not None:
            then()

    # -- compute --------------------------------------------------------------------------
    def _args(self, region: RegionSpec, mb: int):
        views = {}
        for u in region.units:
            views.update(self.units[u].views())
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
        counted: set = set()
        size = 0

        def pack(t):
            # Count what autograd keeps for backward, once per storage, parameters excluded.
            nonlocal size
            storage = t.untyped_storage()
            if storage._cdata not in counted and storage._cdata not in self._param_storages:
                counted.add(storage._cdata)
                size += storage.nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = region.graph(*args)
        self.saved_bytes[(node.region, node.mb)] = size
        self.activations += size
        self.activation_peak = max(self.activation_peak, self.activations)
        for v, out in zip(region.outputs, outs):
            self.values[(v, node.mb)] = out
        if region.loss:
            self.losses.append(outs[-1].detach())
        self.saved[(node.region, node.mb)] = (outs, leaves)
        self._release(action)

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
            grads.append(torch.full_like(loss, self.spec.grad_scale))
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
        if key in self.grads:
            self.grads[key] = self.grads[key] + g
        else:
            self.grads[key] = g

    def _b(self, action) -> None:
        node = action.node
        region = self.spec.regions[node.region]
        outs, leaves = self.saved.pop((node.region, node.mb))
        tensors, grads = self._backward_targets(region, node.mb, outs)
        if tensors:
            torch.autograd.backward(tensors, grads)
        self.activations -= self.saved_bytes.pop((node.region, node.mb), 0)
        self._deliver_input_grads(node, leaves, {v: leaf.grad for v, leaf in leaves.items()})
        self._release(action)

    def _bi(self, action) -> None:
        node = action.node
        region = self.spec.regions[node.region]
        outs, leaves = self.saved[(node.region, node.mb)]
        tensors, grads = self._backward_targets(region, node.mb, outs)
        keys = list(leaves)
        weights = [full for u in region.units for full in self.units[u].full]
        if tensors:
            result, state = backward_inputs(tensors, grads, [leaves[k] for k in keys], weights)
        else:
            result, state = [], ("graph", ([], []))
        self.saved[(node.region, node.mb)] = state
        self._deliver_input_grads(node, leaves, dict(zip(keys, result)))
        self._release(action)

    def _bw(self, action) -> None:
        node = action.node
        region = self.spec.regions[node.region]
        state = self.saved.pop((node.region, node.mb))
        backward_weights([full for u in region.units for full in self.units[u].full], state)
        self.activations -= self.saved_bytes.pop((node.region, node.mb), 0)
        self._release(action)

    def _upd(self, action) -> None:
        self.units[action.node.region].step()

    def _release(self, action) -> None:
        for u in action.release:
            self.units[u].release()

    # -- communication ---------------------------------------------------------------------
    def _value_of(self, node) -> int:
        producer = node.region if (node.op == "SEND") == (node.phase == "F") else node.peer
        return self.by_value[(producer, node.value)]

    def _send(self, action) -> None:
        node = action.node
        v = self._value_of(node)
        if node.phase == "F":
            tensor = self.values[(v, node.mb)].detach()
        else:
            tensor = self.grad_out.pop((v, node.mb, node.region))
        self.sends.append(torch.distributed.isend(tensor.contiguous(), action.peer, tag=action.tag))

    def _recv(self, action) -> None:
        node = action.node
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
        self.pending[action.key] = (unit.reduce(self.groups[action.group]), None)

    def _reduce_scatter(self, action) -> None:
        unit = self.units[action.node.region]
        self.pending[action.key] = (unit.reduce(self.groups[action.group]), unit.after_reduce)

    def _all_gather(self, action) -> None:
        unit = self.units[action.node.region]
        group = self.groups[action.group]
        works = unit.gather(group) if action.node.phase else unit.gather_updated(group)
        self.pending[action.key] = (works, None)

    # -- inspection ------------------------------------------------------------------------
    def shards(self) -> dict[int, list[torch.Tensor]]:
        return {u: unit.shards() for u, unit in self.units.items()}

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held between steps,
        and the peak of activations saved for backward during the last step."""
        total = {"params": 0, "grads": 0, "optimizer": 0}
        for unit in self.units.values():
            for k, v in unit.memory().items():
                total[k] += v
        total["activations_peak"] = self.activation_peak
        return total
