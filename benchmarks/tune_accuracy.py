"""`piper tune`'s predicted step against the measured one for its top candidates (suite 12, part c).

For each model (the example GPT, the example MoE) on 4 devices and two per-device budgets (every
candidate fits; the median predicted peak), a fresh cost cache: the search measures the regions,
calibrates the runtime's costs by one short run (`piper.cli_tune.calibrate`), and ranks. Its
top candidates for both budgets then run two at a time on the same batch beside the calibration's
own candidate (the reference), a step of each in turn (R A B R A B ...), so a change in the
machine's load falls on all alike. The table gives each one's predicted step (what `tune` prints),
the median measured step, the error, the cores other processes kept busy meanwhile and the load
average (`/proc/loadavg` before and after); and the prediction of a calibration made again from
the reference's steps in the same rounds (`piper.cli_tune.calibration_from`): the model apart from
the load's drift since the calibration; and that one for the other load measured during the
candidate's own steps (the reference's and a candidate's other load differ by 0.1-0.5 cores in the
same rounds: a job with more busy threads takes more of the cores).

    python -m benchmarks.tune_accuracy [--top 3] [--steps 8] [--models examples/gpt.py:small_gpt ...]
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace
import os
import statistics
import tempfile

MODELS = ("examples/gpt.py:small_gpt", "examples/moe.py:moe_four_regions")
DEVICES, BATCH = 4, 16
TOGETHER = 2       # candidates alive at once beside the reference (each job's idle workers still hold memory)


def _budgets(every) -> list[int]:
    """Every candidate fits; the median predicted peak (about half fit)."""
    peaks = sorted(r.peak_bytes for r in every)
    return [peaks[-1], peaks[len(peaks) // 2]]


def _measure_beside(search, reference, candidates, *, steps: int, warmup: int, log):
    """Step `reference` and then each of `candidates` in turn, round after round, on one batch
    (`tune_calibration.measure_together`): per candidate its record (driver step seconds, the
    cores other processes took during each step, ...), the reference's too, the calibration its
    record makes (`cli_tune.calibration_from`), and the load average before and after."""
    from piper.cli_tune import calibration_from, loadavg, start_jobs
    from piper.compiler.tune_calibration import measure_together

    order = [reference] + [c for c in candidates if c != reference]
    with contextlib.ExitStack() as stack:
        for c in order:
            log(f"tune accuracy: starting {c.label()}")
        jobs, data = start_jobs(search.model_spec, order, search.batch, stack)
        before = loadavg()
        runs = measure_together(jobs, data, steps=steps, warmup=warmup)
        after = loadavg()
    # the runtime's costs and the load from the reference's steps; a compute's cost per call as calibrated
    again = calibration_from(search, [reference], runs[:1], call=search.calibration.call,
                             wait=search.calibration.wait)
    # the calls' costs on group sizes the reference lacks: as the calibration measured them
    again = replace(again, collectives={**search.calibration.collectives, **again.collectives})
    return dict(zip(order, runs)), again, (before, after)


def reference_of(search, cal):
    """The candidate the calibration ran on (`cal.candidate`, its label)."""
    from piper.compiler.tune import candidates

    every = candidates(search.devices, search.batch, search.regions)
    return next(c for c in every if c.label() == cal.candidate)


def run_model(model_spec: str, *, top: int, steps: int, warmup: int, log=print) -> list[dict]:
    """Rows for one model: per budget, its top candidates predicted and measured."""
    from piper.cli_tune import calibrate, loadavg
    from piper.compiler.tune import Search, groups, profile

    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("PIPER_CACHE")
        os.environ["PIPER_CACHE"] = cache
        try:
            search = Search(model_spec, DEVICES, 2**40, BATCH, log=log)
            calibrated_at = loadavg()
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
            reference = reference_of(search, cal)
            measured, beside = {}, {}
            for i in range(0, len(distinct), TOGETHER):
                group = distinct[i:i + TOGETHER]
                runs, again, loads = _measure_beside(search, reference, group, steps=steps, warmup=warmup, log=log)
                for c in group:
                    b = c.microbatch(BATCH)
                    exact = profile(model_spec, b) if b != search.reference.microbatch else None
                    r = search.with_calibration(again).evaluate(c, exact)
                    # and for the other load measured during its own steps (not its step time)
                    own = statistics.median(runs[c]["external"])
                    at = search.with_calibration(again, external=own).evaluate(c, exact)
                    beside[c] = {"run": runs[c], "reference": runs[reference], "calibration": again, "loadavg": loads,
                                 "predicted": r.step_s if r is not None else float("nan"),
                                 "at_load": at.step_s if at is not None else float("nan")}
        finally:
            if old is None:
                os.environ.pop("PIPER_CACHE", None)
            else:
                os.environ["PIPER_CACHE"] = old
    rows = []
    for budget, r, n in picks:
        got = beside[r.candidate]
        times, again = got["run"]["times"], got["predicted"]
        m = statistics.median(times)
        rows.append({"model": model_spec, "budget": budget, "strategy": r.candidate.label(), "group": n,
                     "predicted_ms": r.step_s * 1e3, "measured_ms": m * 1e3, "error": r.step_s / m - 1,
                     "spread": (max(times) - min(times)) / m, "steps": len(times),
                     "load": statistics.median(got["run"]["external"]), "loadavg": got["loadavg"],
                     "reference_ms": statistics.median(got["reference"]["times"]) * 1e3,
                     "reference_load": got["calibration"].external,
                     "recalibrated_ms": again * 1e3, "error_recalibrated": again / m - 1,
                     "at_load_ms": got["at_load"] * 1e3, "error_at_load": got["at_load"] / m - 1,
                     "tolerance": search.tolerance, "calibrated_on": cal.candidate,
                     "calibration_error": cal.error, "other_load": cal.external, "calibration_loadavg": calibrated_at,
                     "calibration_ms": cal.measured * 1e3, "check": cal.check,
                     "check_error": cal.check_error, "scale": cal.scale, "pooled": bool(cal.pooled),
                     "held_out": cal.held_out, "wait_ms": cal.wait * 1e3,
                     "fitted": cal.fitted, "fitted_ms": cal.fitted_measured * 1e3,
                     "fitted_error": cal.fitted_error, "fitted_wait_ms": cal.fitted_wait * 1e3})
    return rows


def table(rows) -> str:
    from piper.compiler.memory_model import format_bytes

    lines = ["| model | budget / device | # | group | strategy | predicted ms | measured ms | error | spread | "
             "other load (cores, its own / the reference's) | load avg | reference ms (calibration / beside) | "
             "recalibrated beside ms | error recalibrated | error recalibrated, its own load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    index: dict = {}
    for r in rows:
        i = index[(r["model"], r["budget"])] = index.get((r["model"], r["budget"]), 0) + 1
        lines.append(f"| {r['model'].rpartition(':')[2]} | {format_bytes(r['budget'])} | {i} | ≈{r['group']} | "
                     f"{r['strategy']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {r['error']:+.1%} | "
                     f"{r['spread']:.2f} | {r['load']:.2f} / {r['reference_load']:.2f} | "
                     f"{r['loadavg'][0]:.1f}-{r['loadavg'][1]:.1f} | "
                     f"{r['calibration_ms']:.1f} / {r['reference_ms']:.1f} | {r['recalibrated_ms']:.1f} | "
                     f"{r['error_recalibrated']:+.1%} | {r['error_at_load']:+.1%} |")
    seen = {}
    for r in rows:
        seen.setdefault(r["model"], r)
    for model, r in seen.items():
        check = f"{r['check_error']:+.1%}" if r["check_error"] is not None else "none"
        lines.append(f"\n- {model}: calibrated on {r['calibrated_on']} ({r['calibration_ms']:.1f} ms; "
                     f"the measured costs alone predicted it {r['calibration_error']:+.1%}; scale "
                     f"{r['scale']:.2f}"
                     + (f", pooled over the runs, each held out within ±{r['held_out']:.0%}"
                        if r.get("pooled") else "")
                     + f"; {r['other_load']:.2f} cores of other load, load average "
                     f"{r['calibration_loadavg']:.1f}"
                     + (f"; {r['wait_ms']:.2f} ms more per collective (fitted {r['fitted_wait_ms']:.2f}) beside "
                        f"{r['fitted']} ({r['fitted_ms']:.1f} ms, predicted {r['fitted_error']:+.1%})"
                        if r.get("fitted") else "")
                     + f"); checked on {r['check']}: {check}; tolerance ±{r['tolerance']:.0%}")
    within = sum(1 for r in rows if abs(r["error"]) <= 0.15)
    again = sum(1 for r in rows if abs(r["error_recalibrated"]) <= 0.15)
    at_load = sum(1 for r in rows if abs(r["error_at_load"]) <= 0.15)
    lines.append(f"- {within} of {len(rows)} predictions within ±15% of the measured median step; {again} of "
                 f"{len(rows)} recalibrated on the calibration's candidate stepped in the same rounds; {at_load} "
                 f"of {len(rows)} so recalibrated and predicted for the other load measured during their own steps")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
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
