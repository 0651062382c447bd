"""The device mesh: named axes with sizes, ranks laid out row-major.

`mesh["pp"][1]` is the device group at pp-coordinate 1 across every other axis.
"""
from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass
from functools import cached_property

from .diagnostics import clip, did_you_mean, error

# The mesh stays small enough that anything may list its ranks: scripts, `piper.Mesh`, `mesh=` in
# `piper.compile` and prototype programs all meet this one limit.
MAX_WORLD_SIZE = 1 << 20
MAX_AXIS_NAME = 64          # characters of an axis name given to `Mesh.of` (--mesh, mesh=): dp, pp, ep


@dataclass(frozen=True)
class Mesh:
    """Named axes with sizes; at most `MAX_WORLD_SIZE` devices in all (else `bad-mesh`).

    >>> Mesh((("dp", 2), ("pp", 4))).world_size
    8
    """

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        world = 1
        for name, size in self.axes:
            if isinstance(size, int) and size > MAX_WORLD_SIZE:
                raise error("bad-mesh", f"mesh axis `{name}` has {_shown(size)} devices; a mesh holds at most "
                            f"{MAX_WORLD_SIZE:,}", hint=f"give every axis from 1 to {MAX_WORLD_SIZE:,} devices")
            world *= size if isinstance(size, int) and size > 0 else 1
        if world > MAX_WORLD_SIZE:
            raise error("bad-mesh", f"the mesh `{self}` has {world:,} devices; a mesh holds at most "
                        f"{MAX_WORLD_SIZE:,}", hint="make the axes smaller")

    @staticmethod
    def of(spec) -> "Mesh":
        """Build from `{"dp": 2, "pp": 2}`, `"dp=2,pp=2"`, a Mesh, or None (one device)."""
        if isinstance(spec, Mesh):
            return spec
        if spec is None:
            return Mesh(())
        if isinstance(spec, str):
            pairs = []
            for part in filter(None, (p.strip() for p in spec.split(","))):
                name, _, size = part.partition("=")
                if not size.strip().isdigit() or len(size.strip()) > 30:
                    shown = part if len(part) <= 40 else part[:40] + "..."
                    raise error("bad-mesh", f"cannot read mesh axis {shown!r}",
                                hint="write the mesh as NAME=SIZE pairs, e.g. dp=2,pp=4")
                pairs.append((name.strip(), int(size)))
            spec = dict(pairs)
        try:
            items = dict(spec).items()
        except (TypeError, ValueError):
            raise error("bad-mesh", f"cannot read {spec!r} as a mesh",
                        hint='give the mesh as {"dp": 2, "pp": 4} or "dp=2,pp=4"') from None
        axes = tuple((str(k), _axis_size(k, v)) for k, v in items)
        for name, size in axes:
            if size < 1:
                raise error("bad-mesh", f"mesh axis `{name}` has size {size}",
                            hint="every mesh axis needs a size of at least 1")
            if not name.isidentifier() or len(name) > MAX_AXIS_NAME:
                raise error("bad-mesh", f"mesh axis name `{clip(name)}` is not a name",
                            hint=f"use names such as dp, pp, ep, of at most {MAX_AXIS_NAME} characters")
        return Mesh(axes)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @cached_property
    def _sizes(self) -> dict[str, int]:
        """Each axis's size by name, made once: a script asks for sizes once per directive it runs."""
        return dict(self.axes)

    @property
    def world_size(self) -> int:
        size = 1
        for _, s in self.axes:
            size *= s
        return size

    def size(self, axis: str) -> int:
        found = self._sizes.get(axis)
        if found is None:
            self.check_axis(axis)
        return found

    def check_axis(self, axis: str, span=None) -> None:
        if axis not in self._sizes:
            raise error("unknown-axis", f"the mesh has no axis `{axis}`", span=span,
                        hint=did_you_mean(axis, self.names)
                        or f"the mesh axes are {', '.join(self.names) or '(none)'}; add `{axis}` to the mesh")

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return dict(reversed(list(out.items())))

    def rank(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def __getitem__(self, axis: str) -> "AxisView":
        self.check_axis(axis)
        return AxisView(self, axis)

    def group(self, fixed: dict[str, int] | tuple = ()) -> "DeviceGroup":
        return DeviceGroup(self, tuple(sorted(dict(fixed).items())))

    def __str__(self) -> str:
        return ", ".join(f"{n}={s}" for n, s in self.axes) or "(one device)"


def _shown(size: int) -> str:
    """A size as text, shortened: a 5,000-digit number is neither printed whole nor converted
    (Python refuses to turn ints of over 4,300 digits into text)."""
    return f"{size:,}" if size < 10**30 else f"a {int(size.bit_length() * 0.30103) + 1:,}-digit number of"


def _axis_size(name, value) -> int:
    """A mesh axis size: a whole number (an int, or a string of decimal digits), never a bool."""
    if isinstance(value, bool) or value is None:
        raise error("bad-mesh", f"mesh axis `{name}` has the size {value!r}, not a number of devices",
                    hint=f'write a whole number, e.g. {{"{name}": 2}}')
    if isinstance(value, str) and value.strip().isdecimal() and value.strip().isascii():
        if len(value.strip()) > 30:
            raise error("bad-mesh", f"mesh axis `{name}` has a size of {len(value.strip()):,} digits",
                        hint=f"give every axis from 1 to {MAX_WORLD_SIZE:,} devices")
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        raise error("bad-mesh", f"mesh axis `{name}` has the size {value!r}, a {type(value).__name__}",
                    hint=f'write the whole number {int(value)} (an int), e.g. {{"{name}": {int(value)}}}')
    raise error("bad-mesh", f"mesh axis `{name}` has the size {value!r}, which is not a whole number of devices",
                hint=f'write a whole number in decimal, e.g. {{"{name}": 2}}')


@dataclass(frozen=True)
class AxisView:
    mesh: Mesh
    axis: str

    def __len__(self) -> int:
        return self.mesh.size(self.axis)

    def __getitem__(self, index: int) -> "DeviceGroup":
        size = len(self)
        if not isinstance(index, int) or not 0 <= index < size:
            raise error("device-out-of-mesh", f"`{self.axis}[{index}]` is outside the mesh: axis `{self.axis}` "
                        f"has size {size}", hint=f"use an index from 0 to {size - 1}, or grow the mesh")
        return DeviceGroup(self.mesh, ((self.axis, index),))

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class DeviceGroup:
    """The devices whose coordinates equal `fixed` on those axes, any on the rest.

    Ranks are ordered by the free coordinates, so two groups that vary over
    the same axes pair up position by position.
    """

    mesh: Mesh
    fixed: tuple[tuple[str, int], ...]

    @property
    def free_axes(self) -> tuple[str, ...]:
        fixed = dict(self.fixed)
        return tuple(n for n in self.mesh.names if n not in fixed)

    @property
    def size(self) -> int:
        """How many devices the group holds (without listing them)."""
        fixed = dict(self.fixed)
        count = 1
        for name, size in self.mesh.axes:
            if name not in fixed:
                count *= size
        return count

    @property
    def ranks(self) -> tuple[int, ...]:
        fixed = dict(self.fixed)
        free = [(n, s) for n, s in self.mesh.axes if n not in fixed]
        out = []
        for values in itertools.product(*(range(s) for _, s in free)):
            coords = dict(fixed)
            coords.update({n: v for (n, _), v in zip(free, values)})
            out.append(self.mesh.rank(coords))
        return tuple(out)

    def __str__(self) -> str:
        if not self.fixed:
            return "all devices"
        return ", ".join(f"{a}[{i}]" for a, i in self.fixed)
