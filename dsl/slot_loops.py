"""The loops that make most of a schedule, run without the general interpreter.

A stdlib schedule's order block is mostly `for m in a..b:` over one slot line of
passes with one tag each (`F(MB=m + warm); B(MB=m)`), run once per stage and
microbatch: 65k items at 64 stages x 512 microbatches. The general way
evaluates each tag through the expression evaluator and binds a scope per
iteration. Here each tag's expression becomes one Python function of the loop
variable, with the names it reads from outside the loop looked up once.

Whatever this does not cover goes the general way, which also reports what is
wrong: a body that is not one slot line, an item that is not `PASS(NAME=expr)`,
an expression of anything but names, ints, `+`, `-` and `*`, a name that is not
an int, a value below 0 or above the script's limit, the step limit. Nothing is
recorded before the whole loop has gone through.
"""
from __future__ import annotations

import operator

from piper.frontend.selectors import PASSES, Selector

from . import nodes as n
from .values import MAX_INT, Env

_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class _General(Exception):
    """This loop takes the general way."""


def run_slot_loop(interp, stmt: n.For, env: Env, start: int, stop: int) -> bool:
    """Run `for` loop `stmt` over `start..stop` if its body is one slot line this covers; False
    (and nothing done) where it is not."""
    body = stmt.body
    if len(body) != 1 or type(body[0]) is not n.Slots or not interp._orders:
        return False
    count = stop - start
    if count <= 0 or interp.steps + 2 * count > interp.limits.steps:
        return False
    line = body[0]
    try:
        items = [[_item(item, stmt.var.name, env) for item in slot.items] for slot in line.slots]
        made = _slots(interp.selectors, items, range(start, stop))
    except _General:
        return False
    spans = [interp.slot_spans(slot) for slot in line.slots] * count
    slots, slot_spans = interp._orders[-1]
    slots += made
    slot_spans += spans
    interp.steps += 2 * count         # the loop's step and its line's, each time round
    interp._span = line.span
    return True


def _slots(selectors: dict, items: list[list[tuple]], values: range) -> list[tuple]:
    """Each slot's selectors, for each value of the loop variable in turn."""
    made = []
    for i in values:
        for slot in items:
            chosen = []
            for op, name, value in slot:
                v = value(i)
                if v < 0:
                    raise _General
                key = (op, name, v)
                selector = selectors.get(key)
                if selector is None:      # made once per run, as `pass_selector` does
                    selector = selectors[key] = Selector(op, ((name, v),))
                chosen.append(selector)
            made.append(tuple(chosen))
    return made


def _item(item: n.PassSelector, var: str, env: Env) -> tuple:
    """(pass, tag name, its value as a function of the loop variable) of `PASS(NAME=expr)`."""
    if item.op.name not in PASSES or len(item.tags) != 1 or item.tags[0].value is None:
        raise _General
    return item.op.name, item.tags[0].name.name, _function(item.tags[0].value, var, env)


def _function(expr, var: str, env: Env):
    """`expr` as a function of the loop variable."""
    kind = type(expr)
    if kind is n.Name:
        if expr.name == var:
            return _identity
        binding = env.lookup(expr.name)
        if binding is None or type(binding.value) is not int:
            raise _General
        return _constant(binding.value)
    if kind is n.Int:
        if type(expr.value) is not int or expr.value > MAX_INT:
            raise _General
        return _constant(expr.value)
    if kind is n.Binary and expr.op in _OPERATORS:
        return _binary(_OPERATORS[expr.op], _function(expr.left, var, env), _function(expr.right, var, env))
    raise _General


def _identity(i: int) -> int:
    return i


def _constant(value: int):
    return lambda i: value


def _binary(op, left, right):
    def value(i: int) -> int:
        result = op(left(i), right(i))
        if -MAX_INT <= result <= MAX_INT:
            return result
        raise _General
    return value
