"""The mesh a prototype program's device lists make (`piper import FILE.json`).

The prototype names devices, not axes: `place` puts a region on a device
group (`[0, 2]`), `replicate` and `shard` work across one. Its device groups
are its pipeline stages (the prototype numbers them by their sorted device
lists, src/directives.py `_device_to_physical_pp_rank`), and a group's size
is the data-parallel degree. Two layouts name the groups as one index of a
mesh axis, so that `place` becomes `place PP=s on pp[i]`:

- stages inner (the prototype's examples, its harness's default): group i is
  `[i, i + p, i + 2p, ...]`, the mesh `dp=d, pp=p` (device `r * p + i`);
- stages outer (`pp_outer`): group i is `[i*d, ..., i*d + d - 1]`, the mesh
  `pp=p, dp=d`.

    >>> layout_of([("[0]", (0, 2)), ("[1]", (1, 3))], Problems("p.json")).axes
    (('dp', 2), ('pp', 2))

Work is proportional to the devices the program lists, never to the mesh they
imply: a program naming device 1,000,000 alone is refused after one look.
"""
from __future__ import annotations

from dataclasses import dataclass

from .prototype_directives import Problems, show


@dataclass(frozen=True)
class Layout:
    """A program's mesh: `axes` for the `mesh` line, and the pipeline index of each device group."""
    axes: tuple[tuple[str, int], ...]
    stage_of: dict[tuple[int, ...], int]      # a group's sorted devices -> its index along pp
    dp: int                                   # devices per group (1: no dp axis)

    @property
    def pp(self) -> int:
        return len(self.stage_of)


def layout_of(groups: list[tuple[str, tuple[int, ...]]], problems: Problems) -> Layout | None:
    """The layout whose pp indices are exactly the device groups `groups` ((JSON path, sorted devices) pairs)."""
    if not groups:
        return Layout((), {(0,): 0}, 1)
    first_at: dict[tuple[int, ...], str] = {}
    for at, devices in groups:
        first_at.setdefault(devices, at)
    stages = sorted(first_at, key=lambda g: g[0])
    d = len(stages[0])
    for g in stages:
        if len(g) != d:
            problems.unsupported(f"{first_at[g]}.devices", f"devices {show(list(g))} are {len(g)} while "
                                 f"{show(list(stages[0]))} are {d}: the prototype's stages have one size, the "
                                 "data-parallel degree", hint="give every stage the same number of devices")
            return None
    p = len(stages)
    seen: dict[int, tuple[int, ...]] = {}
    for g in stages:
        for device in g:
            other = seen.setdefault(device, g)
            if other is not g:
                problems.unsupported(f"{first_at[g]}.devices", f"device {device} is in {show(list(other))} and in "
                                     f"{show(list(g))}: overlapping device groups are not the stages of one mesh",
                                     hint="place each region on one stage's devices")
                return None
    world = p * d
    missing = next((r for r in range(world) if r not in seen), None)   # world == len(seen): bounded by the input
    if missing is not None:
        at = first_at[stages[-1]]
        problems.unsupported(f"{at}.devices", f"the device groups name {world} devices but leave out device "
                             f"{missing}: the devices of a mesh are numbered from 0 without gaps",
                             hint="number the devices 0, 1, ... across the stages")
        return None
    inner = all(g[k] == i + k * p for i, g in enumerate(stages) for k in range(d))
    outer = all(g[k] == i * d + k for i, g in enumerate(stages) for k in range(d))
    if not (inner or outer):
        i, g = next((i, g) for i, g in enumerate(stages) if g != tuple(range(i, world, p)))
        problems.unsupported(f"{first_at[g]}.devices", f"devices {show(list(g))} are not one stage of a "
                             f"dp={d} x pp={p} mesh: stage {i} is {show(list(range(i, world, p)))} with the "
                             f"stages inner, {show(list(range(i * d, i * d + d)))} with them outer",
                             hint="number the stages' devices in one of the two layouts")
        return None
    stage_of = {g: i for i, g in enumerate(stages)}
    if p == 1:
        axes = (("dp", d),) if d > 1 else ()
    elif d == 1:
        axes = (("pp", p),)
    else:
        axes = (("dp", d), ("pp", p)) if inner else (("pp", p), ("dp", d))
    return Layout(axes, stage_of, d)
