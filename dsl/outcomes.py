"""How a .pps run reports: a statement that fails, a limit that stops the run, and the step count.

Mixed into `Interpreter`; user mistakes become diagnostics here, never exceptions to the caller.
"""
from __future__ import annotations

from piper.diagnostics import Diagnostic, Span


class Fail(Exception):
    """One statement fails; the run goes on with the next."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


class Stop(Exception):
    """A limit is reached; the run ends."""

    def __init__(self, diagnostic: Diagnostic | None):
        super().__init__(diagnostic.message if diagnostic else "stopped")
        self.diagnostic = diagnostic


class Outcomes:
    """Makes and keeps diagnostics; needs `trace`, `diagnostics`, `limits`, `steps`, `work`, `_seen`, `_span`."""

    def fail(self, code: str, message: str, span: Span | None, *, hint: str | None = None,
             notes=(), labels=()) -> Fail:
        return Fail(Diagnostic(code, message, "error", span, tuple(labels), tuple(notes), hint, self.trace))

    def report(self, diagnostic: Diagnostic, *, force: bool = False) -> None:
        key = (diagnostic.code, diagnostic.span, diagnostic.trace)
        if not force:
            # A failing line in a loop fails each time round with the same diagnostic, kept once;
            # past `Limits.failures` of them the run ends (what it found is reported).
            self.failures = getattr(self, "failures", 0) + 1
            if self.failures > self.limits.failures:
                raise Stop(None)
        if key in self._seen:
            return
        self._seen.add(key)
        self.diagnostics.append(diagnostic)
        if not force and len(self.diagnostics) >= self.limits.errors:
            raise Stop(None)

    def tick(self, span: Span, weight: int = 1) -> None:
        """One step (a statement, or a loop's turn) of `weight` terms (`dsl.work`)."""
        self.steps += 1
        self.work += weight
        self._span = span
        if self.work > self.limits.work:
            raise Stop(self.too_much_work(span))
        if self.steps > self.limits.steps:
            raise Stop(Diagnostic(
                "loop-limit", f"this script takes more than {self.limits.steps:,} steps", span=span,
                trace=self.trace, hint="a strategy runs about once per stage and microbatch; check the loop bounds"))

    def too_much_work(self, span: Span | None) -> Diagnostic:
        return Diagnostic(
            "loop-limit", f"this script evaluates more than {self.limits.work:,} terms (expression parts, "
            "tags and slot items, each time its line runs)", span=span, trace=self.trace,
            hint="a schedule's lines run about once per stage and microbatch; check the loop bounds, "
                 "and keep long expressions and slot lines out of loops")
