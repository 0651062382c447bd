"""The .pps interpreter: walks the syntax tree and records directives with their spans.

Concrete mode runs a script against a mesh, as `Script.build` does, and
produces exactly the records of `piper.frontend.directives` that the Python API makes.
Abstract mode (the checker) runs each strategy once with its parameters
unknown: every loop body once, both arms of every `if`, and no `use` entered,
so every line is checked for names, types and arity even where a real run
would not go. Scripts are data: the only effects are the records and the
diagnostics, and `Limits` bound the work a hostile script can ask for.

Each kind of statement is one method, in the module named for what it does
(control_flow: let, for, if; directive_statements: split, place, shard, order;
strategy_calls and arguments: use); `_EXEC` below maps each node type to its method.
"""
from __future__ import annotations

from piper.diagnostics import Diagnostic, Label, Span, did_you_mean
from piper.mesh import Mesh
from piper.frontend.selectors import Selector

from . import nodes as n
from .arguments import MISSING, Arguments
from .control_flow import ControlFlow
from .directive_statements import DirectiveStatements
from .expressions import Expressions
from .outcomes import Fail, Outcomes, Stop
from .program import Found, Program
from .region_selectors import RegionSelectors
from .strategy_calls import StrategyCalls
from .type_checks import TypeChecks
from .work import Weights
from .values import ANY_TYPE, AXIS, TYPES, Env, FreeName, Limits, Unknown, override_value, param_type


# The pieces share one run's state (mesh, module, trace, records), so they are mixins
# reading `self` rather than objects handing that state to each other on every call.
class Interpreter(ControlFlow, DirectiveStatements, StrategyCalls, Arguments, RegionSelectors, Expressions,
                  TypeChecks, Outcomes):
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
        self.work = 0                     # terms evaluated: `Limits.work`
        self.weights = Weights()
        self.top_env: Env | None = None
        self._seen: set = set()
        self._orders: list[tuple[list, list]] = []
        self._span: Span | None = None
        self.selectors: dict[tuple, Selector] = {}      # (op, tags) -> the one Selector made for them
        self.spans_of_slots: dict[int, tuple] = {}       # id(a slot line's slot) -> (the slot, its items' spans)

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
                if raw is not MISSING:
                    given[param.name.name] = (override_value(raw), site, True)
            try:
                self.call(found, given, site, Env())
            except Fail as fail:
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
                except Fail as fail:
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
        except Stop as stop:
            if stop.diagnostic is not None:
                self.report(stop.diagnostic, force=True)
        except RecursionError:
            self.report(Diagnostic("nesting-limit", "this script nests too deeply to run", span=self._span,
                                   trace=self.trace, hint="flatten the blocks, or use fewer levels of `use`"),
                        force=True)

    # ---- statements

    def exec_block(self, stmts, env: Env) -> None:
        for stmt in stmts:
            self.tick(stmt.span, self.weights(stmt))
            try:
                _EXEC[type(stmt)](self, stmt, env)
            except Fail as fail:
                self.report(fail.diagnostic)
                if isinstance(stmt, n.Let):
                    env.bind(stmt.name.name, Unknown(ANY_TYPE), stmt.name.span)


# One row per kind of statement, so a new statement is one method and one row here.
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
    n.Recompute: Interpreter.exec_recompute,
}
