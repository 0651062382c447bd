"""The loops that make most of a schedule, run without the general interpreter.

A stdlib schedule's order block is mostly `for m in a..b:` over `let`s and slot
lines of passes (`F(MB=m + warm); B(MB=m)`, or an interleaved schedule's
`let chunk = k // per_round % virtual` then `F(PP=s + p * chunk, MB=...)`), run
once per stage and microbatch: 65k items at 64 stages x 512 microbatches. The
general way evaluates each tag through the expression evaluator and binds a
scope per iteration. Here the loop's `let`s and tags become one Python function
of the loop variable, made once per loop, with the names read from outside the
loop looked up once.

Whatever this does not cover goes the general way, which also reports what is
wrong: a body of anything but `let`s and slot lines, an expression
of anything but names, ints, `+ - * // %`, a name from outside that is not an
int, a division by zero, a value below 0 or beyond the script's limits, a tag
twice in an item, the step or work limit. Nothing is recorded before the whole loop has
gone through.
"""
from __future__ import annotations

from piper.frontend.selectors import ANY, PASSES, Selector

from . import nodes as n
from .values import MAX_INT, MAX_TAG_INDEX, Env

_OPERATORS = ("+", "-", "*", "//", "%")


class _General(Exception):
    """This loop takes the general way."""


def run_slot_loop(interp, stmt: n.For, env: Env, start: int, stop: int) -> bool:
    """Run `for` loop `stmt` over `start..stop` if its body is what this covers; False (and
    nothing done) where it is not."""
    body = stmt.body
    kinds = set(map(type, body))
    if n.Slots not in kinds or not kinds <= {n.Let, n.Slots} or not interp._orders:
        return False
    count = stop - start
    work = (1 + sum(map(interp.weights, body))) * count      # the loop's turn and each line's terms
    if count <= 0 or interp.steps + (1 + len(body)) * count > interp.limits.steps \
            or interp.work + work > interp.limits.work:
        return False
    try:
        values, items = _compiled(stmt, env, interp.__dict__.setdefault("_slot_code", {}))
        made = _slots(interp.selectors, values, items, range(start, stop))
    except (_General, ZeroDivisionError):
        return False
    slots, slot_spans = interp._orders[-1]
    slots += made
    slot_spans += [interp.slot_spans(slot) for line in body if type(line) is n.Slots for slot in line.slots] * count
    interp.steps += (1 + len(body)) * count       # the loop's step and each statement's, each time round
    interp.work += work
    interp._span = body[-1].span
    return True


def _slots(selectors: dict, values, items: list[list[tuple]], loop: range) -> list[tuple]:
    """Each slot's selectors, for each value of the loop variable in turn. `values(i)`: every
    tag's value, item after item; `items`: per slot, each item's (pass, tag names, whether
    it is one tag with a value)."""
    made = []
    for i in loop:
        tags = iter(values(i))
        for slot in items:
            chosen = []
            for op, names, flat in slot:
                if flat:                    # one tag with a value: keyed flat, as `pass_selector` keys it
                    v = next(tags)
                    if not 0 <= v <= MAX_TAG_INDEX:
                        raise _General
                    key = (op, names[0], v)
                    selector = selectors.get(key)
                    if selector is None:      # made once per run, as `pass_selector` does
                        selector = selectors[key] = Selector(op, ((names[0], v),))
                else:
                    pairs = tuple((name, next(tags)) for name in names)
                    if any(v != ANY and not 0 <= v <= MAX_TAG_INDEX for _, v in pairs):
                        raise _General
                    selector = selectors.get((op, pairs))
                    if selector is None:
                        selector = selectors[(op, pairs)] = Selector(op, pairs)
                chosen.append(selector)
            made.append(tuple(chosen))
    return made


def _compiled(stmt: n.For, env: Env, cache: dict):
    """One function of the loop variable giving every tag's value of the slot line (its `let`s
    computed first), and per slot each item's (pass, tag names, whether it is one tag with a value).

    The Python code depends on the loop's text alone, so it is compiled once per loop and run (`cache`:
    id of the loop -> the code, the items and the outside names it reads, or None for the general
    way); only the outside names' values are looked up again each time the loop runs."""
    if id(stmt) in cache:
        made = cache[id(stmt)]
        if made is None:
            raise _General
        compiled, items, outside = made
        scope = {"_c": _checked}
        for constant, name in outside:
            binding = env.lookup(name)
            if binding is None or type(binding.value) is not int:
                raise _General
            scope[constant] = binding.value
        exec(compiled, scope)
        return scope["values"], items
    try:
        made = _compile(stmt, env)
    except _General:
        cache[id(stmt)] = None
        raise
    cache[id(stmt)] = made
    compiled, items, outside = made
    scope = {"_c": _checked, **{constant: env.lookup(name).value for constant, name in outside}}
    exec(compiled, scope)
    return scope["values"], items


def _compile(stmt: n.For, env: Env):
    """`_compiled`'s code, made: (the code object, the items, the (constant, name) of each outside name)."""
    code = _Code(env)
    code.bind(stmt.var.name, "i")
    lines, items, tags = [], [], []
    for statement in stmt.body:
        if type(statement) is n.Let:
            value = code.expression(statement.value)
            lines.append(f"    {code.bind(statement.name.name)} = {value}")
            continue
        for slot in statement.slots:
            items.append([])
            for item in slot.items:
                names = tuple(tag.name.name for tag in item.tags)
                if item.op.name not in PASSES or not names or len(set(names)) != len(names):
                    raise _General
                items[-1].append((item.op.name, names, len(names) == 1 and item.tags[0].value is not None))
                values = [repr(ANY) if tag.value is None else code.expression(tag.value) for tag in item.tags]
                # A tag's value is taken where its line runs: a later `let` may bind the same name again.
                for value in values:
                    lines.append(f"    t{len(tags)} = {value}")
                    tags.append(f"t{len(tags)}")
    source = "def values(i):\n" + "".join(line + "\n" for line in lines) + f"    return ({', '.join(tags)},)\n"
    return compile(source, "<slot loop>", "exec"), items, tuple(code.names.items())


class _Code:
    """Python source for `.pps` expressions: the loop's names as locals, outside names as
    constants looked up once, each arithmetic result checked against the script's limit."""

    def __init__(self, env: Env):
        self.env = env
        self.local: dict[str, str] = {}          # a name bound in the loop -> its Python local
        self.constants: dict[str, int] = {}
        self.names: dict[str, str] = {}           # a constant -> the outside name it holds

    def bind(self, name: str, local: str | None = None) -> str:
        self.local[name] = local or f"v{len(self.local)}"
        return self.local[name]

    def expression(self, expr) -> str:
        kind = type(expr)
        if kind is n.Name:
            if expr.name in self.local:
                return self.local[expr.name]
            binding = self.env.lookup(expr.name)
            if binding is None or type(binding.value) is not int:
                raise _General
            constant = f"k{len(self.constants)}"
            self.constants[constant] = binding.value
            self.names[constant] = expr.name
            return constant
        if kind is n.Int:
            if type(expr.value) is not int or expr.value > MAX_INT:
                raise _General
            return repr(expr.value)
        if kind is n.Binary and expr.op in _OPERATORS:
            return f"_c({self.expression(expr.left)} {expr.op} {self.expression(expr.right)})"
        raise _General


def _checked(value: int) -> int:
    """An arithmetic result, if the script's numbers may hold it (else the general way says so)."""
    if -MAX_INT <= value <= MAX_INT:
        return value
    raise _General
