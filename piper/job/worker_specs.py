"""What each worker is given at set-up: its plan, regions, units and their initial flat buffers.

Mixed into `piper.job.Job`; builds the `WorkerSpec` (`runtime/launch/specs.py`) that the worker's `Executor` runs.
"""
from __future__ import annotations

from ..frontend.capture import BUFFER, VALUE
from ..ir.experts import groups as expert_groups, holdings, slots_lanes
from ..runtime.moe.expert_groups import ExpertSpec
from ..runtime.state.flat_buffers import flatten
from ..runtime.launch.packed_graphs import pack
from ..runtime.launch.specs import RegionSpec, WorkerSpec
from ..ir.tied import units_used
from .tensor_units import layout_of, local_params, tensor_index, tensor_spec


class WorkerSpecs:
    """`_spec(rank, ...)` -> (WorkerSpec, initial buffers) and `_multi_slots`; needs the compiled plans and layouts."""

    def _multi_slots(self) -> dict[int, tuple]:
        """Per rank, the `order` slots holding several computes (tuples of keys)."""
        from ..frontend.interop import compute_slots

        return {rank: tuple(slot for slot in slots if len(slot) > 1)
                for rank, slots in compute_slots(self.compiled).items()}

    def _received(self, slots: dict) -> dict:
        """Per rank, the arrivals that prove its sends delivered (`compiler/received.py`), the
        overlapped slots' stretches found as the workers find them (`Lanes`)."""
        from ..compiler.received import sends_received
        from ..compiler.slots import spans

        program, plans = self.program, self.compiled.plans
        units_of = {r: set(u) for r, u in units_used(self.compiled.ir).items()}
        producer = {v.id: v.producer for v in program.values}
        feeds = {r: {producer[i.ref] for i in region.inputs if i.kind == VALUE}
                 for r, region in enumerate(program.regions)}
        stretches = {rank: [(s.start, s.stop) for s in spans(plan, slots.get(rank, ()), units_of, feeds).values()]
                     for rank, plan in plans.items()}
        return sends_received(plans, stretches)

    def _spec(self, rank: int, params, optimizer, slots=(), received=None):
        ir, program = self.compiled.ir, self.program
        mine = [r.index for r in ir.regions if rank in ir.devices_of(r.index)]
        units_of = units_used(ir)
        regions = {r: RegionSpec(r, pack(program.regions[r].graph), program.regions[r].inputs, program.regions[r].outputs,
                                 program.regions[r].loss, units_of[r]) for r in mine}
        units = {u: layout_of(self, u, rank) for u in mine if u in self.layouts}
        tensor = program.tensor
        mine_params = local_params(params, tensor, tensor_index(self.mesh, tensor.axis, rank) if tensor else 0)
        init = {}
        for u, layout in units.items():
            index = layout.group.index(rank)
            flats = []
            for bucket in layout.buckets:
                flat = flatten(bucket, mine_params)
                if self.compiled.zero == 3:
                    lo, hi = bucket.bounds(index)
                    flat = flat[lo:hi].clone()    # a ZeRO-3 device never holds the full unit
                flats.append(flat)
            init[u] = flats
        needed = {i.ref for r in mine for i in program.regions[r].inputs if i.kind == BUFFER}
        values = {v.id: (v.producer, v.index, v.spec.shape, v.spec.dtype, v.differentiable) for v in program.values}
        groups = sorted({a.group for plan in self.compiled.plans.values() for a in plan if a.group})
        spec = WorkerSpec(rank, self.mesh.world_size, self.compiled.plans[rank], regions, values, units,
                          self.compiled.zero, optimizer, 1.0 / (self.microbatches * self.shards),
                          {k: self._buffers[k] for k in needed}, groups, slots, self.concurrent)
        if self._expert_weights:
            spec.experts, init["experts"] = expert_spec(program, ir, rank, params, slots_lanes(self))
        if tensor is not None:
            spec.tensor = tensor_spec(self.mesh, tensor.axis, slots_lanes(self))
        spec.received = received or {}
        spec.readers = self._readers(rank)      # data= / val_data=: what this rank reads of each batch
        self.training.configure(spec, ir, program)
        return spec, init


def expert_spec(program: Program, ir: IR, rank: int, params: dict, lanes: int):
    """(the worker's `ExpertSpec`, its initial expert rows by weight name)."""
    held = holdings(program, ir, rank)
    init = {name: params[name].detach()[lo:hi].cpu().clone()
            for names in held.values() for name, (lo, hi) in names.items()}
    shapes = {name: tuple(params[name].shape) for names in held.values() for name in names}
    return ExpertSpec(expert_groups(ir), lanes, held, shapes), init
