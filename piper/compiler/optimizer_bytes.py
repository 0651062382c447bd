"""The bytes of optimizer state a device holds for one flat unit, as its optimizer builds it
(`piper.runtime.state.unit.Unit`): the memory model's optimizer-state accounting.

An elementwise optimizer keeps a fixed number of elements per parameter element (AdamW: 2,
SGD: 0), over the flat buffer under plain dp and over the device's slice of it under ZeRO.
A per-tensor one keeps what it keeps for each whole parameter (Muon: a momentum matrix;
Adafactor: a row and a column vector for a matrix, a whole vector for a vector), for the
parameters this device owns under ZeRO (`Bucket.owned`), all of them under plain dp.

    unit_state_bytes(layout, zero=1, index=0, optimizer=functools.partial(torch.optim.Muon))
"""
from __future__ import annotations

import functools

import torch

PROBE = 16      # elements of the probe an elementwise optimizer is stepped on


def unit_state_bytes(layout, zero: int, index: int, optimizer, cache: dict | None = None) -> int:
    """Bytes of optimizer state member `index` of `layout`'s group holds for the unit (a step
    made: the state exists). `optimizer`: the job's (a callable, a `Grouped`, None: AdamW)."""
    cache = {} if cache is None else cache
    total = 0
    for bucket in layout.buckets:
        dtype = _dtype(bucket.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        if bucket.whole and bucket.tensor == "divided" and layout.tensor_size > 1:
            # under tp the update gathers a divided parameter whole: its state and that copy
            total += sum(_elements(optimizer, bucket.param_group, layout.global_shape(e), dtype, cache)
                         + _numel(layout.global_shape(e)) for e in bucket.owned(index, zero)) * size
        elif bucket.whole:
            total += sum(_elements(optimizer, bucket.param_group, e.shape, dtype, cache)
                         for e in bucket.owned(index, zero)) * size
        else:
            per = _elements(optimizer, bucket.param_group, (PROBE,), dtype, cache) / PROBE
            total += int(per * (bucket.padded if zero == 0 else bucket.shard_size)) * size
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype(dtype) -> torch.dtype:
    """A torch dtype (an abstract chain's layouts name theirs: "torch.float32")."""
    return getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype


def state_rate(optimizer) -> float:
    """State elements per parameter element of an elementwise `optimizer` (its first group's
    under parameter groups): what an expert row's optimizer keeps."""
    return _elements(optimizer, 0, (PROBE,), torch.float32, {}) / PROBE


def _elements(optimizer, group: int | None, shape: tuple, dtype, cache: dict) -> int:
    """State elements (tensors with a dimension: not step counts) one step leaves for a parameter
    of `shape` in parameter group `group`: stepped on the meta device, where the optimizer
    allows (Muon, AdamW), else on a real tensor (Adafactor reads a value back)."""
    key = (group, tuple(shape), dtype)
    if key not in cache:
        try:
            cache[key] = _probe(optimizer, group, shape, dtype, "meta")
        except Exception:  # noqa: BLE001 - not every update runs on meta tensors
            cache[key] = _probe(optimizer, group, shape, dtype, "cpu")
    return cache[key]


def _probe(optimizer, group, shape, dtype, device: str) -> int:
    from ..frontend.param_groups import Grouped

    p = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
    if isinstance(optimizer, Grouped):
        opt = optimizer.make([p], [group or 0])
    else:
        opt = (optimizer or functools.partial(torch.optim.AdamW, lr=1e-3))([p])
    p.grad = torch.ones_like(p)
    opt.step()
    return sum(v.numel() for state in opt.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)
