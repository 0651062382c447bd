"""The .pps interpreter: walks the syntax tree and records directives with their spans.

Concrete mode runs a script against a mesh, as `Script.build` does, and
produces exactly the records of `piper.directives` that the Python API makes.
Abstract mode (the checker) runs each strategy once with its parameters
unknown: every loop body once, both arms of every `if`, and no `use` entered,
so every line is checked for names, types and arity even where a real run
would not go. Scripts are data: the only effects are the records and the
diagnostics, and `Limits` bound the work a hostile script can ask for.
"""
from __future__ import annotations

import operator

from piper.diagnostics import Diagnostic, Label, Span, did_you_mean
from piper.directives import SHARDABLE, Order, Place, Shard, Split
from piper.mesh import Mesh
from piper.selectors import ANY, PASSES, Selector

from . import nodes as n
from .program import Found, Program
from .values import (ANY_TYPE, AXIS, BOOL, BUILTINS, INT, MAX_INT, TYPE_WORDS, TYPES, Axis, Env, FreeName, Limits,
                     Unknown, override_value, param_type, show, type_of)


class _Fail(Exception):
    """One statement fails; the run goes on with the next."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


class _Stop(Exception):
    """A limit is reached; the run ends."""

    def __init__(self, diagnostic: Diagnostic | None):
        super().__init__(diagnostic.message if diagnostic else "stopped")
        self.diagnostic = diagnostic


class Interpreter:
    """Runs statements; collects `directives` and `diagnostics` (never raises for user mistakes)."""

    def __init__(self, program: Program, *, mesh: Mesh | None, abstract: bool = False,
                 overrides: dict | None = None, limits: Limits = Limits()):
        self.program = program
        self.mesh = mesh
        self.abstract = abstract
        self.overrides = dict(overrides or {})
        self.limits = limits
        self.directives: list = []
        self.diagnostics: list[Diagnostic] = []
        self.module: n.Module = program.main
        self.trace: tuple[Span, ...] = ()
        self.steps = 0
        self.top_env: Env | None = None
        self._seen: set = set()
        self._orders: list[tuple[list, list]] = []
        self._span: Span | None = None

    # ---- entry points

    def run_module(self, module: n.Module) -> None:
        """Run the top-level statements of `module` in order."""
        self.module = module
        self.top_env = Env()
        self._guarded(lambda: self.exec_block(module.statements, self.top_env))

    def run_strategy(self, found: Found, site: Span) -> None:
        """Run one strategy with its parameters from the overrides (a file that only defines it)."""
        def go():
            given = {}
            for param in found.strategy.params:
                raw = self._override_for(found.strategy, param.name.name)
                if raw is not _MISSING:
                    given[param.name.name] = (override_value(raw), site, True)
            try:
                self.call(found, given, site, Env())
            except _Fail as fail:
                self.report(fail.diagnostic)
        self._guarded(go)

    def check_strategy(self, found: Found) -> None:
        """Abstract mode: check a definition once, its parameters unknown."""
        assert self.abstract
        def go():
            self.module = found.module
            env = Env()
            seen: dict[str, n.Param] = {}
            names = {p.name.name for p in found.strategy.params}
            for param in found.strategy.params:
                ptype = param_type(param, names - {param.name.name})
                try:
                    self._check_param(param, ptype, seen, env)
                except _Fail as fail:
                    self.report(fail.diagnostic)
                seen.setdefault(param.name.name, param)
                env.bind(param.name.name, Unknown(ptype), param.name.span)
            self.exec_block(found.strategy.body, env)
        self._guarded(go)

    def _check_param(self, param: n.Param, ptype: str, seen: dict, env: Env) -> None:
        name = param.name.name
        if name in seen:
            raise self.fail("duplicate-name", f"parameter `{name}` is declared twice", param.name.span,
                            labels=(Label(seen[name].name.span, "first declared here"),))
        if param.type is not None and param.type.name not in TYPES:
            raise self.fail("unknown-type", f"unknown type `{param.type.name}`", param.type.span,
                            hint=did_you_mean(param.type.name, TYPES) or "the types are int, bool and axis")
        if param.default is not None:
            value = self.value(param.default, env)
            if not (ptype == AXIS and isinstance(value, FreeName)):  # an axis default meets its mesh when used
                self.want(value, ptype, param.default.span, env, f"the default of `{name}`")

    def _guarded(self, fn) -> None:
        try:
            fn()
        except _Stop as stop:
            if stop.diagnostic is not None:
                self.report(stop.diagnostic, force=True)
        except RecursionError:
            self.report(Diagnostic("nesting-limit", "this script nests too deeply to run", span=self._span,
                                   trace=self.trace, hint="flatten the blocks, or use fewer levels of `use`"),
                        force=True)

    # ---- diagnostics

    def fail(self, code: str, message: str, span: Span | None, *, hint: str | None = None,
             notes=(), labels=()) -> _Fail:
        return _Fail(Diagnostic(code, message, "error", span, tuple(labels), tuple(notes), hint, self.trace))

    def report(self, diagnostic: Diagnostic, *, force: bool = False) -> None:
        key = (diagnostic.code, diagnostic.span, diagnostic.trace)
        if key in self._seen:
            return
        self._seen.add(key)
        self.diagnostics.append(diagnostic)
        if not force and len(self.diagnostics) >= self.limits.errors:
            raise _Stop(None)

    def tick(self, span: Span) -> None:
        self.steps += 1
        self._span = span
        if self.steps > self.limits.steps:
            raise _Stop(Diagnostic(
                "loop-limit", f"this script takes more than {self.limits.steps:,} steps", span=span,
                trace=self.trace, hint="a strategy runs about once per stage and microbatch; check the loop bounds"))

    # ---- statements

    def exec_block(self, stmts, env: Env) -> None:
        for stmt in stmts:
            self.tick(stmt.span)
            try:
                _EXEC[type(stmt)](self, stmt, env)
            except _Fail as fail:
                self.report(fail.diagnostic)
                if isinstance(stmt, n.Let):
                    env.bind(stmt.name.name, Unknown(ANY_TYPE), stmt.name.span)

    def exec_let(self, stmt: n.Let, env: Env) -> None:
        name = stmt.name.name
        if env is self.top_env and self.module is self.program.main and name in self.overrides:
            env.bind(name, override_value(self.overrides[name]), stmt.name.span)
            return
        env.bind(name, self.value(stmt.value, env), stmt.name.span)

    def exec_split(self, stmt: n.Split, env: Env) -> None:
        what = stmt.what.name
        if what == "B":
            names = [p.name if isinstance(p, n.Name) else None for p in stmt.parts]
            if sorted(names, key=str) != ["BI", "BW"]:
                raise self.fail("bad-split", "`split B` cuts backward into `BI, BW` and takes nothing else",
                                stmt.span, hint="write `split B into BI, BW`")
            self.emit(Split("B", None, stmt.span))
            return
        if what != "MB":
            raise self.fail("bad-split", f"cannot split `{what}`", stmt.what.span,
                            hint=did_you_mean(what, ["MB", "B"]) or
                            "split the batch (`split MB into 8`) or backward (`split B into BI, BW`)")
        if len(stmt.parts) != 1:
            raise self.fail("wrong-arity", f"`split MB into` takes one number, got {len(stmt.parts)}",
                            stmt.parts[1].span, hint="write `split MB into 8`")
        count = self.int_of(stmt.parts[0], env, "the number of microbatches")
        if isinstance(count, int) and count < 1:
            raise self.fail("value-out-of-range", f"the number of microbatches must be at least 1, not {count}",
                            stmt.parts[0].span, hint="split the batch into 1 or more microbatches")
        if isinstance(count, int):
            self.emit(Split("MB", count, stmt.span))

    def exec_place(self, stmt: n.Place, env: Env) -> None:
        selector = self.region(stmt.selector, env)
        axis = self.axis_of(self.value(stmt.axis, env), stmt.axis.span, env, "`place ... on`")
        index = self.int_of(stmt.index, env, "a device index")
        if isinstance(index, int) and index < 0:
            raise self.fail("value-out-of-range", f"device index {index} is negative", stmt.index.span,
                            hint="indices along an axis count from 0")
        if self.mesh is None or not isinstance(axis, str) or not isinstance(index, int):
            return
        size = self.mesh.size(axis)
        if index >= size:
            raise self.fail("value-out-of-range", f"`{axis}[{index}]` is outside the mesh: axis `{axis}` has "
                            f"{size} device{'s' if size != 1 else ''}", stmt.index.span,
                            hint=f"use an index from 0 to {size - 1}, or grow the mesh")
        if selector is not None:
            self.emit(Place(selector, self.mesh[axis][index], stmt.span, self.trace))

    def exec_shard(self, stmt: n.Shard, env: Env) -> None:
        seen: dict[str, Span] = {}
        for item in stmt.what:
            if item.name not in SHARDABLE:
                raise self.fail("bad-shard", f"cannot shard `{item.name}`", item.span,
                                hint=did_you_mean(item.name, SHARDABLE) or f"shard one of {', '.join(SHARDABLE)}")
            if item.name in seen:
                raise self.fail("duplicate-name", f"`{item.name}` is listed twice", item.span,
                                labels=(Label(seen[item.name], "first listed here"),))
            seen[item.name] = item.span
        axis = self.axis_of(self.value(stmt.over, env), stmt.over.span, env, "`shard ... over`")
        if isinstance(axis, str):
            self.emit(Shard(tuple(seen), axis, stmt.span))

    def exec_for(self, stmt: n.For, env: Env) -> None:
        start = self.int_of(stmt.start, env, "a loop bound")
        stop = self.int_of(stmt.stop, env, "a loop bound")
        if self.abstract or not (isinstance(start, int) and isinstance(stop, int)):
            child = env.child()
            child.bind(stmt.var.name, Unknown(INT), stmt.var.span)
            self.exec_block(stmt.body, child)
            return
        count = stop - start
        if count > self.limits.steps - self.steps:
            raise _Stop(Diagnostic(
                "loop-limit", f"this loop runs {count:,} times; a script may take at most "
                f"{self.limits.steps:,} steps", span=stmt.span, trace=self.trace,
                hint="a strategy runs about once per stage and microbatch; check the loop bounds"))
        for i in range(start, stop):
            self.tick(stmt.span)
            child = env.child()
            child.bind(stmt.var.name, i, stmt.var.span)
            self.exec_block(stmt.body, child)

    def exec_if(self, stmt: n.If, env: Env) -> None:
        cond = self.bool_of(stmt.cond, env, "an `if` condition")
        if self.abstract or not isinstance(cond, bool):
            self.exec_block(stmt.then, env.child())
            self.exec_block(stmt.orelse, env.child())
        else:
            self.exec_block(stmt.then if cond else stmt.orelse, env.child())

    def exec_order(self, stmt: n.Order, env: Env) -> None:
        selector = self.region(stmt.selector, env)
        self._orders.append(([], []))
        try:
            self.exec_block(stmt.body, env.child())
        finally:
            slots, spans = self._orders.pop()
        if selector is not None:
            self.emit(Order(selector, tuple(slots), stmt.span, tuple(spans)))

    def exec_slots(self, stmt: n.Slots, env: Env) -> None:
        assert self._orders, "slot lines only parse inside an order block"
        slots, spans = self._orders[-1]
        # A script's slots are most of its steps (one per stage and microbatch): plain loops.
        for slot in stmt.slots:
            items, known = [], True
            for item in slot.items:
                selector = self.pass_selector(item, env)
                known &= selector is not None
                items.append(selector)
            if known:
                slots.append(tuple(items))
                spans.append(tuple([item.span for item in slot.items]))

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
                if raw is not _MISSING:
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
        return self.overrides.get(pname, _MISSING)

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
            raise _Stop(Diagnostic(
                "recursion-limit", f"`use` is nested more than {self.limits.depth} levels deep", span=site,
                trace=self.trace, hint="a strategy that uses itself needs an `if` that stops it"))
        self.module, self.trace = found.module, outer_trace + (site,)
        try:
            self.exec_block(strategy.body, inner)
        finally:
            self.module, self.trace = outer_module, outer_trace

    # ---- selectors

    def tags(self, tags, env: Env) -> tuple | None:
        """Evaluate `PP=s EP=*` to (("PP", 0), ("EP", "*")); None when a value is unknown."""
        out, seen, known = [], {}, True
        for tag in tags:
            name = tag.name.name
            if name in seen:
                raise self.fail("duplicate-name", f"tag `{name}` appears twice in this selector", tag.span,
                                labels=(Label(seen[name], "first here"),))
            seen[name] = tag.span
            if tag.value is None:
                out.append((name, ANY))
                continue
            value = self.value(tag.value, env)
            if type(value) is not int:      # `want` passes an int as it is: skip building its message
                value = self.want(value, INT, tag.value.span, env, f"the tag `{name}`")
            if isinstance(value, int) and value < 0:
                raise self.fail("value-out-of-range", f"`{name}={value}`: a tag index cannot be negative",
                                tag.value.span, hint="indices count from 0; check the arithmetic")
            known &= isinstance(value, int)
            out.append((name, value))
        return tuple(out) if known else None

    def region(self, region: n.Region, env: Env) -> Selector | None:
        tags = self.tags(region.tags, env)
        return Selector(None, tags) if tags is not None else None

    def pass_selector(self, item: n.PassSelector, env: Env) -> Selector | None:
        op = item.op.name
        if op not in PASSES:
            raise self.fail("unknown-pass", f"unknown pass `{op}`", item.op.span,
                            hint=did_you_mean(op, PASSES) or f"the passes are {', '.join(PASSES)}")
        tags = self.tags(item.tags, env)
        return Selector(op, tags) if tags is not None else None

    def emit(self, directive) -> None:
        if not self.abstract:
            self.directives.append(directive)

    # ---- expressions

    def value(self, expr, env: Env):
        """Evaluate `expr` to an int, a bool, an Axis, a FreeName or an Unknown."""
        kind = type(expr)
        if kind is n.Name:
            binding = env.lookup(expr.name)
            return FreeName(expr.name, expr.span) if binding is None else binding.value
        if kind is n.Binary:
            return self.binary(expr, env)
        if isinstance(expr, n.Int):
            if expr.value > MAX_INT:
                raise self.fail("value-out-of-range", "this number is too large", expr.span,
                                hint=f"numbers in a script stay below {MAX_INT:,}")
            return expr.value
        if isinstance(expr, n.Bool):
            return expr.value
        if isinstance(expr, n.Unary):
            if expr.op == "-":
                operand = self.int_of(expr.operand, env, "`-`")
                return -operand if isinstance(operand, int) else Unknown(INT)
            operand = self.bool_of(expr.operand, env, "`not`")
            return (not operand) if isinstance(operand, bool) else Unknown(BOOL)
        assert isinstance(expr, n.Call), expr
        return self.builtin(expr, env)

    def binary(self, expr: n.Binary, env: Env):
        op = expr.op
        if op in ("and", "or"):
            left = self.bool_of(expr.left, env, f"`{op}`")
            if isinstance(left, bool) and not self.abstract and left == (op == "or"):
                return left  # short-circuit, as in Python: `m > 0 and x // m > 1`
            right = self.bool_of(expr.right, env, f"`{op}`")
            if isinstance(left, bool) and isinstance(right, bool):
                return right
            return Unknown(BOOL)
        if op in ("==", "!="):
            left, right = self.value(expr.left, env), self.value(expr.right, env)
            lt, rt = type_of(left), type_of(right)
            for side, other, where in ((left, rt, expr.left.span), (right, lt, expr.right.span)):
                if isinstance(side, FreeName) and other not in (AXIS, ANY_TYPE):
                    self.want(side, other, where, env, f"`{op}`")  # an unknown name, most likely
            if ANY_TYPE not in (lt, rt) and lt != rt:
                raise self.fail("wrong-type", f"`{op}` compares {TYPE_WORDS[lt]} with {TYPE_WORDS[rt]}",
                                expr.span, hint="compare values of the same kind")
            if lt == AXIS and rt == AXIS:
                left = self.axis_of(left, expr.left.span, env, f"`{op}`")
                right = self.axis_of(right, expr.right.span, env, f"`{op}`")
            if isinstance(left, Unknown) or isinstance(right, Unknown):
                return Unknown(BOOL)
            return (left == right) == (op == "==")
        # `int_of`, without building the message for the ints `want` passes as they are
        left = self.value(expr.left, env)
        if type(left) is not int:
            left = self.want(left, INT, expr.left.span, env, f"`{op}`")
        right = self.value(expr.right, env)
        if type(right) is not int:
            right = self.want(right, INT, expr.right.span, env, f"`{op}`")
        if op in ("//", "%") and right == 0 and not isinstance(right, bool):
            raise self.fail("division-by-zero", f"`{op}` by zero", expr.right.span,
                            hint="guard it with `if`, or use `max(x, 1)`")
        if not (isinstance(left, int) and isinstance(right, int)):
            return Unknown(BOOL if op in ("<", "<=", ">", ">=") else INT)
        result = _OPERATORS[op](left, right)
        if type(result) is int and not -MAX_INT <= result <= MAX_INT:
            raise self.fail("value-out-of-range", f"this computes {show(result)[:24]}..., which is too large",
                            expr.span, hint=f"numbers in a script stay below {MAX_INT:,}")
        return result

    def builtin(self, expr: n.Call, env: Env):
        func = expr.func.name
        if func not in BUILTINS:
            raise self.fail("unknown-name", f"unknown function `{func}`", expr.func.span,
                            hint=did_you_mean(func, BUILTINS) or "the functions are min, max and size")
        if func == "size":
            if len(expr.args) != 1:
                raise self.fail("wrong-arity", f"`size` takes one mesh axis, got {len(expr.args)} arguments",
                                expr.span, hint="write e.g. `size(pp)`")
            axis = self.axis_of(self.value(expr.args[0], env), expr.args[0].span, env, "`size`")
            if self.mesh is None or not isinstance(axis, str):
                return Unknown(INT)
            return self.mesh.size(axis)
        if len(expr.args) < 2:
            raise self.fail("wrong-arity", f"`{func}` takes two or more integers, got {len(expr.args)}",
                            expr.span, hint=f"write e.g. `{func}(a, b)`")
        values = [self.int_of(arg, env, f"`{func}`") for arg in expr.args]
        if not all(isinstance(v, int) for v in values):
            return Unknown(INT)
        return min(values) if func == "min" else max(values)

    # ---- types

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
            raise self.fail("wrong-type", f"{what} needs {TYPE_WORDS[wanted]}, but got `{value.name}`", span)
        if isinstance(value, FreeName) and not (self.mesh and value.name in self.mesh.names):
            raise self.unknown_name(value, env)
        got = type_of(value)
        hint = f"`size({show(value)})` is the number of devices along it" \
            if got == AXIS and wanted == INT else None
        shown = f"`{show(value)}` is {TYPE_WORDS[got]}" if not isinstance(value, Unknown) else \
            f"this is {TYPE_WORDS[got]}"
        raise self.fail("wrong-type", f"{what} needs {TYPE_WORDS[wanted]}, but {shown}", span, hint=hint)

    def unknown_name(self, value: FreeName, env: Env) -> _Fail:
        close = did_you_mean(value.name, env.names() + list(self.mesh.names if self.mesh else ()))
        notes = () if self.mesh or close else (f"if `{value.name}` is a mesh axis, `size({value.name})` is its "
                                               "number of devices",)
        return self.fail("unknown-name", f"unknown name `{value.name}`", value.span, notes=notes,
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
        where = value.span if isinstance(value, FreeName) and value.span is not None else span
        if not self.mesh.names:
            raise self.fail("unknown-axis", f"the mesh has no axis `{name}`: this script has no mesh", where,
                            hint=f"declare one, e.g. `mesh {name}=2`, or pass --mesh {name}=2")
        variables = [v for v in env.names() if type_of(env.lookup(v).value) in (AXIS, ANY_TYPE)]
        raise self.fail("unknown-axis", f"the mesh has no axis `{name}`", where,
                        notes=(f"the mesh is {self.mesh}",),
                        hint=did_you_mean(name, list(self.mesh.names) + variables)
                        or f"the axes are {', '.join(self.mesh.names)}; add `{name}` to the mesh")


_MISSING = object()
_OPERATORS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod,
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}

_EXEC = {
    n.Let: Interpreter.exec_let,
    n.Split: Interpreter.exec_split,
    n.Place: Interpreter.exec_place,
    n.Shard: Interpreter.exec_shard,
    n.For: Interpreter.exec_for,
    n.If: Interpreter.exec_if,
    n.Order: Interpreter.exec_order,
    n.Slots: Interpreter.exec_slots,
    n.Use: Interpreter.exec_use,
}
