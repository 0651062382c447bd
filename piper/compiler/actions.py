"""`Action`: one step of a device's plan, the record the compiler's plans hold and the runtime reads.

    Action(node, peer=1, tag=7)      # a SEND/RECV with its peer rank and message tag

Its own module, below `plans` (which makes them), `replay`/`simulate` (which walk them) and the cost models,
so none of those imports another in a loop.
"""
from __future__ import annotations

from collections import namedtuple
from typing import TYPE_CHECKING

from ..ir.dag import _not_same

if TYPE_CHECKING:
    from ..ir.dag import Node

_tuple_new = tuple.__new__
_ActionFields = namedtuple("_ActionFields", "node peer tag group waits release")


class Action(tuple):
    """One step of a device's plan.

    `peer` is the other rank of a SEND/RECV and `tag` its message tag;
    `group` the ranks of a collective; `waits` the keys of communication this
    action must see completed first; `release` the parameter units (owner
    regions) whose gathered parameters can be freed after it (ZeRO-3).

    An immutable value compared by all its fields, as the frozen dataclass it
    replaces was; a tuple because plans hold millions of them (see `Node`).
    """

    __slots__ = ()
    node, peer, tag, group, waits, release = (
        _ActionFields.node, _ActionFields.peer, _ActionFields.tag, _ActionFields.group, _ActionFields.waits,
        _ActionFields.release)

    def __new__(cls, node: Node, peer: int | None = None, tag: int | None = None,
                group: tuple[int, ...] | None = None, waits: tuple[str, ...] = (),
                release: tuple[int, ...] = ()) -> "Action":
        return _tuple_new(cls, (node, peer, tag, group, waits, release))

    @property
    def key(self) -> str:
        return self[0].key

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return tuple.__eq__(self, other)
        return _not_same(other)

    def __ne__(self, other):
        if other.__class__ is self.__class__:
            return tuple.__ne__(self, other)
        return _not_same(other, True)

    __hash__ = tuple.__hash__

    def __reduce__(self):
        return Action, tuple(self)

    def __repr__(self) -> str:
        return "Action(" + ", ".join(f"{f}={v!r}" for f, v in zip(_ActionFields._fields, self)) + ")"

    def __str__(self) -> str:
        return self[0].key
