"""`use`: finds the strategy (in this file, an imported one or the standard library) and runs its body.

Mixed into `Interpreter`; `Limits.depth` bounds how deeply `use` may nest.
"""
from __future__ import annotations

from piper.diagnostics import Diagnostic, Label, Span

from . import nodes as n
from .outcomes import Stop
from .program import Found
from .values import Env, param_type


class StrategyCalls:
    """Runs `use` statements; needs `bind_args` and the type checks of `Interpreter`."""

    def exec_use(self, stmt: n.Use, env: Env) -> None:
        name = stmt.name.name
        found = self.program.lookup(name, self.module)
        if isinstance(found, tuple):  # the standard-library file does not parse
            for diagnostic in found:
                self.report(Diagnostic(diagnostic.code, diagnostic.message, diagnostic.severity, diagnostic.span,
                                       diagnostic.labels, diagnostic.notes, diagnostic.hint,
                                       self.trace + (stmt.span,)))
            return
        if found is None:
            raise self.fail("unknown-strategy", f"no strategy is called `{name}`", stmt.name.span,
                            hint=self.program.suggest(name, self.module)
                            or "define it with `strategy`, `import` the file that does, or check the name")
        given = self.bind_args(stmt, found.strategy, env)
        self.call(found, given, stmt.span, env)

    def call(self, found: Found, given: dict, site: Span, env: Env) -> None:
        """Bind parameters (given, else defaults), check their types, and run the body."""
        strategy = found.strategy
        missing = [p.name.name for p in strategy.params if p.name.name not in given and p.default is None]
        if missing:
            names = ", ".join(f"`{m}`" for m in missing)
            example = ", ".join(f"{m}=..." for m in missing)
            raise self.fail("missing-parameter", f"strategy `{strategy.name.name}` needs {names}", site,
                            labels=(Label(strategy.name.span, f"`{strategy.name.name}` is defined here"),),
                            hint=f"give {'it' if len(missing) == 1 else 'them'}: "
                                 f"`use {strategy.name.name}({example})`, or `--set {missing[0]}=...`")
        inner = Env()
        names = {p.name.name for p in strategy.params}
        outer_module, outer_trace = self.module, self.trace
        for param in strategy.params:
            pname = param.name.name
            ptype = param_type(param, names - {pname})
            if pname in given:
                value, span, from_set = given[pname]
                what = f"`--set {pname}`" if from_set else f"parameter `{pname}` of `{strategy.name.name}`"
                value = self.want(value, ptype, span, env, what)
            else:
                self.module, self.trace = found.module, outer_trace + (site,)
                try:
                    value = self.want(self.value(param.default, inner), ptype, param.default.span, inner,
                                      f"the default of `{pname}`")
                finally:
                    self.module, self.trace = outer_module, outer_trace
            inner.bind(pname, value, param.name.span)
        if self.abstract:
            return
        if len(self.trace) >= self.limits.depth:
            raise Stop(Diagnostic(
                "recursion-limit", f"`use` is nested more than {self.limits.depth} levels deep", span=site,
                trace=self.trace, hint="a strategy that uses itself needs an `if` that stops it"))
        self.module, self.trace = found.module, outer_trace + (site,)
        try:
            self.exec_block(strategy.body, inner)
        finally:
            self.module, self.trace = outer_module, outer_trace
