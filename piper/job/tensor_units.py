"""The driver's side of tensor parallelism: which devices share a unit at each tp index, each
device's shards of the parameters, and the whole parameters from every index's shards.

Under `shard columns/rows/vocab ... over tp` a region runs on every tp index of its devices;
the devices at one tp index hold the same shards and share (and ZeRO-shard) the unit's flat
buffers, so each unit has one layout per tp index, alike but for its group and which
replicated buckets count towards a global norm (`UnitLayout.for_tensor_index`).
"""
from __future__ import annotations

import torch

from ..compiler.flat_layout import at_index


def tensor_index(mesh, axis: str, rank: int) -> int:
    return mesh.coords(rank)[axis]


def layout_of(job, unit: int, rank: int):
    """Unit `unit`'s layout on `rank` (the job's layout where nothing is divided over tp)."""
    layout = job.layouts[unit]
    tensor = job.program.tensor
    if tensor is None:
        return layout
    index = tensor_index(job.mesh, tensor.axis, rank)
    devices = job.compiled.ir.devices_of(unit)
    return layout.for_tensor_index(index, at_index(job.mesh, tensor.axis, devices, index))


def layouts_by_index(job, unit: int) -> list:
    """Unit `unit`'s layout at each tp index, in order."""
    tensor = job.program.tensor
    layout = job.layouts[unit]
    if tensor is None:
        return [layout]
    devices = job.compiled.ir.devices_of(unit)
    return [layout.for_tensor_index(i, at_index(job.mesh, tensor.axis, devices, i)) for i in range(tensor.size)]


def local_params(params: dict, tensor, index: int) -> dict:
    """Each parameter as tp index `index` holds it: its slice along the divided dimension."""
    if tensor is None:
        return params
    out = dict(params)
    for name, dim in tensor.dims.items():
        if name in params:
            out[name] = params[name].detach().chunk(tensor.size, dim)[index]
    return out


def whole(tensor, pieces: list[dict]) -> dict:
    """The whole parameters from each tp index's named tensors (`pieces[i]`)."""
    out = dict(pieces[0])
    for name in pieces[0]:
        dim = tensor.dims.get(name)
        if dim is not None:
            out[name] = torch.cat([p[name] for p in pieces], dim)
    return out


def tensor_spec(mesh, axis: str, lanes: int):
    """The workers' `TensorSpec`: every rank's tp index and every tensor group of the mesh (the
    ranks that differ only along `axis`, in tp order)."""
    from ..runtime.communication.tensor_groups import TensorSpec

    index_of = {r: mesh.coords(r)[axis] for r in range(mesh.world_size)}
    groups: dict = {}
    for r in range(mesh.world_size):
        others = tuple((a, c) for a, c in mesh.coords(r).items() if a != axis)
        groups.setdefault(others, []).append(r)
    return TensorSpec(index_of, tuple(tuple(sorted(g, key=index_of.__getitem__)) for g in groups.values()), lanes)
