"""The .pps statements that shape a run rather than record anything: `let`, `for` and `if`.

Mixed into `Interpreter`. Abstract mode (the checker) runs every loop body once
and both arms of every `if`, so every line is checked even where a real run would not go.
"""
from __future__ import annotations

from piper.diagnostics import Diagnostic

from . import nodes as n
from .outcomes import Stop
from .slot_loops import run_slot_loop
from .values import INT, Env, Unknown, override_value


class ControlFlow:
    """`let`, `for`, `if`; needs `exec_block`, the type checks and the run's limits."""

    def exec_let(self, stmt: n.Let, env: Env) -> None:
        name = stmt.name.name
        if env is self.top_env and self.module is self.program.main and name in self.overrides:
            env.bind(name, override_value(self.overrides[name]), stmt.name.span)
            return
        env.bind(name, self.value(stmt.value, env), stmt.name.span)

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
            raise Stop(Diagnostic(
                "loop-limit", f"this loop runs {count:,} times; a script may take at most "
                f"{self.limits.steps:,} steps", span=stmt.span, trace=self.trace,
                hint="a strategy runs about once per stage and microbatch; check the loop bounds"))
        if run_slot_loop(self, stmt, env, start, stop):     # a schedule's loop over one slot line
            return
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
