"""The arguments of a `use`: positional, named, `on AXIS`, and the `--set` overrides that win over them.

Mixed into `Interpreter`.
"""
from __future__ import annotations

from piper.diagnostics import Label, did_you_mean

from . import nodes as n
from .values import AXIS, Env, override_value, param_type

# `_override_for`'s answer when no `--set` names the parameter (an override may itself be None).
MISSING = object()


class Arguments:
    """Matches a `use`'s arguments to a strategy's parameters; needs `value`, `fail`, `overrides`, `trace`."""

    def bind_args(self, stmt: n.Use, strategy: n.Strategy, env: Env) -> dict:
        """The arguments of a `use`: parameter name -> (value, span, from --set)."""
        params = [p.name.name for p in strategy.params]
        defined = (Label(strategy.name.span, f"`{strategy.name.name}` is defined here"),)
        given: dict[str, tuple] = {}
        named = False
        for i, arg in enumerate(stmt.args):
            if arg.name is None:
                if named:
                    raise self.fail("wrong-arity", "a positional argument cannot follow a named one", arg.span,
                                    hint="name it, e.g. `microbatches=8`")
                if i >= len(params):
                    raise self.fail("wrong-arity", f"`{strategy.name.name}` takes {len(params)} argument"
                                    f"{'s' if len(params) != 1 else ''}, but this is argument {i + 1}",
                                    arg.span, labels=defined)
                pname = params[i]
            else:
                named = True
                pname = arg.name.name
                if pname not in params:
                    raise self.fail("unknown-parameter", f"strategy `{strategy.name.name}` has no parameter `{pname}`",
                                    arg.name.span, labels=defined,
                                    hint=did_you_mean(pname, params)
                                    or f"its parameters are {', '.join(params) or '(none)'}")
            if pname in given:
                raise self.fail("duplicate-name", f"parameter `{pname}` is given twice", arg.span)
            given[pname] = (self.value(arg.value, env), arg.value.span, False)
        if stmt.on is not None:
            target = self.axis_param(strategy, stmt.on)
            if target in given:
                raise self.fail("duplicate-name", f"parameter `{target}` is given twice: by name and by `on`",
                                stmt.on.span)
            given[target] = (self.value(stmt.on, env), stmt.on.span, False)
        if not self.trace and self.module is self.program.main:  # a `use` at the top level
            for pname in params:
                raw = self._override_for(strategy, pname)
                if raw is not MISSING:
                    given[pname] = (override_value(raw), stmt.span, True)
        return given

    def axis_param(self, strategy: n.Strategy, on: n.Name) -> str:
        """The parameter `use ... on X` binds: the one called `axis`, or the only axis parameter."""
        names = {p.name.name for p in strategy.params}
        if "axis" in names:
            return "axis"
        axes = [p.name.name for p in strategy.params if param_type(p, names - {p.name.name}) == AXIS]
        if len(axes) == 1:
            return axes[0]
        defined = (Label(strategy.name.span, f"`{strategy.name.name}` is defined here"),)
        if not axes:
            raise self.fail("unknown-parameter", f"`on {on.name}` binds an axis parameter, but "
                            f"`{strategy.name.name}` has none", on.span, labels=defined,
                            hint=f"drop `on {on.name}`, or give the strategy a parameter `axis = {on.name}`")
        raise self.fail("ambiguous-axis", f"`on {on.name}` could bind any of {', '.join(f'`{a}`' for a in axes)}",
                        on.span, labels=defined, hint=f"name the parameter instead, e.g. `{axes[0]}={on.name}`")

    def _override_for(self, strategy: n.Strategy, pname: str):
        qualified = f"{strategy.name.name}.{pname}"
        if qualified in self.overrides:
            return self.overrides[qualified]
        return self.overrides.get(pname, MISSING)
