"""Selectors: the one syntax, shared by the Python API and the language, that
picks regions (`PP=1`, `PP=1 EP=*`) and compute nodes (`F(MB=0)`, `BW(PP=2, MB=3)`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..diagnostics import Span, error

PASSES = ("F", "B", "BI", "BW", "UPD")
ANY = "*"

_TAG = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\*|-?\d+)\s*")


@dataclass(frozen=True)
class Selector:
    """`op` is a pass name or None; `tags` maps tag -> index or `*` (any)."""

    op: str | None
    tags: tuple[tuple[str, int | str], ...]

    def tag(self, name: str):
        return dict(self.tags).get(name)

    def region_tags(self) -> tuple[tuple[str, int | str], ...]:
        """The tags that name regions (all but MB)."""
        return tuple((k, v) for k, v in self.tags if k != "MB")

    def matches_region(self, region_tags: dict[str, int]) -> bool:
        """True when every region tag of the selector holds for the region.

        `PP=1` matches a region tagged `{PP: 1}` and one nested in it,
        `{PP: 1, EP: 0}`; `EP=*` needs the tag to be present.
        """
        for name, value in self.region_tags():
            if name not in region_tags:
                return False
            if value != ANY and region_tags[name] != value:
                return False
        return True

    def __str__(self) -> str:
        tags = ", ".join(f"{k}={v}" for k, v in self.tags)
        if self.op is None:
            return " ".join(f"{k}={v}" for k, v in self.tags)
        return f"{self.op}({tags})" if tags else self.op


def parse_selector(text: str, *, span: Span | None = None) -> Selector:
    """Parse `"PP=1 EP=*"`, `"F(MB=0)"` or `"BW(PP=2, MB=3)"`.

    >>> parse_selector("BW(PP=2, MB=3)")
    Selector(op='BW', tags=(('PP', 2), ('MB', 3)))
    """
    if isinstance(text, Selector):
        return text
    if not isinstance(text, str):
        raise error("bad-selector", f"a selector is a string such as \"PP=1\" or \"F(MB=0)\", not {text!r}",
                    span=span)
    body = text.strip()
    op = None
    match = re.fullmatch(r"([A-Za-z]+)\s*(?:\((.*)\))?", body)
    if match and match.group(1).upper() == match.group(1) and "=" not in match.group(1):
        op, body = match.group(1), (match.group(2) or "")
        if op not in PASSES:
            from ..diagnostics import did_you_mean
            raise error("bad-selector", f"unknown pass `{op}` in selector {text!r}", span=span,
                        hint=did_you_mean(op, PASSES) or f"passes are {', '.join(PASSES)}")
    tags: list[tuple[str, int | str]] = []
    rest = body.replace(",", " ").strip()
    pos = 0
    while pos < len(rest):
        m = _TAG.match(rest, pos)
        if not m:
            raise error("bad-selector", f"cannot read selector {text!r} at {rest[pos:]!r}", span=span,
                        hint="write tags as NAME=INDEX or NAME=*, e.g. \"PP=1 EP=*\" or \"F(PP=0, MB=2)\"")
        value = m.group(2)
        if any(name == m.group(1) for name, _ in tags):
            raise error("bad-selector", f"tag `{m.group(1)}` appears twice in selector {text!r}", span=span)
        tags.append((m.group(1), ANY if value == ANY else int(value)))
        pos = m.end()
    if op is None and not tags:
        raise error("bad-selector", f"empty selector {text!r}", span=span,
                    hint="name a region such as \"PP=0\" or a pass such as \"F(MB=0)\"")
    return Selector(op, tuple(tags))
