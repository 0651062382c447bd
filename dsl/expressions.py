"""Evaluates .pps expressions: names, numbers, `not`/`-`, arithmetic, comparisons, `and`/`or`, min/max/size.

Mixed into `Interpreter`; a value is an int, a bool, an Axis, a FreeName or an Unknown (abstract mode).
"""
from __future__ import annotations

import operator

from piper.diagnostics import did_you_mean

from . import nodes as n
from .values import ANY_TYPE, AXIS, BOOL, BUILTINS, INT, MAX_INT, TYPE_WORDS, Env, FreeName, Unknown, show, type_of

_OPERATORS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod,
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


class Expressions:
    """`value` and its helpers; needs the type checks (`int_of`, `want`, `axis_of`) and `fail`."""

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
