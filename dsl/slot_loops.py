"""The loops that make most of a schedule, run without the general interpreter.

A stdlib schedule's order block is mostly `for m in a..b:` over `let`s and slot
lines of passes (`F(MB=m + warm); B(MB=m)`, or an interleaved schedule's
`let chunk = k // per_round % virtual` then `F(PP=s + p * chunk, MB=...)`, or
ZBV's and DualPipeV's `if i < microbatches: F(PP=up, MB=i)`), run once per
stage and microbatch: 65k items at 64 stages x 512 microbatches. The
general way evaluates each tag through the expression evaluator and binds a
scope per iteration. Here the loop's `let`s and tags become one Python function
of the loop variable, made once per loop, with the names read from outside the
loop looked up once.

Whatever this does not cover goes the general way, which also reports what is
wrong: a body of anything but `let`s, slot lines and `if`s (without `else if`) whose
arms hold slot lines only, an expression of anything but names, ints, `+ - * // %`
(and, in an `if`'s condition, comparisons, `and`, `or`, `not`), a name from outside that is not an
int, a division by zero, a value below 0 or beyond the script's limits, a tag
twice in an item, the step or work limit. Nothing is recorded before the whole loop has
gone through.
"""
from __future__ import annotations

from piper.frontend.selectors import ANY, PASSES, Selector

from . import nodes as n
from .values import MAX_INT, MAX_TAG_INDEX, Env

_OPERATORS = ("+", "-", "*", "//", "%")
_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")


class _General(Exception):
    """This loop takes the general way."""


def run_slot_loop(interp, stmt: n.For, env: Env, start: int, stop: int) -> bool:
    """Run `for` loop `stmt` over `start..stop` if its body is what this covers; False (and
    nothing done) where it is not."""
    body = stmt.body
    shape = _shape(body)
    if shape is None or not interp._orders:
        return False
    count = stop - start
    steps, work, (branch_steps, branch_work) = (1 + len(body)), 1 + sum(map(interp.weights, body)), shape(interp)
    # The most the loop can take, every `if` taking its larger arm: past the limits, the general way
    # runs it and says where it stopped.
    if count <= 0 or interp.steps + (steps + branch_steps) * count > interp.limits.steps \
            or interp.work + (work + branch_work) * count > interp.limits.work:
        return False
    try:
        values, lines = _compiled(stmt, env, interp.__dict__.setdefault("_slot_code", {}))
        made, spans, armed = _slots(interp.selectors, values, lines, range(start, stop), interp)
    except (_General, ZeroDivisionError):
        return False
    slots, slot_spans = interp._orders[-1]
    slots += made
    slot_spans += spans
    interp.steps += steps * count + armed[0]     # the loop's step and each statement's, each time round
    interp.work += work * count + armed[1]
    interp._span = body[-1].span
    return True


def _shape(body):
    """None where the loop's body is not `let`s, slot lines and `if`s of slot lines; else a
    function of the interpreter giving the most (steps, terms) the `if`s' arms add per turn."""
    kinds = set(map(type, body))
    if not kinds <= {n.Let, n.Slots, n.If} or not kinds & {n.Slots, n.If}:
        return None
    arms = [(s.then, s.orelse) for s in body if type(s) is n.If]
    if any(type(line) is not n.Slots for pair in arms for arm in pair for line in arm):
        return None

    def most(interp):
        steps = sum(max(len(arm) for arm in pair) for pair in arms)
        work = sum(max(sum(map(interp.weights, arm)) for arm in pair) for pair in arms)
        return steps, work
    return most


def _slots(selectors: dict, values, lines: list, loop: range, interp) -> tuple[list, list, tuple]:
    """Each slot's selectors, for each value of the loop variable in turn, their spans, and the
    (steps, terms) of the lines run inside `if`s. `values(i)`: per slot line run, its number
    and every tag's value, item after item; `lines`: per slot line, its slots' items (pass,
    tag names, whether it is one tag with a value), its spans, and whether it sits in an `if`."""
    made, spans, steps, work = [], [], 0, 0
    shown = [[interp.slot_spans(slot) for slot in line.slots] for line, _, _ in lines]
    costs = [interp.weights(line) for line, _, _ in lines]
    for i in loop:
        for number, values_of_line in values(i):
            line, items, nested = lines[number]
            if nested:
                steps += 1
                work += costs[number]
            tags = iter(values_of_line)
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
            spans += shown[number]
    return made, spans, (steps, work)


def _compiled(stmt: n.For, env: Env, cache: dict):
    """One function of the loop variable giving, per slot line run, its number and every tag's
    value (its `let`s computed first, its `if`s taken as they fall), and per slot line (the line,
    each slot's items (pass, tag names, whether it is one tag with a value), whether it sits in
    an `if`).

    The Python code depends on the loop's text alone, so it is compiled once per loop and run (`cache`:
    id of the loop -> the code, the lines and the outside names it reads, or None for the general
    way); only the outside names' values are looked up again each time the loop runs."""
    if id(stmt) in cache:
        made = cache[id(stmt)]
        if made is None:
            raise _General
        compiled, lines, outside = made
        scope = {"_c": _checked}
        for constant, name in outside:
            binding = env.lookup(name)
            if binding is None or type(binding.value) is not int:
                raise _General
            scope[constant] = binding.value
        exec(compiled, scope)
        return scope["values"], lines
    try:
        made = _compile(stmt, env)
    except _General:
        cache[id(stmt)] = None
        raise
    cache[id(stmt)] = made
    compiled, lines, outside = made
    scope = {"_c": _checked, **{constant: env.lookup(name).value for constant, name in outside}}
    exec(compiled, scope)
    return scope["values"], lines


def _compile(stmt: n.For, env: Env):
    """`_compiled`'s code, made: (the code object, the lines, the (constant, name) of each outside name)."""
    code = _Code(env)
    code.bind(stmt.var.name, "i")
    source, lines = ["def values(i):", "    out = []"], []

    def slot_line(statement: n.Slots, indent: str, nested: bool) -> None:
        items, tags = [], []
        for slot in statement.slots:
            items.append([])
            for item in slot.items:
                names = tuple(tag.name.name for tag in item.tags)
                if item.op.name not in PASSES or not names or len(set(names)) != len(names):
                    raise _General
                items[-1].append((item.op.name, names, len(names) == 1 and item.tags[0].value is not None))
                tags += [repr(ANY) if tag.value is None else code.expression(tag.value) for tag in item.tags]
        # A tag's value is taken where its line runs: a later `let` may bind the same name again.
        source.append(f"{indent}out.append(({len(lines)}, ({', '.join(tags)},)))")
        lines.append((statement, items, nested))

    for statement in stmt.body:
        if type(statement) is n.Let:
            value = code.expression(statement.value)
            source.append(f"    {code.bind(statement.name.name)} = {value}")
        elif type(statement) is n.Slots:
            slot_line(statement, "    ", False)
        else:
            source.append(f"    if {code.condition(statement.cond)}:")
            for arm in (statement.then, statement.orelse):
                if arm is statement.orelse:
                    source.append("    else:")
                source.append("        pass")
                for line in arm:
                    slot_line(line, "        ", True)
    source.append("    return out")
    return compile("\n".join(source) + "\n", "<slot loop>", "exec"), lines, tuple(code.names.items())


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

    def condition(self, expr) -> str:
        """An `if`'s condition: comparisons of integer expressions, joined by `and`, `or`, `not`
        (short-circuit, as the general way runs them outside the checker)."""
        kind = type(expr)
        if kind is n.Binary and expr.op in _COMPARISONS:
            return f"({self.expression(expr.left)} {expr.op} {self.expression(expr.right)})"
        if kind is n.Binary and expr.op in ("and", "or"):
            return f"({self.condition(expr.left)} {expr.op} {self.condition(expr.right)})"
        if kind is n.Unary and expr.op == "not":
            return f"(not {self.condition(expr.operand)})"
        if kind is n.Bool:
            return repr(bool(expr.value))
        raise _General


def _checked(value: int) -> int:
    """An arithmetic result, if the script's numbers may hold it (else the general way says so)."""
    if -MAX_INT <= value <= MAX_INT:
        return value
    raise _General
