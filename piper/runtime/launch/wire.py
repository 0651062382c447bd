"""A step's batch on its way from the driver to a worker: numpy arrays, not torch tensors.

Ray pickles a torch tensor through torch's own serialization and unpickles it through
`torch.load`, which costs milliseconds on the worker every call; a numpy array goes through
pickle 5's out-of-band buffers (an actor call carrying two 8 x 64 token tensors: 3.9-6.8 ms as
torch tensors, 1.0 ms as numpy arrays, 0.8 ms with no argument, on our 2-core machines). A dtype
numpy lacks (bfloat16, the float8s) travels as integers of its size, viewed back on arrival.

    payload = {i: [pack(x) for x in mbs]}            # driver
    tensors = {i: [unpack(a) for a in mbs]}          # worker
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Viewed(NamedTuple):
    """A tensor of a dtype numpy lacks: its bytes as integers, and the dtype's name."""

    array: np.ndarray
    dtype: str


def pack(x: torch.Tensor):
    """`x` (a CPU tensor) as what crosses to the worker."""
    x = x.detach()
    try:
        return x.numpy()
    except TypeError:           # no numpy dtype for it
        return Viewed(x.view(_SAME_SIZE[x.element_size()]).numpy(), str(x.dtype).removeprefix("torch."))


def unpack(obj) -> torch.Tensor:
    """The tensor `pack` gave `obj` for (a tensor passes through: a worker's own reader makes them)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Viewed):
        dtype = getattr(torch, obj.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"not a torch dtype: {obj.dtype!r}")
        return torch.from_numpy(_writable(obj.array)).view(dtype)
    return torch.from_numpy(_writable(obj))


def _writable(a: np.ndarray) -> np.ndarray:
    # Ray hands arrays that view its read-only buffers; torch assumes a tensor may be written.
    return a if a.flags.writeable else a.copy()
