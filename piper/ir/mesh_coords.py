"""Devices' mesh coordinates for every rank at once, in time a few list operations per rank.

`Mesh.coords(rank)` builds a dict per call (about 3 µs); the passes that want the coordinates of
every device of a big mesh (131,072 at dp=65,536 x tp=2) take them from here instead.

    >>> from piper.mesh import Mesh
    >>> axis_coords(Mesh([("dp", 2), ("tp", 3)]), ("tp",))
    [(0,), (1,), (2,), (0,), (1,), (2,)]
    >>> sorted(varying_axes(Mesh([("dp", 2), ("tp", 3)]), [0, 1, 2]))
    ['tp']
"""
from __future__ import annotations

import itertools
import operator


def axis_coords(mesh, axes) -> list[tuple[int, ...]]:
    """For each rank in order, its coordinates along `axes` (ranks count with the last axis
    fastest, as `Mesh.rank` numbers them)."""
    names = [name for name, _ in mesh.axes]
    positions = [names.index(a) for a in axes]
    every = itertools.product(*(range(size) for _, size in mesh.axes))
    if not positions:
        return [()] * mesh.world_size
    if len(positions) == 1:
        return [(c[positions[0]],) for c in every]
    return list(map(operator.itemgetter(*positions), every))


def varying_axes(mesh, ranks) -> set[str]:
    """The axes along which `ranks` do not all have one coordinate."""
    out, stride = set(), 1
    for name, size in reversed(mesh.axes):
        if size > 1 and len({rank // stride % size for rank in ranks}) > 1:
            out.add(name)
        stride *= size
    return out
