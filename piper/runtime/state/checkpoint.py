"""A worker's side of `job.save` / `job.load`: its flat parameter shards and optimizer
state, described to torch.distributed.checkpoint (DCP) per parameter, written and read
by every worker at once over the job's own process group.

How a flat shard is described. A ZeRO shard is a range of a unit's flat buffer
(`Bucket.bounds`, `piper.compiler.flat_layout`): it may start in the middle of one parameter's row and
end in the middle of another's, so it is not a rectangular chunk of any
parameter, which is all DCP's metadata can name. Each rank therefore cuts the
part of each parameter its range covers into the few boxes (at most two per
dimension) whose union is exactly that part of the row-major parameter
(`boxes`): a partial first row, a block of whole rows, a partial last row,
recursively. Every box is contiguous in memory, so it is a plain view of the
flat buffer: saving writes it without a copy, and loading reads straight into
the unit's own storage. The checkpoint then holds every parameter under its
`model.state_dict()` name and full shape, as chunks, whatever cut them; DCP's
planners find, for any other cut, the saved chunks each box overlaps. Nothing
is gathered, not even within a shard group: the alternative (all-gather a
unit within its group and save whole parameters from one member) moves the
unit over the network at every save and makes one member write it all.

Replicated state (dp without ZeRO, ZeRO-1's parameters) is written in 1/N
slices, one per replica, so the writing is spread evenly and nothing is
written twice; on load every replica reads everything it holds.

Expert weights under `shard experts` are not in the flat units: each device
holds a block of whole expert rows (dim 0) as leaves of their own, with their
own optimizer (`runtime.moe.expert_groups.Experts`). Such a block is one box of the
whole weight at its first row's offset, so every device writes (and reads
into) its rows and their optimizer state as one chunk per tensor of the same
`model.<name>` / `optim.state.<name>.<key>` keys; the devices of a region
hold disjoint rows, so nothing is written twice. A job with the experts
replicated reads the same keys into its flat units, and the other way round.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from . import checkpoint_files
from .whole_state import restore_values, whole_state

MODEL, OPTIM, META = "model", "optim", "piper"
IDS = "ids"          # piper.ids.<rank>: the id of the checkpoint, in each rank's own data file


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of boxes covering elements [start, stop) of a row-major `shape`, in order.

        boxes((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, col = divmod(start, inner)
    last, end = divmod(stop, inner)
    rest = tuple(shape[1:])
    if first == last:          # within one row
        return [((first, *o), (1, *s)) for o, s in boxes(rest, col, end)]
    out = []
    if col:                    # the tail of the first row
        out += [((first, *o), (1, *s)) for o, s in boxes(rest, col, inner)]
        first += 1
    if last > first:           # whole rows
        out.append(((first, *(0,) * len(rest)), (last - first, *rest)))
    if end:                    # the head of the last row
        out += [((last, *o), (1, *s)) for o, s in boxes(rest, 0, end)]
    return out


class Chunks:
    """The part of one parameter (or of one of its optimizer states) a rank holds: boxes that
    view the rank's own flat storage, described to DCP as chunks of the full `shape`.

    DCP asks its state-dict values for `__create_write_items__` (save) and
    `__create_chunk_list__` (load); the planners below look a box up by its offsets.
    """

    def __init__(self, shape: tuple[int, ...], views: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.shape = torch.Size(shape)
        self.views = {tuple(o): v for o, v in views}

    def size(self) -> torch.Size:
        return self.shape     # DCP's load planner compares it with the saved size

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape),
                              properties=TensorProperties.create_from_tensor(v), size=self.shape))
                for o, v in self.views.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in self.views.items()]

    def box(self, offsets) -> torch.Tensor:
        return self.views[tuple(offsets)]


def _lookup(state_dict, index: MetadataIndex):
    obj = state_dict.get(index.fqn)
    return obj.box(index.offset) if isinstance(obj, Chunks) else None


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, finding `Chunks` boxes by offset."""

    def lookup_object(self, index: MetadataIndex):
        box = _lookup(self.state_dict, index)
        return super().lookup_object(index) if box is None else box


class LoadPlanner(checkpoint_files.LoadPlanner):
    """DCP's default planner, reading into `Chunks` boxes (views of the units' own storage), and
    non-tensor items as data only (`checkpoint_files`)."""

    def set_up_planner(self, state_dict, *args, **kwargs) -> None:
        # The default set-up first materialises meta tensors, rebuilding the dict and dropping
        # (to None) values of types it does not know: put the `Chunks` back and flatten again.
        kept = [(parent, key, value) for parent, key, value in _items(state_dict) if isinstance(value, Chunks)]
        super().set_up_planner(state_dict, *args, **kwargs)
        for parent, key, value in kept:
            parent[key] = value
        if self.flatten_state_dict:
            self.state_dict, self.mappings = flatten_state_dict(state_dict)
        else:
            self.state_dict = state_dict

    def lookup_tensor(self, index: MetadataIndex):
        box = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if box is None else box


def _chunks(bucket, flat: torch.Tensor, base: int, lo: int, hi: int, layout=None) -> dict[str, Chunks]:
    """Per parameter of `bucket`, the part of flat elements [lo, hi) it covers, as views of
    `flat`, whose element 0 is the bucket's element `base`. Under tensor parallelism an entry
    is this device's shard of the parameter: its boxes are placed in the whole parameter
    (`UnitLayout.global_offset`), so the checkpoint holds the whole shape whatever the tp size."""
    out = {}
    for e in bucket.entries:
        start, stop = max(lo, e.offset), min(hi, e.offset + e.numel)
        if start >= stop:
            continue
        views, at = [], start - base
        for offsets, sizes in boxes(e.shape, start - e.offset, stop - e.offset):
            n = math.prod(sizes)
            where = layout.global_offset(e, offsets) if layout is not None else offsets
            views.append((where, flat[at:at + n].view(sizes)))
            at += n
        out[e.name] = Chunks(layout.global_shape(e) if layout is not None else e.shape, views)
    return out


def unit_state(unit, *, saving: bool) -> tuple[dict, dict]:
    """(parameters, optimizer state) of one `executor.Unit`, nested as DCP keys them.

    Saving, each member describes its own slice `bounds(index)` of every flat
    buffer; loading, it asks for everything it holds (the whole unit where
    parameters or optimizer state are replicated).
    """
    params, optim = {}, {}
    layout = unit.layout
    for b, bucket in enumerate(layout.buckets):
        if saving and bucket.tensor in ("whole", "summed") and layout.tensor_index > 0:
            continue          # the same on every tp index: tp index 0 writes it
        lo, hi = bucket.bounds(unit.index)
        whole = (0, bucket.padded)
        if unit.zero == 3:
            params.update(_chunks(bucket, unit.shard[b].detach(), lo, lo, hi, layout))
        else:
            params.update(_chunks(bucket, unit.full[b], 0, *((lo, hi) if saving else whole), layout))
        if bucket.whole:          # each parameter's state whole, on its owner (`whole_state.py`)
            optim.update(whole_state(unit, b, Chunks, saving))
            continue
        shard = unit.shard[b]
        base = 0 if unit.zero == 0 else lo          # the optimizer steps the whole unit under plain dp
        span = (lo, hi) if saving or unit.zero else whole
        for key, value in unit.optimizer.state.get(shard, {}).items():
            if torch.is_tensor(value) and value.shape == shard.shape:
                for name, chunks in _chunks(bucket, value, base, *span, layout).items():
                    optim.setdefault(name, {})[key] = chunks
            else:          # a step count: the same for every parameter of the shard
                for e in bucket.entries:
                    optim.setdefault(e.name, {})[key] = value
    return params, optim


def expert_state(executor, saving: bool = False) -> tuple[dict, dict]:
    """(parameters, optimizer state) of the expert rows this device holds under `shard
    experts`, nested as DCP keys them: each leaf (and each optimizer tensor of its shape) is
    one chunk of the whole weight at its first row. The same for saving and loading."""
    params, optim = {}, {}
    experts = getattr(executor, "experts", None)
    if experts is None:
        return params, optim
    tensor = getattr(executor, "tensor_groups", None)
    if saving and tensor and tensor[0].index > 0:
        return params, optim          # every tp index holds the same expert rows: index 0 writes them
    for unit, name, leaf, row, shape in experts.rows():
        offsets = (row,) + (0,) * (leaf.dim() - 1)
        params[name] = Chunks(shape, [(offsets, leaf.detach())])
        for key, value in experts.optimizers[unit].state.get(leaf, {}).items():
            if torch.is_tensor(value) and value.shape == leaf.shape:
                optim.setdefault(name, {})[key] = Chunks(shape, [(offsets, value)])
            else:          # a step count
                optim.setdefault(name, {})[key] = value
    return params, optim


def _expert_optimizers(executor) -> list:
    experts = getattr(executor, "experts", None)
    return list(experts.optimizers.values()) if experts is not None else []


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer the state its first step would, without moving a parameter:
    one step on zero gradients at learning rate 0 (torch's DCP state_dict helpers do the same),
    so the state is there for a checkpoint to be read into."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None


def optimizer_layout(executor, with_state: bool) -> dict[str, dict[str, str]]:
    """Per parameter this rank holds, its optimizer's state keys and kinds ("tensor" or
    "value"), after creating the state (`with_state`) or dropping it (a checkpoint of step 0)."""
    out = {}
    for unit in executor.units.values():
        if with_state:
            init_optimizer_state(unit.optimizer)
        else:
            unit.optimizer.state.clear()
        _, optim = unit_state(unit, saving=True)
        for name, states in optim.items():
            out[name] = {k: "tensor" if isinstance(v, Chunks) else "value" for k, v in states.items()}
        unit.count()
    for optimizer in _expert_optimizers(executor):
        if with_state:
            init_optimizer_state(optimizer)
        else:
            optimizer.state.clear()
    for name, states in expert_state(executor)[1].items():
        out[name] = {k: "tensor" if isinstance(v, Chunks) else "value" for k, v in states.items()}
    return out


def save(executor, path: str, extra: dict, aliases: dict[str, str], skip=(), checksums: bool = True) -> dict:
    """Write this rank's shards into the checkpoint `path` (all ranks call it at once).
    `extra` adds entries this rank writes (rank 0: buffers and metadata; every rank its
    `piper.ids.<rank>`, the checkpoint's id, written into its own data file); each of
    `aliases` (tied parameters' other names) is written as the parameter it names.
    Returns {"bytes": what this rank's data takes (tensors only), "files": {name:
    checkpoint_files.checksum} of the data files it wrote ({} without `checksums`)}."""
    import torch.distributed.checkpoint as dcp

    model, optim = {}, {}
    for u, unit in executor.units.items():
        params, state = unit_state(unit, saving=True)
        # `skip`: the names of a parameter tied across stages that another stage's copy writes.
        model.update({k: v for k, v in params.items() if (u, k) not in skip})
        optim.update({k: v for k, v in state.items() if (u, k) not in skip})
    params, state = expert_state(executor, saving=True)
    model.update(params)
    optim.update(state)
    model.update({alias: model[name] for alias, name in aliases.items() if name in model})
    state = {MODEL: model, OPTIM: {"state": optim}}
    for key, value in extra.items():
        state.setdefault(key, {}).update(value)
    fault = getattr(executor, "fault", None)         # a test's `PIPER_FAULT=... action=save` (named only)
    at_save = fault is not None and fault.fault.action == "save"
    # `piper.ids.<rank>`: the checkpoint's id, which the driver hands every rank; also DCP's save id in `.metadata`.
    ids = extra.get(META, {}).get(IDS, {})
    writer = checkpoint_files.Writer(path, after_write=(lambda: fault("save")) if at_save else None,
                                     identity=next(iter(ids.values()), None))
    with torch.no_grad():
        dcp.save(state, storage_writer=writer, planner=SavePlanner())
    n_bytes = sum(v.numel() * v.element_size() for c in _leaves(state) if isinstance(c, Chunks)
                  for v in c.views.values())
    return {"bytes": n_bytes, "files": checkpoint_files.checksums(path, writer.written) if checksums else {}}


def load(executor, path: str, with_state: bool, buffers) -> None:
    """Read this rank's parameters, the `buffers` named (the persistent ones it holds) and,
    `with_state`, its optimizer state from `path`, in place (all ranks call it at once,
    after `optimizer_layout`). Files are read as data only (`checkpoint_files`)."""
    model, optim = {}, {}
    for unit in executor.units.values():
        params, state = unit_state(unit, saving=False)
        model.update(params)
        if with_state:
            optim.update(state)
    params, state = expert_state(executor)
    model.update(params)
    if with_state:
        optim.update(state)
    model.update({k: v for k, v in executor.buffers.items() if k in buffers})
    state = {MODEL: model, OPTIM: {"state": optim}} if optim else {MODEL: model}
    with torch.no_grad():
        checkpoint_files.load(state, path, LoadPlanner())
    # Tensors were read in place; values that are not tensors (an optimizer's plain-number
    # counts) DCP puts into the dict instead: hand them to the optimizer.
    for unit in executor.units.values():
        for bucket, shard in zip(unit.layout.buckets, unit.shard):
            mine = unit.optimizer.state.get(shard, {})
            loaded = optim.get(bucket.entries[0].name, {})
            for key, value in mine.items():
                if not torch.is_tensor(value) and key in loaded:
                    mine[key] = loaded[key]
        restore_values(unit, optim)          # the same for whole parameters' state (`whole_state.py`)
        unit.count()
    experts = getattr(executor, "experts", None)
    for unit, name, leaf, _, _ in (experts.rows() if experts is not None else ()):
        mine = experts.optimizers[unit].state.get(leaf, {})
        for key, value in mine.items():
            if not torch.is_tensor(value) and key in optim.get(name, {}):
                mine[key] = optim[name][key]


def _items(tree):
    """(dict, key, value) of every leaf of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _items(value)
        else:
            yield tree, key, value


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree
