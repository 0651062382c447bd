"""Checks that a .pps value has the type a statement wants (int, bool, mesh axis) and says why when not.

Mixed into `Interpreter`; an Unknown passes every check, so abstract mode checks types without values.
"""
from __future__ import annotations

from piper.diagnostics import Span, clip, did_you_mean

from .outcomes import Fail
from .values import ANY_TYPE, AXIS, BOOL, INT, TYPE_WORDS, Axis, Env, FreeName, Unknown, show, type_of


class TypeChecks:
    """`want` and its shorthands; needs `value`, `fail` and `mesh`."""

    def int_of(self, expr, env: Env, what: str):
        return self.want(self.value(expr, env), INT, expr.span, env, what)

    def bool_of(self, expr, env: Env, what: str):
        return self.want(self.value(expr, env), BOOL, expr.span, env, what)

    def want(self, value, wanted: str, span: Span | None, env: Env, what: str):
        """`value` as type `wanted` (Unknown passes; a FreeName becomes an axis); else wrong-type."""
        if type(value) is int and wanted == INT:  # the common case, first
            return value
        if wanted == AXIS:
            axis = self.axis_of(value, span, env, what)
            return Axis(axis) if isinstance(axis, str) else axis
        if isinstance(value, Unknown):
            if value.type in (wanted, ANY_TYPE) or wanted == ANY_TYPE:
                return Unknown(wanted)
        elif wanted == ANY_TYPE or type_of(value) == wanted:
            return value
        if isinstance(value, FreeName) and value.span is None:  # a word given by --set
            raise self.fail("wrong-type", f"{what} needs {TYPE_WORDS[wanted]}, but got `{clip(value.name)}`", span)
        if isinstance(value, FreeName) and not (self.mesh and value.name in self.mesh.names):
            raise self.unknown_name(value, env)
        got = type_of(value)
        hint = f"`size({show(value)})` is the number of devices along it" \
            if got == AXIS and wanted == INT else None
        shown = f"`{show(value)}` is {TYPE_WORDS[got]}" if not isinstance(value, Unknown) else \
            f"this is {TYPE_WORDS[got]}"
        raise self.fail("wrong-type", f"{what} needs {TYPE_WORDS[wanted]}, but {shown}", span, hint=hint)

    def unknown_name(self, value: FreeName, env: Env) -> Fail:
        close = did_you_mean(value.name, env.names() + list(self.mesh.names if self.mesh else ()))
        notes = () if self.mesh or close else (f"if `{clip(value.name)}` is a mesh axis, `size({clip(value.name)})` is its "
                                               "number of devices",)
        return self.fail("unknown-name", f"unknown name `{clip(value.name)}`", value.span, notes=notes,
                         hint=close or "bind it with `let`, or make it a parameter of the strategy")

    def axis_of(self, value, span: Span | None, env: Env, what: str):
        """The mesh axis name `value` holds, checked against the mesh; Unknown passes."""
        if isinstance(value, Unknown) and value.type in (AXIS, ANY_TYPE):
            return Unknown(AXIS)
        if not isinstance(value, (Axis, FreeName)):
            shown = f"`{show(value)}` is" if not isinstance(value, Unknown) else "this is"
            raise self.fail("wrong-type", f"{what} needs a mesh axis, but {shown} {TYPE_WORDS[type_of(value)]}",
                            span, hint="name an axis of the mesh, such as `pp`, or a parameter that holds one")
        name = value.name
        if self.mesh is None or name in self.mesh.names:
            return name
        name = clip(name)       # from here only for the messages: a --set word may be of any length
        where = value.span if isinstance(value, FreeName) and value.span is not None else span
        if not self.mesh.names:
            raise self.fail("unknown-axis", f"the mesh has no axis `{name}`: this script has no mesh", where,
                            hint=f"declare one, e.g. `mesh {name}=2`, or pass --mesh {name}=2")
        variables = [v for v in env.names() if type_of(env.lookup(v).value) in (AXIS, ANY_TYPE)]
        raise self.fail("unknown-axis", f"the mesh has no axis `{name}`", where,
                        notes=(f"the mesh is {self.mesh}",),
                        hint=did_you_mean(name, list(self.mesh.names) + variables)
                        or f"the axes are {', '.join(self.mesh.names)}; add `{name}` to the mesh")
