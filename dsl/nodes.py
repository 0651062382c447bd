"""The syntax tree of a .pps script: small frozen records, each with the `Span` it came from."""
from __future__ import annotations

from dataclasses import dataclass

from piper.diagnostics import Span

# ---- expressions


@dataclass(frozen=True)
class Int:
    value: int
    span: Span


@dataclass(frozen=True)
class Bool:
    value: bool
    span: Span


@dataclass(frozen=True)
class Name:
    """A name: a variable, a parameter, or (where an axis is expected) a mesh axis."""

    name: str
    span: Span


@dataclass(frozen=True)
class Unary:
    op: str  # "-" or "not"
    operand: "Expr"
    span: Span


@dataclass(frozen=True)
class Binary:
    op: str  # + - * // % == != < <= > >= and or
    left: "Expr"
    right: "Expr"
    span: Span


@dataclass(frozen=True)
class Call:
    """`min(a, b)`, `max(a, b)`, `size(axis)`."""

    func: Name
    args: tuple["Expr", ...]
    span: Span


Expr = Int | Bool | Name | Unary | Binary | Call

# ---- selectors


@dataclass(frozen=True)
class Tag:
    """`PP=s` or `EP=*` (value None)."""

    name: Name
    value: Expr | None
    span: Span


@dataclass(frozen=True)
class Region:
    """`PP=s EP=*`: picks regions."""

    tags: tuple[Tag, ...]
    span: Span


@dataclass(frozen=True)
class PassSelector:
    """`F(MB=m)`, `BW(PP=2, MB=3)`, or a bare `UPD`: picks compute nodes."""

    op: Name
    tags: tuple[Tag, ...]
    span: Span


@dataclass(frozen=True)
class Slot:
    """One slot of an order: one item, or a bracketed group whose items may overlap."""

    items: tuple[PassSelector, ...]
    grouped: bool
    span: Span


# ---- statements


@dataclass(frozen=True)
class Let:
    name: Name
    value: Expr
    span: Span


@dataclass(frozen=True)
class Split:
    """`split MB into 8` (parts = (8,)) or `split B into BI, BW`."""

    what: Name
    parts: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True)
class Place:
    """`place PP=s on axis[s]`."""

    selector: Region
    axis: Name
    index: Expr
    span: Span


@dataclass(frozen=True)
class Pattern:
    """A module path pattern, a string literal: `"blocks.*.attn.q"` in `shard columns of ...`."""

    text: str
    span: Span


@dataclass(frozen=True)
class Shard:
    """`shard optimizer, grads over dp`; `shard columns of "**.q_proj" over tp` (`of` the patterns)."""

    what: tuple[Name, ...]
    over: Name
    span: Span
    of: tuple[Pattern, ...] = ()


@dataclass(frozen=True)
class Arg:
    name: Name | None  # None for a positional argument
    value: Expr
    span: Span


@dataclass(frozen=True)
class Use:
    """`use one_f_one_b(microbatches=8) on pp`."""

    name: Name
    args: tuple[Arg, ...]
    on: Name | None
    span: Span


@dataclass(frozen=True)
class For:
    """`for s in 0..p:` over start, start+1, ..., stop-1; `span` is the header."""

    var: Name
    start: Expr
    stop: Expr
    body: tuple["Stmt", ...]
    span: Span


@dataclass(frozen=True)
class If:
    cond: Expr
    then: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...]
    span: Span


@dataclass(frozen=True)
class Slots:
    """One line of an order block: slots run one after another."""

    slots: tuple[Slot, ...]
    span: Span


@dataclass(frozen=True)
class Order:
    """`order PP=s:` and its block (slot lines, `for`, `if`, `let`); `span` is the header."""

    selector: Region
    body: tuple["Stmt", ...]
    span: Span


@dataclass(frozen=True)
class Recompute:
    """`recompute PP=*` or `recompute PP=0 L=*, PP=1 L=0`: regions that recompute in backward."""

    regions: tuple[Region, ...]
    span: Span


Stmt = Let | Split | Place | Shard | Use | For | If | Order | Slots | Recompute

# ---- the top level


@dataclass(frozen=True)
class Param:
    """`microbatches: int`, `axis = pp`, `other: int = 3`."""

    name: Name
    type: Name | None
    default: Expr | None
    span: Span


@dataclass(frozen=True)
class Strategy:
    """`strategy name(params):` and its body; `span` covers `strategy name`."""

    name: Name
    params: tuple[Param, ...]
    doc: str | None
    body: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True)
class MeshAxis:
    name: Name
    size: Int
    span: Span


@dataclass(frozen=True)
class Mesh:
    axes: tuple[MeshAxis, ...]
    span: Span


@dataclass(frozen=True)
class Import:
    path: str
    span: Span


@dataclass(frozen=True)
class Module:
    """A parsed file: its top-level items in source order."""

    file: str
    source: str
    items: tuple[Mesh | Import | Strategy | Stmt, ...]

    @property
    def strategies(self) -> tuple[Strategy, ...]:
        return tuple(item for item in self.items if isinstance(item, Strategy))

    @property
    def imports(self) -> tuple[Import, ...]:
        return tuple(item for item in self.items if isinstance(item, Import))

    @property
    def meshes(self) -> tuple[Mesh, ...]:
        return tuple(item for item in self.items if isinstance(item, Mesh))

    @property
    def statements(self) -> tuple[Stmt, ...]:
        """The top-level statements that run (not mesh, import or strategy definitions)."""
        return tuple(item for item in self.items if not isinstance(item, (Mesh, Import, Strategy)))
