"""Warnings found from the text alone: a `let` never read, a name that hides another.

Scopes: the top level, each strategy (its parameters), and each block of a
`for`, `if`, `else` or `order`. A strategy does not see the top level's names.
"""
from __future__ import annotations

from dataclasses import dataclass

from piper.diagnostics import Diagnostic, Label, Span

from . import nodes as n


@dataclass
class _Binding:
    kind: str  # "let", "parameter" or "loop variable"
    span: Span
    used: bool = False


class _Scopes:
    """Names bound in nested scopes, and the warnings binding and leaving them give."""

    def __init__(self, mesh_axes: tuple[str, ...]):
        self.mesh_axes = mesh_axes
        self.scopes: list[dict[str, _Binding]] = []
        self.diagnostics: list[Diagnostic] = []

    # ---- scopes

    def push(self) -> None:
        self.scopes.append({})

    def pop(self) -> None:
        for name, binding in self.scopes.pop().items():
            self.unused(name, binding)

    def unused(self, name: str, binding: _Binding) -> None:
        if binding.kind == "let" and not binding.used and not name.startswith("_"):
            self.diagnostics.append(Diagnostic(
                "unused-let", f"`{name}` is never used", "warning", binding.span,
                hint=f"remove this `let`, or name it `_{name}` to keep it"))

    def bind(self, name: n.Name, kind: str) -> None:
        earlier = next((scope[name.name] for scope in reversed(self.scopes) if name.name in scope), None)
        if earlier is not None:
            self.diagnostics.append(Diagnostic(
                "shadowed-name", f"this {kind} `{name.name}` hides the {earlier.kind} of the same name",
                "warning", name.span, labels=(Label(earlier.span, f"the {earlier.kind} `{name.name}`"),),
                hint=f"pick a new name; from here on `{name.name}` means this {kind}"))
        elif name.name in self.mesh_axes:
            self.diagnostics.append(Diagnostic(
                "shadowed-name", f"this {kind} `{name.name}` hides the mesh axis of the same name",
                "warning", name.span,
                hint=f"pick a new name; from here on `{name.name}` means this {kind}, not the axis"))
        scope = self.scopes[-1]
        if name.name in scope:
            self.unused(name.name, scope[name.name])
        scope[name.name] = _Binding(kind, name.span)

    def read(self, name: str) -> None:
        for scope in reversed(self.scopes):
            if name in scope:
                scope[name].used = True
                return



class _Linter(_Scopes):
    """Walks a strategy's statements and expressions, binding and reading names."""

    def strategy(self, strategy: n.Strategy) -> None:
        self.push()
        for param in strategy.params:
            if param.default is not None:
                self.expr(param.default)
            if param.name.name not in self.scopes[-1]:  # a repeated parameter is an error elsewhere
                self.bind(param.name, "parameter")
        self.block(strategy.body)
        self.pop()

    def block(self, stmts) -> None:
        for stmt in stmts:
            self.stmt(stmt)

    def nested(self, stmts, var: n.Name | None = None) -> None:
        self.push()
        if var is not None:
            self.bind(var, "loop variable")
        self.block(stmts)
        self.pop()

    def stmt(self, stmt) -> None:
        if isinstance(stmt, n.Let):
            self.expr(stmt.value)
            self.bind(stmt.name, "let")
        elif isinstance(stmt, n.For):
            self.expr(stmt.start)
            self.expr(stmt.stop)
            self.nested(stmt.body, stmt.var)
        elif isinstance(stmt, n.If):
            self.expr(stmt.cond)
            self.nested(stmt.then)
            self.nested(stmt.orelse)
        elif isinstance(stmt, n.Order):
            self.tags(stmt.selector.tags)
            self.nested(stmt.body)
        elif isinstance(stmt, n.Slots):
            for slot in stmt.slots:
                for item in slot.items:
                    self.tags(item.tags)
        elif isinstance(stmt, n.Place):
            self.tags(stmt.selector.tags)
            self.read(stmt.axis.name)
            self.expr(stmt.index)
        elif isinstance(stmt, n.Shard):
            self.read(stmt.over.name)
        elif isinstance(stmt, n.Recompute):
            for region in stmt.regions:
                self.tags(region.tags)
        elif isinstance(stmt, n.Split):
            for part in stmt.parts:
                self.expr(part)
        elif isinstance(stmt, n.Use):
            for arg in stmt.args:
                self.expr(arg.value)
            if stmt.on is not None:
                self.read(stmt.on.name)

    def tags(self, tags) -> None:
        for tag in tags:
            if tag.value is not None:
                self.expr(tag.value)

    def expr(self, expr) -> None:
        if isinstance(expr, n.Name):
            self.read(expr.name)
        elif isinstance(expr, n.Unary):
            self.expr(expr.operand)
        elif isinstance(expr, n.Binary):
            self.expr(expr.left)
            self.expr(expr.right)
        elif isinstance(expr, n.Call):
            for arg in expr.args:
                self.expr(arg)


def lint(module: n.Module, *, mesh_axes: tuple[str, ...] = ()) -> list[Diagnostic]:
    """unused-let and shadowed-name warnings for one module.

    >>> from piper.dsl import parse
    >>> [d.code for d in lint(parse("let x = 1\\n"))]
    ['unused-let']
    """
    linter = _Linter(tuple(mesh_axes))
    for strategy in module.strategies:
        linter.strategy(strategy)
    linter.push()
    linter.block(module.statements)
    linter.pop()
    return linter.diagnostics
