"""`piper tune`'s predicted step against the measured one for its top candidates (suite 12, part c).

For each model (the example GPT, the example MoE) on 4 devices and two per-device budgets (every
candidate fits; the median predicted peak), a fresh cost cache: the search measures the regions,
calibrates the runtime's costs by one short run (`piper.cli_tune.calibrate`), and ranks. Its
top candidates for both budgets then run two at a time on the same batch, a step of each in turn
(A B A B ...), so a change in the machine's load falls on both alike; the table gives
each one's predicted step, the median measured step, the error, and the group tune puts it in;
and, apart from the load's drift since the calibration, the step predicted for the other load
measured during the candidate's own steps.

    python -m benchmarks.tune_accuracy [--top 3] [--steps 6] [--models examples/gpt.py:small_gpt ...]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

MODELS = ("examples/gpt.py:small_gpt", "examples/moe.py:moe_four_regions")
DEVICES, BATCH = 4, 16
TOGETHER = 2       # jobs alive at once, as in the calibration (each job's idle workers still hold memory)


def _budgets(every) -> list[int]:
    """Every candidate fits; the median predicted peak (about half fit)."""
    peaks = sorted(r.peak_bytes for r in every)
    return [peaks[-1], peaks[len(peaks) // 2]]


def _measure_together(model_spec: str, candidates, *, steps: int, warmup: int, log) -> dict:
    """Each candidate's driver step seconds, stepping them in turn on one batch, and the cores other
    processes kept busy during each of its steps."""
    import piper

    from piper.dsl import load_strategy
    from piper.frontend.models import example_batch, load_model

    from piper.compiler.tune_calibration import LoadMeter

    times: dict = {c: [] for c in candidates}
    loads: dict = {c: [] for c in candidates}
    with contextlib.ExitStack() as stack:
        jobs = {}
        for c in candidates:
            log(f"tune accuracy: starting {c.label()}")
            model, module = load_model(model_spec)
            data = example_batch(module, BATCH)
            jobs[c] = stack.enter_context(piper.compile(model, data, strategy=load_strategy(c.script(), file="<tune>"),
                                                        timeout=300))
        for i in range(warmup + steps):
            for c, job in jobs.items():
                meter = LoadMeter()
                start = time.perf_counter()
                job.step(*data)
                if i >= warmup:
                    times[c].append(time.perf_counter() - start)
                    workers = sum(r.get("step", 0.0) for r in job.timings(cpu=True).values())
                    loads[c].append(meter.cores(less=workers))
    return times, loads


def run_model(model_spec: str, *, top: int, steps: int, warmup: int, log=print) -> list[dict]:
    """Rows for one model: per budget, its top candidates predicted and measured."""
    from piper.cli_tune import calibrate
    from piper.compiler.tune import Search, groups, profile

    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("PIPER_CACHE")
        os.environ["PIPER_CACHE"] = cache
        try:
            search = Search(model_spec, DEVICES, 2**40, BATCH, log=log)
            cal = calibrate(search, log=log)
            search = search.with_calibration(cal)
            _, every = search.run()
            picks = []
            for budget in _budgets(every):
                search.memory = budget
                fits, _ = search.run()
                numbers = groups(fits, search.tolerance)
                picks += [(budget, r, n) for r, n in zip(fits[:top], numbers)]
            distinct = list(dict.fromkeys(r.candidate for _, r, _ in picks))
            measured, loads = {}, {}
            for i in range(0, len(distinct), TOGETHER):
                t, lo = _measure_together(model_spec, distinct[i:i + TOGETHER], steps=steps, warmup=warmup, log=log)
                measured.update(t)
                loads.update(lo)
            # each again for the load its own steps ran under: the model apart from the load's drift
            again = {}
            for c in distinct:
                b = BATCH // (c.dp * c.microbatches)
                exact = profile(model_spec, b) if b != search.reference.microbatch else None
                r = search.with_calibration(cal, external=statistics.median(loads[c])).evaluate(c, exact)
                again[c] = r.step_s if r is not None else float("nan")
        finally:
            if old is None:
                os.environ.pop("PIPER_CACHE", None)
            else:
                os.environ["PIPER_CACHE"] = old
    rows = []
    for budget, r, n in picks:
        m = statistics.median(measured[r.candidate])
        rows.append({"model": model_spec, "budget": budget, "strategy": r.candidate.label(), "group": n,
                     "predicted_ms": r.step_s * 1e3, "measured_ms": m * 1e3, "error": r.step_s / m - 1,
                     "spread": (max(measured[r.candidate]) - min(measured[r.candidate])) / m,
                     "load": statistics.median(loads[r.candidate]), "at_load_ms": again[r.candidate] * 1e3,
                     "error_at_load": again[r.candidate] / m - 1,
                     "tolerance": search.tolerance, "calibrated_on": cal.candidate,
                     "calibration_error": cal.error, "other_load": cal.external, "check": cal.check,
                     "check_error": cal.check_error, "scale": cal.scale})
    return rows


def table(rows) -> str:
    from piper.compiler.memory_model import format_bytes

    lines = ["| model | budget / device | # | group | strategy | predicted ms | measured ms | error | spread | "
             "other load (cores) | predicted at that load ms | error at that load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    index: dict = {}
    for r in rows:
        i = index[(r["model"], r["budget"])] = index.get((r["model"], r["budget"]), 0) + 1
        lines.append(f"| {r['model'].rpartition(':')[2]} | {format_bytes(r['budget'])} | {i} | ≈{r['group']} | "
                     f"{r['strategy']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {r['error']:+.1%} | "
                     f"{r['spread']:.2f} | {r['load']:.2f} | {r['at_load_ms']:.1f} | {r['error_at_load']:+.1%} |")
    seen = {}
    for r in rows:
        seen.setdefault(r["model"], r)
    for model, r in seen.items():
        check = f"{r['check_error']:+.1%}" if r["check_error"] is not None else "none"
        lines.append(f"\n- {model}: calibrated on {r['calibrated_on']} "
                     f"(the measured costs alone predicted it {r['calibration_error']:+.1%}, so scale "
                     f"{r['scale']:.2f}; {r['other_load']:.2f} cores of other load then); checked on {r['check']}: "
                     f"{check}; tolerance ±{r['tolerance']:.0%}")
    within = sum(1 for r in rows if abs(r["error"]) <= 0.15)
    at_load = sum(1 for r in rows if abs(r["error_at_load"]) <= 0.15)
    lines.append(f"- {within} of {len(rows)} predictions within ±15% of the measured median step; {at_load} of "
                 f"{len(rows)} when predicted for the other load measured during the candidate's own steps")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        rows = []
        for model in args.models:
            rows += run_model(model, top=args.top, steps=args.steps, warmup=args.warmup)
            print(table(rows), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
