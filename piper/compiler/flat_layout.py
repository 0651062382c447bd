"""Flat parameter units' layout: the parameters one region owns, packed per dtype into one flat buffer
padded to a multiple of the group size, so ZeRO can shard it into equal contiguous slices.

    layout = layout_unit(0, ["w", "b"], specs, group=(0, 1))     # one bucket per dtype, padded to 2

The layout is computed once on the driver and shared by every worker and by `Job.state_dict`, so shards
always mean the same elements. In the compiler, below the runtime that packs the buffers
(`piper.runtime.state.flat_buffers`), since the memory model replays the same layout to predict the bytes a unit holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]        # this device's (a tensor-parallel shard's, under `shard columns/rows/vocab`)
    offset: int
    tp_dim: int | None = None     # the dimension divided over tp (None: the whole parameter)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    """All parameters of one dtype in a unit."""

    dtype: torch.dtype
    entries: tuple[Entry, ...]
    padded: int               # flat length, a multiple of the group size
    group_size: int
    tied: int | None = None   # a tied parameter's bucket of its own: the tie's number (piper.ir.tied)
    counted: bool = True      # False on a tied weight's second copy: a global norm counts the weight once
    param_group: int | None = None   # the optimizer's parameter group of every entry (`optimizers.Grouped`)
    tensor: str = ""          # under tp: "divided" (shards), "summed" (gradients summed over tp), "whole"
    # Stepped a parameter at a time, whole (Muon, Adafactor: `optim_check.update_kind`). Sharded
    # (ZeRO, `owned=True` in `layout_unit`), each member's slice holds whole parameters, those it owns.
    whole: bool = False

    @property
    def shard_size(self) -> int:
        return self.padded // self.group_size

    def bounds(self, index: int) -> tuple[int, int]:
        """The slice of the flat buffer that group member `index` owns."""
        return index * self.shard_size, (index + 1) * self.shard_size

    def owned(self, index: int, zero: int) -> tuple[Entry, ...]:
        """The entries group member `index` updates: under ZeRO those in its slice (a `whole`
        bucket's slices hold whole entries), else all of them."""
        if zero == 0:
            return self.entries
        lo, hi = self.bounds(index)
        return tuple(e for e in self.entries if lo <= e.offset < hi)


@dataclass(frozen=True)
class UnitLayout:
    owner: int                        # the region that owns these parameters
    group: tuple[int, ...]            # ranks sharing (and sharding) the unit: under tp, those of one tp index
    buckets: tuple[Bucket, ...]
    tensor_index: int = 0             # under tp: the index along tp of `group`'s devices
    tensor_size: int = 1

    def global_shape(self, e: Entry) -> tuple[int, ...]:
        """The whole parameter's shape (`e.shape` times the tp size along `e.tp_dim`)."""
        if e.tp_dim is None:
            return e.shape
        return tuple(s * self.tensor_size if d == e.tp_dim else s for d, s in enumerate(e.shape))

    def global_offset(self, e: Entry, offsets: tuple[int, ...]) -> tuple[int, ...]:
        """`offsets` in this device's shard of `e` -> in the whole parameter."""
        if e.tp_dim is None:
            return tuple(offsets)
        return tuple(o + self.tensor_index * e.shape[d] if d == e.tp_dim else o for d, o in enumerate(offsets))

    def for_tensor_index(self, index: int, group: tuple[int, ...]) -> "UnitLayout":
        """The same layout for the devices `group` at tp index `index`: a replicated bucket's
        gradient counts towards a global norm at index 0 only (every index holds the same)."""
        from dataclasses import replace

        buckets = tuple(replace(b, counted=b.counted and (b.tensor in ("", "divided") or index == 0))
                        for b in self.buckets)
        return replace(self, group=tuple(group), buckets=buckets, tensor_index=index)


def layout_unit(owner: int, names, specs: dict, group: tuple[int, ...], tied: dict | None = None,
                second_copies=frozenset(), param_groups: dict[str, int] | None = None,
                tensor=None, apart: bool = False, whole=frozenset(), owned: bool = False,
                loads: list[int] | None = None) -> UnitLayout:
    """Pack `names` (with `specs[name].shape/.dtype`) per dtype, in the given order.

    A name in `tied` (name -> tie number) gets a bucket of its own, so every
    copy of a tied parameter is padded and sharded alike; a name in
    `second_copies` is a tied weight whose first copy lives in another unit.
    With `param_groups` (name -> the optimizer's parameter group) each group's
    names are packed apart too, so no shard holds elements of two groups. With `tensor` (a
    `frontend.tensor_parallel.TensorLayout`) the divided, summed and whole parameters are
    packed apart as well (`Bucket.tensor`), and `group` is the devices of one tp index.

    With `apart` each parameter gets a bucket of its own, but for those a collective reads (tied
    copies, gradients summed over tp): `unit_layouts` asks for it where no collective batches a
    unit's buckets, so each gradient buffer appears as its parameter's gradient arrives.

    The names in `whole` are updated a parameter at a time (`Bucket.whole`), packed apart; with
    `owned` (ZeRO over more than one device) each is given one owner, whose slice of the flat
    buffer holds it whole (`owner_offsets`), `loads` the elements each member already owns in
    other units (updated in place)."""
    tied = tied or {}
    by_dtype: dict = {}
    for name in names:
        key = ("tied", tied[name]) if name in tied else specs[name].dtype
        if param_groups is not None:
            key = (key, param_groups[name])
        if tensor is not None:
            key = (key, _tensor_kind(tensor, name))
        if name in whole:
            key = (key, "whole")
        if apart and name not in tied and (tensor is None or _tensor_kind(tensor, name) != "summed"):
            key = (key, "apart", name)
        by_dtype.setdefault(key, []).append(name)
    buckets = []
    for members in by_dtype.values():
        dtype = specs[members[0]].dtype
        size = len(group)
        is_whole = members[0] in whole
        # a tied weight's copies in other units must match: each copy owned by member 0
        mine = loads if tied.get(members[0]) is None else [0] * size
        offsets, padded = _offsets(members, specs, size, mine if is_whole and owned and size > 1 else None)
        entries = [Entry(name, tuple(specs[name].shape), offsets[name],
                         tensor.dims.get(name) if tensor is not None else None) for name in members]
        entries.sort(key=lambda e: e.offset)
        tie = tied.get(members[0])
        buckets.append(Bucket(dtype, tuple(entries), padded, size, tie,
                              counted=tie is None or members[0] not in second_copies,
                              param_group=param_groups[members[0]] if param_groups is not None else None,
                              tensor=_tensor_kind(tensor, members[0]) if tensor is not None else "",
                              whole=is_whole))
    return UnitLayout(owner, tuple(group), tuple(buckets), 0, tensor.size if tensor is not None else 1)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _offsets(members, specs, size: int, loads: list[int] | None) -> tuple[dict[str, int], int]:
    """(name -> offset, padded length) of a bucket's members. End to end, padded to a multiple
    of `size`; with `loads` (a sharded `whole` bucket) by owner instead: `owner_offsets`."""
    if loads is not None:
        return owner_offsets(members, {n: _numel(specs[n].shape) for n in members}, size, loads)
    offsets, offset = {}, 0
    for name in members:
        offsets[name] = offset
        offset += _numel(specs[name].shape)
    return offsets, (-(-offset // size) * size if offset else size)


def owner_offsets(names, numel: dict[str, int], size: int, loads: list[int]) -> tuple[dict[str, int], int]:
    """Give each parameter of a `whole` bucket one owner among `size` members and place it whole
    in that owner's slice: (name -> offset, padded length).

    Greedy by size, as Dion and DeepSpeed's ZeRO Muon balance the update's cost: the largest
    parameter first, each to the member owning the fewest elements of this bucket (the slices
    are as long as the fullest, so this keeps the padding small), ties to the member owning
    the fewest over the job so far (`loads`, updated), then the lowest index. The reduce-scatter
    of the bucket then hands each owner exactly the whole gradients of its parameters, and the
    all-gather after the update hands every member the updated parameters.

        owner_offsets(["a", "b", "c"], {"a": 6, "b": 4, "c": 2}, 2, [0, 0])
            == ({"a": 0, "b": 6, "c": 10}, 12)      # a on member 0; b, c on member 1
    """
    held = [0] * size
    owner: dict[str, int] = {}
    for name in sorted(names, key=lambda n: -numel[n]):       # stable: ties in the unit's order
        i = min(range(size), key=lambda m: (held[m], loads[m], m))
        owner[name] = i
        held[i] += numel[name]
        loads[i] += numel[name]
    slice_len = max(held) or 1
    offsets, at = {}, [m * slice_len for m in range(size)]
    for name in names:
        offsets[name] = at[owner[name]]
        at[owner[name]] += numel[name]
    return offsets, slice_len * size


def unit_layouts(compiled, program, exclude=frozenset(), param_groups: dict[str, int] | None = None,
                 whole=frozenset()) -> dict:
    """Owner region -> its flat unit's layout (`job_layouts` gives a job's): tied weights in
    buckets of their own, the names in `exclude` (expert weights under `shard experts`) left out.

    A unit that no data-parallel collective reads (one device per tp index, no ZeRO) keeps each
    parameter apart (`layout_unit(apart=True)`): a bucket exists to batch a collective, and with
    none its one buffer would appear whole at the unit's first gradient, where torch allocates
    each parameter's `.grad` as it arrives. `whole`: the names updated a parameter at a time
    (`layout_unit`), their owners balanced over each group's members across the units."""
    from ..ir.tied import tie_ids, tied_params

    ir = compiled.ir
    ties, copies = tie_ids(ir), tied_params(ir)
    tensor = getattr(program, "tensor", None)

    def group(region: int) -> tuple[int, ...]:        # under tp: one tp index's devices share a unit
        devices = ir.devices_of(region)
        return devices if tensor is None else at_index(ir.mesh, tensor.axis, devices, 0)
    out = {}
    loads: dict[tuple, list[int]] = {}       # per group, the elements each member owns so far
    for r in ir.regions:
        if r.owned:
            devices = group(r.index)
            out[r.index] = layout_unit(
                r.index, [p for p in r.owned if p not in exclude], program.params, devices, ties,
                second_copies={p for p, owners in copies.items() if owners[0] != r.index},
                param_groups=param_groups, tensor=tensor, apart=len(devices) == 1 and compiled.zero == 0,
                whole=whole, owned=compiled.zero >= 1, loads=loads.setdefault(devices, [0] * len(devices)))
    return out


def job_layouts(compiled, program, optimizer=None) -> dict:
    """`unit_layouts` as a job with `optimizer` lays its units out: under `shard experts` without
    the expert weights (each device holds its rows apart), and with `optimizer` a
    `piper.param_groups(...)` each parameter group packed apart. `Job`, the memory model and
    tune's update costs all read this one."""
    from ..frontend.param_groups import Grouped, whole_params
    from ..ir import experts

    exclude = experts.expert_params(program) if compiled.ir.sharded("experts") else {}
    whole = whole_params(optimizer, list(program.params))
    if whole:
        _refuse_divided(compiled, program, whole, exclude)
    return unit_layouts(compiled, program, exclude=exclude,
                        param_groups=optimizer.of if isinstance(optimizer, Grouped) else None, whole=whole)


def _refuse_divided(compiled, program, whole, experts) -> None:
    """bad-optimizer for per-tensor updates under `shard experts`, whose gather of a divided expert
    weight for its update is not built yet: stepping each piece would train another model. (Under
    tp the update gathers a divided parameter whole: `unit_gradients._gather_divided`.)"""
    from ..frontend.optim_check import refuse_sharded

    supported = "one device, dp, ZeRO-1/2/3 (each parameter updated whole by one owner), pp, tp"
    divided = [n for n in whole if n in experts]
    if divided:
        refuse_sharded("shard experts", divided, supported)


def at_index(mesh, axis: str, devices, index: int) -> tuple[int, ...]:
    """The devices of `devices` at index `index` along `axis` (under tp: those sharing one unit)."""
    return tuple(r for r in devices if mesh.coords(r)[axis] == index)


def _tensor_kind(tensor, name: str) -> str:
    return "divided" if name in tensor.dims else "summed" if name in tensor.summed else "whole"
