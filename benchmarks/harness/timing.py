"""Timing systems against each other: the A/B alternation (`alternate`), one torch-vs-Piper
row (`head_to_head`), and the growth exponent of a scaling curve (`fit_exponent`).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from .results import ms, short_error


# -- measuring -------------------------------------------------------------------------------------

@dataclass
class Timings:
    """Per-system step times (seconds) after warm-up, the losses of every step, and failures."""

    times: dict[str, list[float]]
    losses: dict[str, list[float]]
    errors: dict[str, BaseException] = field(default_factory=dict)

    def ok(self, name: str) -> bool:
        return name in self.times and name not in self.errors and bool(self.times[name])

    def median(self, name: str) -> float | None:
        return statistics.median(self.times[name]) if self.ok(name) else None

    def spread(self, name: str) -> float | None:
        """(max - min) / median of the measured steps: how noisy they were."""
        if not self.ok(name):
            return None
        t = self.times[name]
        return (max(t) - min(t)) / statistics.median(t)

    def paired_ratios(self, a: str, b: str) -> list[float]:
        """a's time over b's, step by step: each pair ran back to back on the same batch, so
        drift of the machine's speed over the run cancels in each ratio."""
        if not (self.ok(a) and self.ok(b)):
            return []
        return [x / y for x, y in zip(self.times[a], self.times[b])]

    def max_loss_gap(self, a: str, b: str) -> float | None:
        if not (self.ok(a) and self.ok(b)):
            return None
        return max(abs(x - y) for x, y in zip(self.losses[a], self.losses[b]))


def alternate(systems: dict, batches: list, *, warmup: int, steps: int) -> Timings:
    """Run `systems` (name -> step(x, y) -> loss) in turn, A B A B ..., on the same batches.

    Step i of every system sees batch i, so systems that start from the same
    weights must give the same losses (a check that the comparison is fair).
    The first `warmup` steps of each system are not timed. A system whose
    step raises is recorded in `errors` and dropped; the others go on.

    Always in the same order, so each step of a system follows a step of the
    other: a step that follows one of its own system ran about 5% faster here
    (DualPipeV against torch on 2 devices, 20 steps), and A B, B A would give
    each system such steps at every other pair, widening the spread for both.
    """
    if len(batches) < warmup + steps:
        raise ValueError(f"alternate needs {warmup + steps} batches, got {len(batches)}")
    times = {name: [] for name in systems}
    losses = {name: [] for name in systems}
    errors: dict[str, BaseException] = {}
    for i in range(warmup + steps):
        for name, step in systems.items():
            if name in errors:
                continue
            t0 = time.perf_counter()
            try:
                loss = step(*batches[i])
            except Exception as exc:
                errors[name] = exc
                continue
            dt = time.perf_counter() - t0
            losses[name].append(float(loss))
            if i >= warmup:
                times[name].append(dt)
    return Timings(times, losses, errors)


@dataclass
class HeadToHead:
    """One torch-vs-Piper comparison: medians, ratio, errors, and the row cells after the labels."""

    group: object            # the torch group, or None once a failed step closed it
    torch_error: str | None
    piper_error: str | None
    t_ms: float | None
    p_ms: float | None
    ratio: float | None
    cells: list
    quartiles: tuple[float, float] | None = None     # of the paired ratios: where the middle half fell

    def metrics(self) -> list[tuple[str, float]]:
        q1, q3 = self.quartiles or (None, None)
        return [(name, value) for name, value in (("torch_ms", self.t_ms), ("piper_ms", self.p_ms),
                                                   ("ratio", self.ratio), ("ratio_q1", q1), ("ratio_q3", q3))
                if value is not None]


def head_to_head(group, job, batches: list, *, warmup: int, steps: int, torch_error: str | None,
                 piper_error: str | None) -> HeadToHead:
    """Alternate `group.step` (torch) and `job.step` (Piper), close the job, and summarise.

    A torch group whose step failed is closed (a failed schedule can leave ranks mid-collective).
    """
    systems = {}
    if group is not None and torch_error is None:
        systems["torch"] = group.step
    if job is not None:
        systems["piper"] = job.step
    try:
        timings = alternate(systems, batches, warmup=warmup, steps=steps)
    finally:
        if job is not None:
            job.close()
    if "torch" in timings.errors:
        torch_error = f"step failed: {short_error(timings.errors['torch'])}"
        group.close()
        group = None
    if "piper" in timings.errors:
        piper_error = f"step failed: {short_error(timings.errors['piper'])}"
    t_ms, p_ms = ms(timings.median("torch")), ms(timings.median("piper"))
    ratio = t_ms / p_ms if t_ms and p_ms else None
    paired = timings.paired_ratios("torch", "piper")
    quartiles = None
    if len(paired) >= 2:
        q1, _, q3 = statistics.quantiles(paired, n=4)
        quartiles = (q1, q3)
    gap = timings.max_loss_gap("torch", "piper")
    cells = [t_ms if torch_error is None else torch_error, p_ms if piper_error is None else piper_error,
             None if ratio is None else f"{ratio:.2f}x",
             None if quartiles is None else f"{quartiles[0]:.2f} – {quartiles[1]:.2f}",
             timings.spread("torch"), timings.spread("piper"), None if gap is None else f"{gap:.1e}"]
    return HeadToHead(group, torch_error, piper_error, t_ms, p_ms, ratio, cells, quartiles)


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (the growth exponent), or None with < 2 points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
