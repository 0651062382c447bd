"""Evaluates the selectors of `place`, `order` and slot lines: `[PP=s EP=*]` and `F[PP=s, MB=m]`.

Mixed into `Interpreter`.
"""
from __future__ import annotations

from piper.diagnostics import Label, did_you_mean
from piper.frontend.selectors import ANY, PASSES, Selector

from . import nodes as n
from .values import INT, MAX_TAG_INDEX, Env, show


class RegionSelectors:
    """Tags to `Selector`s; None wherever a tag's value is unknown (abstract mode, unknown parameters)."""

    def tags(self, tags, env: Env) -> tuple | None:
        """Evaluate `PP=s EP=*` to (("PP", 0), ("EP", "*")); None when a value is unknown."""
        if len(tags) == 1 and tags[0].value is not None:      # `MB=m + warm`: most of a schedule's steps
            value = self.tag_value(tags[0], env)
            return ((tags[0].name.name, value),) if isinstance(value, int) else None
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
            value = self.tag_value(tag, env)
            known &= isinstance(value, int)
            out.append((name, value))
        return tuple(out) if known else None

    def tag_value(self, tag, env: Env):
        """The index of `NAME=expr`: a non-negative int, or an Unknown (abstract mode)."""
        value = self.value(tag.value, env)
        if type(value) is not int:      # `want` passes an int as it is: skip building its message
            value = self.want(value, INT, tag.value.span, env, f"the tag `{tag.name.name}`")
        if isinstance(value, int) and not 0 <= value <= MAX_TAG_INDEX:
            if value < 0:
                raise self.fail("value-out-of-range", f"`{tag.name.name}={value}`: a tag index cannot be negative",
                                tag.value.span, hint="indices count from 0; check the arithmetic")
            raise self.fail("value-out-of-range", f"`{tag.name.name}={show(value)[:24]}`: a tag index is at most "
                            f"{MAX_TAG_INDEX:,}", tag.value.span,
                            hint=f"a model has fewer than {MAX_TAG_INDEX + 1:,} regions and a step fewer "
                                 f"microbatches; check the arithmetic")
        return value

    def region(self, region: n.Region, env: Env) -> Selector | None:
        tags = self.tags(region.tags, env)
        return Selector(None, tags) if tags is not None else None

    def pass_selector(self, item: n.PassSelector, env: Env) -> Selector | None:
        op = item.op.name
        if op not in PASSES:
            raise self.fail("unknown-pass", f"unknown pass `{op}`", item.op.span,
                            hint=did_you_mean(op, PASSES) or f"the passes are {', '.join(PASSES)}")
        # A schedule names each pass of each microbatch once per stage: the (frozen) selectors repeat,
        # and are made once per run. One tag with a value (`F(MB=m + warm)`) is keyed flat.
        tags = item.tags
        if len(tags) == 1 and tags[0].value is not None:
            value = self.tag_value(tags[0], env)
            if not isinstance(value, int):
                return None
            key = (op, tags[0].name.name, value)
            selector = self.selectors.get(key)
            if selector is None:
                selector = self.selectors[key] = Selector(op, ((tags[0].name.name, value),))
            return selector
        tags = self.tags(tags, env)
        if tags is None:
            return None
        selector = self.selectors.get((op, tags))
        if selector is None:
            selector = self.selectors[(op, tags)] = Selector(op, tags)
        return selector
