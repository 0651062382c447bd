"""Values of the language and the names that hold them: int, bool, Axis, and two only the checker needs.

    >>> override_value("8"), override_value("true"), override_value("dp").name
    (8, True, 'dp')
"""
from __future__ import annotations

from dataclasses import dataclass

from piper.diagnostics import Span, clip

from . import nodes as n

INT, BOOL, AXIS, ANY_TYPE = "int", "bool", "axis", "any"
TYPES = (INT, BOOL, AXIS)
BUILTINS = ("min", "max", "size")
# Numbers stay far inside 64 bits, so no script builds a huge integer.
MAX_INT = 2**62
# The counts a script sets, each checked before the work it sizes begins. The largest real schedules
# (the stdlib's at 64 stages x 512 microbatches) stay inside them; a script past them ends with
# `value-out-of-range` rather than running on.
MAX_MICROBATCHES = 4096       # `split MB into N`
MAX_TAG_INDEX = 4095          # a tag's index (`PP=r`, `MB=m`): 4,096 regions (planning them takes ~2 s) or microbatches
TYPE_WORDS = {INT: "an integer", BOOL: "a boolean (true or false)", AXIS: "a mesh axis", ANY_TYPE: "a value"}


@dataclass(frozen=True)
class Limits:
    """What one run may take: statements plus loop iterations, the terms they evaluate
    (`dsl.work`), `use` depth, errors kept. At the step or the work limit a run has taken about
    2 s of CPU (about 5 µs a step, 1 µs a term), so `piper check` stays within 5 s with the
    planning of what it made (piper/ir/size.py) on top."""

    steps: int = 400_000
    work: int = 2_000_000
    depth: int = 64
    errors: int = 100
    failures: int = 1000      # statements that fail, repeats of one diagnostic included


# ---- values: int, bool, Axis, and two the checker needs


@dataclass(frozen=True)
class Axis:
    """A mesh axis name held in a variable (`axis = pp`)."""

    name: str


@dataclass(frozen=True)
class FreeName:
    """A name bound to nothing: it means a mesh axis where one is expected, else it is unknown."""

    name: str
    span: Span | None


@dataclass(frozen=True)
class Unknown:
    """A value the checker cannot know (an unbound parameter, or the result of an error)."""

    type: str


def type_of(value) -> str:
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        return INT
    if isinstance(value, (Axis, FreeName)):
        return AXIS
    assert isinstance(value, Unknown), value
    return value.type


def show(value) -> str:
    """`value` as a message quotes it (a long name cut, `piper.diagnostics.clip`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (Axis, FreeName)):
        return clip(value.name)
    return str(value)


@dataclass
class _Binding:
    value: object
    span: Span | None


class Env:
    """Names in scope: a chain of blocks. A strategy starts a fresh chain."""

    def __init__(self, parent: "Env | None" = None):
        self.parent = parent
        self.vars: dict[str, _Binding] = {}

    def lookup(self, name: str) -> _Binding | None:
        env = self
        while env is not None:
            if name in env.vars:
                return env.vars[name]
            env = env.parent
        return None

    def bind(self, name: str, value, span: Span | None) -> None:
        self.vars[name] = _Binding(value, span)

    def child(self) -> "Env":
        return Env(self)

    def names(self) -> list[str]:
        out, env = [], self
        while env is not None:
            out.extend(env.vars)
            env = env.parent
        return out


def override_value(raw):
    """A `--set` value as a script value: 8 -> 8, "8" -> 8, "true" -> True, "dp" -> FreeName."""
    if isinstance(raw, (bool, int)):
        return raw
    if isinstance(raw, Axis):
        return raw
    text = str(raw).strip()
    if text.lstrip("-").isdigit() and len(text) < 30:
        return int(text)
    if text in ("true", "false"):
        return text == "true"
    return FreeName(text, None)


def param_type(param: n.Param, names: set[str] = frozenset()) -> str:
    """The declared type, or the one its default shows (`axis = pp` is an axis), or "any".

    Raises nothing: an unknown declared type is reported by the checker and read as "any".
    """
    if param.type is not None:
        return param.type.name if param.type.name in TYPES else ANY_TYPE
    default = param.default
    if isinstance(default, n.Int) or (isinstance(default, n.Unary) and default.op == "-"):
        return INT
    if isinstance(default, n.Bool):
        return BOOL
    if isinstance(default, n.Name) and default.name not in names:
        return AXIS
    return ANY_TYPE
