"""Evaluates the selectors of `place`, `order` and slot lines: `[PP=s EP=*]` and `F[PP=s, MB=m]`.

Mixed into `Interpreter`.
"""
from __future__ import annotations

from piper.diagnostics import Label, did_you_mean
from piper.selectors import ANY, PASSES, Selector

from . import nodes as n
from .values import INT, Env


class RegionSelectors:
    """Tags to `Selector`s; None wherever a tag's value is unknown (abstract mode, unknown parameters)."""

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
