"""Suite 12, `tune`: how long `piper tune` searches, and what it picks against the best
hand-picked stdlib composition, measured side by side.

(a) Search time for 8, 64 and 512 devices on the example GPT (4 PP regions),
    global batch 2 x devices: wall and CPU seconds, first with an empty cost
    cache (the model captured and its regions timed), then cached.
(b) For three per-device budgets on 4 devices (and a fourth that only a
    recomputing strategy fits): the tuned strategy and every hand-picked stdlib
    composition run for a few steps; the best hand-picked is the fastest whose
    measured step peak fits. Tuned should fit (measured) and be no slower.

    python -m benchmarks --suite tune [--quick]
"""
from __future__ import annotations

import os
import tempfile
import time

import piper
from piper.dsl import load_strategy
from piper.compiler.memory_model import format_bytes
from piper.compiler.tune import Candidate, Search, measure_steps

from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, short_error

MODEL = "examples/gpt.py:small_gpt"
HAND_PICKED = [Candidate(4, 1, None, 1, None, "dp"), Candidate(4, 1, None, 1, None, "zero2"),
               Candidate(4, 1, None, 1, None, "zero3"), Candidate(1, 4, "one_f_one_b", 8),
               Candidate(1, 4, "gpipe", 8), Candidate(1, 4, "zero_bubble", 8),
               Candidate(2, 2, "interleaved_1f1b", 4, 2, "zero3"), Candidate(2, 2, "dualpipev", 4, None, "dp")]


def _search_times(ctx, result, sizes) -> Table:
    table = Table("`piper tune` search time (example GPT small_gpt, 4 PP regions, global batch 2 x devices)",
                  ["devices", "candidates", "fit", "wall s (empty cache)", "CPU s (empty cache)", "wall s (cached)",
                   "CPU s (cached)"])
    for n in sizes:
        cells = []
        with tempfile.TemporaryDirectory() as cache:
            old = os.environ.get("PIPER_CACHE")
            os.environ["PIPER_CACHE"] = cache
            try:
                for _ in range(2):
                    ctx.log(f"tune: search for {n} devices")
                    wall, cpu = time.perf_counter(), time.process_time()
                    search = Search(MODEL, n, 2**40, 2 * n)
                    fits, every = search.run()
                    cells.append((time.perf_counter() - wall, time.process_time() - cpu, len(every), len(fits)))
            finally:
                if old is None:
                    os.environ.pop("PIPER_CACHE", None)
                else:
                    os.environ["PIPER_CACHE"] = old
        (w0, c0, count, fit), (w1, c1, _, _) = cells
        table.add(n, count, fit, w0, c0, w1, c1)
        result.metrics[f"search.{n}.wall_s"] = w0
        result.metrics[f"search.{n}.cpu_s"] = c0
        result.metrics[f"search.{n}.cached_wall_s"] = w1
    table.notes.append("CPU s counts this process only (capture, region timing, compiling and simulating every "
                       "candidate); wall s on a shared, loaded machine also holds waiting for a core.")
    return table


def _measure(c: Candidate, batch, steps: int):
    from examples.gpt import small_gpt

    with piper.compile(small_gpt(), batch, strategy=load_strategy(c.script(), file="<tune>"), timeout=600) as job:
        return measure_steps(job, batch, steps)


def _tuned_vs_hand(ctx, result, quick) -> Table:
    from examples.gpt import example_batch

    batch = example_batch(16)
    steps = 3 if quick else 6
    hand = HAND_PICKED[::2] if quick else HAND_PICKED
    search = Search(MODEL, 4, 2**40, 16)
    _, every = search.run()
    peaks = sorted(r.peak_bytes for r in every)
    # The largest, median and lower-fifth peaks without recompute, and one below all of them,
    # which only a recomputing strategy fits.
    budgets = [peaks[-1], peaks[len(peaks) // 2], peaks[len(peaks) // 5], int(peaks[0] * 0.9)]
    measured: dict[Candidate, tuple] = {}

    def run(c):
        if c not in measured:
            ctx.log(f"tune: measuring {c.label()}")
            try:
                measured[c] = _measure(c, batch, steps)
            except Exception as exc:       # noqa: BLE001 - a failed run is a row, not the end of the suite
                measured[c] = (None, None, short_error(exc))
        return measured[c]

    for c in hand:
        run(c)
    table = Table(f"Tuned vs best hand-picked (4 devices, global batch 16, median of {steps - 1} steps after the "
                  f"first; hand-picked: {', '.join(c.label() for c in hand)})",
                  ["budget / device", "tuned", "tuned step ms (pred / meas)", "tuned peak (pred / meas)", "fits",
                   "best hand-picked that fits (measured)", "its step ms", "its peak", "hand / tuned step"])
    for budget in budgets:
        search.memory = budget
        fits, _ = search.run()          # recompute is tried for what misses this budget
        if not fits:
            table.add(format_bytes(budget), "nothing fits", *[None] * 7)
            continue
        best = fits[0]
        step, peak, *err = run(best.candidate)
        fitting = [(measured[c][0], c) for c in hand if measured[c][0] is not None and measured[c][1] <= budget]
        hand_best = min(fitting, key=lambda x: x[0]) if fitting else None
        ratio = hand_best[0] / step if hand_best and step else None
        table.add(format_bytes(budget), best.candidate.label(),
                  f"{best.step_s * 1e3:.1f} / {step * 1e3:.1f}" if step else f"failed: {err}",
                  f"{format_bytes(best.peak_bytes)} / {format_bytes(peak)}" if peak else None,
                  bool(peak is not None and peak <= budget),
                  hand_best[1].label() if hand_best else "none fits", hand_best[0] * 1e3 if hand_best else None,
                  format_bytes(measured[hand_best[1]][1]) if hand_best else None, ratio)
        if ratio is not None:
            result.metrics[f"budget.{budget}.hand_over_tuned"] = ratio
        result.metrics[f"budget.{budget}.tuned_fits"] = float(peak is not None and peak <= budget)
    table.notes.append("Budgets: the largest, median and lower-fifth predicted peaks among the candidates "
                       "without recompute, and 0.9 x the smallest (only `recompute PP=*` fits there; the "
                       "hand-picked compositions do not recompute). "
                       "Wall-clock steps on a shared machine (2 cores, 4 Gloo processes); ratio > 1: tuned faster.")
    return table


def _accuracy(ctx, result, quick) -> Table:
    """(c) tune's predicted step against the measured one for its top candidates (`tune_accuracy`)."""
    from ..tune_accuracy import MODELS, run_model

    rows = []
    for model in MODELS:
        rows += run_model(model, top=2 if quick else 3, steps=3 if quick else 8, warmup=1 if quick else 2,
                          log=ctx.log)
    table = Table("tune's predicted vs measured step, its top candidates on 4 devices, global batch 16 "
                  "(two budgets: every candidate fits; the median predicted peak); the candidates run in turn "
                  "beside the calibration's candidate",
                  ["model", "budget / device", "group", "strategy", "predicted ms", "measured ms", "error", "spread",
                   "other load (cores)", "load avg", "error recalibrated beside", "error recalibrated, own load"])
    for r in rows:
        table.add(r["model"].rpartition(":")[2], format_bytes(r["budget"]), r["group"], r["strategy"],
                  r["predicted_ms"], r["measured_ms"], f"{r['error']:+.1%}", r["spread"], r["load"],
                  f"{r['loadavg'][0]:.1f}-{r['loadavg'][1]:.1f}", f"{r['error_recalibrated']:+.1%}",
                  f"{r['error_at_load']:+.1%}")
        result.metrics[f"accuracy.{r['model'].rpartition(':')[2]}.{r['budget']}.{r['strategy']}.error"] = r["error"]
    within = sum(1 for r in rows if abs(r["error"]) <= 0.15)
    again = sum(1 for r in rows if abs(r["error_recalibrated"]) <= 0.15)
    result.metrics["accuracy.within_15pct"] = within
    result.metrics["accuracy.recalibrated_within_15pct"] = again
    table.notes.append(f"{within} of {len(rows)} within ±15% ({again} recalibrated beside). Each model: a fresh cost cache, "
                       "one calibration run (`piper.cli_tune.calibrate`), then the search; spread: (max - min) / "
                       "median of the measured steps; load avg: /proc/loadavg before and after them. Error recalibrated "
                       "beside: predicted by a calibration made again from the calibration's candidate stepped in "
                       "the same rounds. Group: tune's "
                       "groups of predictions it cannot tell apart.")
    return table


def run(ctx) -> SuiteResult:
    result = SuiteResult("tune", 12, "piper tune: search time, tuned vs hand-picked", ctx.command("tune"))
    result.tables.append(_search_times(ctx, result, (8, 64) if ctx.quick else (8, 64, 512)))
    with ray_cluster():
        result.tables.append(_tuned_vs_hand(ctx, result, ctx.quick))
        result.tables.append(_accuracy(ctx, result, ctx.quick))
    return result
