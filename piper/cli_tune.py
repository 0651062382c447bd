"""`piper tune`: the search (`piper.compiler.tune`, which predicts without running anything) and the runs
around it: the short run that calibrates the runtime's costs, `--verify`'s runs of the best, the table.

    piper tune --model examples/gpt.py:small_gpt --devices 4 --memory 2GiB --verify 2

At the top with the other commands: calibrating and verifying start real jobs (`piper.job`), which the
compiler's search sits below.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace

from .compiler.tune import Candidate, Result, Search, _cached, at_load, candidates, group_notes, groups


def calibrate(search: Search, *, log=None, again: bool = False):
    """The runtime's costs for `search`'s model and device count on this machine
    (`tune_calibration.Calibration`): a short run of two or three candidates side by side
    (`tune_calibration.choose`, `pair`, `with_pipeline`), cached (`$PIPER_CACHE`) by machine, model, batch and
    devices (`again`: measure anew); None where they do not run."""
    from .compiler.runtime_costs import RuntimeModel
    from .compiler.tune_calibration import Calibration, choose, pair, with_pipeline

    path, _, factory = search.model_spec.rpartition(":")
    key = {"what": "calibration", "model": os.path.abspath(path), "factory": factory, "batch": search.batch,
           "mtime": os.path.getmtime(path) if os.path.exists(path) else 0, "devices": search.devices,
           "cores": search.machine["cores"], "fit": "a scale pooled over the runs and a wait per collective"}
    log = log or search.log

    def make():
        ordered = choose(candidates(search.devices, search.batch, search.regions))
        chosen = with_pipeline(pair(ordered, search.batch), ordered, search.batch)
        if not chosen:
            return None
        try:
            return _calibrate_on(search, chosen, log)
        except Exception as err:       # noqa: BLE001 - a run that fails leaves the search uncalibrated
            log(f"calibrating on {chosen[0].label()} failed ({err}): steps are predicted from the computes alone")
            return None

    return _cached(key, make, again=again, types=(Calibration, RuntimeModel), log=log)


def _calibrate_on(search: Search, chosen: list[Candidate], log):
    """Run the `chosen` candidates a step each in turn; the first makes the `Calibration`, a pipeline
    second of three fits the wait per collective with it, and the last (where there are two or more)
    checks what it predicts for another candidate (`calibration_from`)."""
    import contextlib

    import ray

    from .compiler.tune_calibration import measure_together

    log(f"calibrating the runtime's costs on {' and '.join(c.label() for c in chosen)} "
        f"({search.devices} devices; cached)")
    owned = not ray.is_initialized()
    if owned:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        with contextlib.ExitStack() as stack:
            jobs, data = start_jobs(search.model_spec, chosen, search.batch, stack,
                                    progress=lambda m: log(f"calibration: {m}"))
            runs = measure_together(jobs, data)
    finally:
        if owned:
            ray.shutdown()
    return calibration_from(search, chosen, runs)


def start_jobs(model_spec: str, chosen: list[Candidate], batch: int, stack, *, progress=None, timeout: float = 300):
    """A job per candidate of `chosen` (entered into the `contextlib.ExitStack` `stack`, which
    closes them), and the example batch they step on: (jobs, batch)."""
    import piper

    from .dsl import load_strategy
    from .frontend.models import example_batch, load_model

    jobs, data = [], None
    for c in chosen:
        model, module = load_model(model_spec)
        data = example_batch(module, batch)
        jobs.append(stack.enter_context(piper.compile(
            model, data, strategy=load_strategy(c.script(), file="<tune>"), timeout=timeout, progress=progress)))
    return jobs, data


def calibration_from(search: Search, chosen: list[Candidate], runs: list[dict], *, call: float | None = None,
                     wait: float | None = None):
    """The `Calibration` that `runs` (`tune_calibration.measure_together`'s records of the `chosen`
    candidates' jobs, stepped in turn) make: the first candidate's runtime costs, its computes and
    the others' fitted against the search's profile (`compute_fit`; `call`: keep that cost per
    compute), and checked on the last where there are two or more. With three, the second (a
    pipeline, `with_pipeline`) and the first fit the wait per data-parallel collective beside
    `scale` (`fit_wait`), kept where it lowers the error on a run held out of the pooled scale
    (`tune_calibration.pool`); `wait`: keep that one instead."""
    from .compiler.tune_calibration import fit_wait, from_run, pool

    def priced(c: Candidate, run: dict):
        b = c.microbatch(search.batch)
        exact = search.exact_profile(c)
        program = (exact or search.reference).program
        compiled = run["compiled"]
        fwd, bwd, _ = search._scaled(b, exact)
        comm = comm_cost(compiled, program, bandwidth=search.machine["bandwidth"],
                         value_scale=b / (exact or search.reference).microbatch)
        return exact, comm, search.compute_costs(compiled, program, c, fwd, bwd)

    from .compiler.step_costs import comm_cost

    c = chosen[0]
    exact, comm, estimated = priced(c, runs[0])
    collectives = {}             # the calls' costs on every group size the runs had (the first's first)
    for run in reversed(runs):
        collectives.update(run.get("collectives", {}))
    others = [(run, priced(o, run)[2]) for o, run in zip(chosen[1:], runs[1:])]
    cal = from_run(runs[0], cores=search.machine["cores"], comm=comm, plans=runs[0]["compiled"].plans.representatives(),
                   candidate=c.label(), estimated=estimated, collectives=collectives, others=others, call=call)
    def finish(cal):
        """Each run's prediction before any scale, the scale pooled over them (`pool`), and the
        pipeline's and the check's predictions with it."""
        bare = search.with_calibration(cal)          # `cal` has no prediction yet: a scale of 1
        own = bare.evaluate(c, exact)
        cal = replace(cal, predicted=own.step_s if own is not None else 0.0)
        steps = [(cal.measured, cal.predicted)]
        fitted = _predicted(bare, chosen[1]) if cal.fitted else None
        if fitted is not None:
            steps.append((cal.fitted_measured, fitted))
        other = chosen[-1] if len(chosen) > 1 else None
        check = _predicted(bare, other) if other is not None else None
        if check is not None:
            measured = statistics.median(runs[len(chosen) - 1]["times"])
            steps.append((measured, check))
            cal = replace(cal, check=other.label(), check_measured=measured)
        scale, held_out = pool(*zip(*steps))
        if len(steps) > 1:
            cal = replace(cal, pooled=scale, held_out=held_out)
        return replace(cal, fitted_predicted=(fitted or 0.0) * cal.scale, check_predicted=(check or 0.0) * cal.scale)

    if wait is not None:
        return finish(replace(cal, wait=wait))
    if len(chosen) < 3:
        return finish(cal)
    fitted = chosen[1]

    def predict(w: float) -> tuple[float, float]:
        with_w = search.with_calibration(replace(cal, wait=w))
        return _predicted(with_w, c) or 0.0, _predicted(with_w, fitted) or 0.0

    measured = (statistics.median(runs[0]["times"]), statistics.median(runs[1]["times"]))
    cal = replace(cal, fitted=fitted.label(), fitted_measured=measured[1])
    w = fit_wait(predict, measured)
    without = finish(cal)
    if not w:
        return without
    # kept only where it predicts a run the scale did not see better than none does: two runs
    # whose steps vary by a third from step to step can fit a wait that is noise
    with_w = finish(replace(cal, wait=w, fitted_wait=w))
    return with_w if with_w.held_out < without.held_out else replace(without, fitted_wait=w)


def _verify(search: Search, results: list[Result], steps: int = 3) -> tuple[list[tuple], dict]:
    """Run each result for `steps` steps after one more, beside the calibration's own candidate
    (where the search has a calibration), a step of each in turn so a change in the machine's load
    falls on both: per result (median step seconds, the largest step_peak, the cores other
    processes kept busy meanwhile, the load average after), and per result index the step a
    calibration made again from the reference's steps beside it predicts."""
    import contextlib

    import ray

    from .compiler.tune_calibration import measure_together

    cal = search.calibration
    reference = next((c for c in candidates(search.devices, search.batch, search.regions)
                      if cal is not None and c.label() == cal.candidate), None)
    out, again = [], {}
    owned = not ray.is_initialized()
    if owned:                        # one local cluster for every run, not one each
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        with contextlib.ExitStack() as outer:
            ref_jobs, _ = start_jobs(search.model_spec, [reference], search.batch, outer) if reference else ([], None)
            for i, r in enumerate(results):
                with contextlib.ExitStack() as stack:
                    (job,), data = start_jobs(search.model_spec, [r.candidate], search.batch, stack)
                    jobs = ref_jobs + [job]
                    runs = measure_together(jobs, data, steps=steps, warmup=1)
                    peak = max(m["step_peak"] for m in job.memory().values())
                    run = runs[-1]
                    out.append((statistics.median(run["times"]), peak, statistics.median(run["external"]),
                                loadavg()))
                    if ref_jobs:
                        beside = calibration_from(search, [reference], runs[:1], call=cal.call, wait=cal.wait)
                        beside = replace(beside, collectives={**cal.collectives, **beside.collectives})
                        step = _predicted(search.with_calibration(beside), r.candidate)
                        if step is not None:
                            again[i] = step
    finally:
        if owned:
            ray.shutdown()
    return out, again


def _predicted(search: Search, c: Candidate) -> float | None:
    """`c`'s step under `search`'s calibration, its activations at its own microbatch size."""
    r = search.evaluate(c, search.exact_profile(c))
    return r.step_s if r is not None else None


def loadavg() -> float:
    """The machine's 1-minute load average (`/proc/loadavg`), 0 where it cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def _nothing_fits(args, search, every, budget: int, batch: int, elapsed: float):
    """The `no-fit` error: nothing compiles, or nothing fits the budget (and what would); the
    candidates skipped, and why, as its notes."""
    from .diagnostics import error
    from .compiler.memory_model import format_bytes
    from .compiler.tune_parallel import skip_lines, skip_summary

    skipped = tuple(skip_lines(skip_summary(search.skipped, no_sequence=search.no_sequence)))
    if not every:
        return error("no-fit", f"no strategy compiles for {args.devices} device(s) and a batch of {batch}",
                     notes=skipped, hint=f"the model has {search.regions} PP region(s); use a device count its pipeline "
                          "schedules fit (p or 2p regions over p devices) or a batch that divides over the devices")
    smallest = min(every, key=lambda r: r.peak_bytes)
    return error("no-fit", f"nothing fits {format_bytes(budget)} per device: the smallest predicted peak is "
                 f"{format_bytes(smallest.peak_bytes)} ({smallest.candidate.label()})",
                 notes=(f"searched {len(every)} strategies in {elapsed:.1f} s", *skipped),
                 hint=f"raise --memory to at least {format_bytes(smallest.peak_bytes)} "
                      f"({smallest.peak_bytes} bytes), use more devices, or a smaller --batch-size")


def _json_rows(search, shown, numbers, measured, beside) -> list[dict]:
    """`--format json`: each shown result, with its group and, where verified, what was measured."""
    tolerance, cal = search.tolerance, search.calibration
    rows = []
    for i, r in enumerate(shown):
        d = r.as_dict()
        d.update(group=numbers[i], tolerance=tolerance, calibrated=cal is not None)
        if i < len(measured):
            d["measured_step_s"], d["measured_peak_bytes"], d["measured_other_load"], d["loadavg"] = measured[i]
            d["step_error"] = r.step_s / measured[i][0] - 1
            if i in beside:
                d["step_s_recalibrated"] = beside[i]
                d["step_error_recalibrated"] = beside[i] / measured[i][0] - 1
            again = at_load(search, r, measured[i][2])
            if again is not None:
                d["step_s_at_measured_load"] = again
                d["step_error_at_measured_load"] = again / measured[i][0] - 1
        rows.append(d)
    return rows


def main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .compiler.memory_model import format_bytes, parse_bytes
    from .compiler.tune_parallel import skip_lines, skip_summary

    try:
        budget = parse_bytes(args.memory)
    except ValueError as err:
        raise _usage(str(err)) from None
    if args.devices < 1:
        raise _usage("--devices takes a number of devices >= 1")
    err_console = Console(stderr=True)
    log = (lambda msg: err_console.print(f"[dim]piper tune: {msg}[/]")) if args.format != "json" else None
    batch = args.batch_size or 16
    start = time.perf_counter()
    search = Search(args.model, args.devices, budget, batch, log=log,
                    tensor=getattr(args, "tensor_parallel", None))
    if getattr(args, "calibrate", True):
        calibration = calibrate(search, log=log, again=getattr(args, "recalibrate", False))
        if calibration is not None:
            search = search.with_calibration(calibration)
    fits, every = search.run()
    elapsed = time.perf_counter() - start
    if not fits:
        raise _nothing_fits(args, search, every, budget, batch, elapsed)
    shown = fits[: args.top]
    measured, beside = _verify(search, fits[: args.verify]) if args.verify else ([], {})
    if args.output:
        best = fits[0].candidate
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(f"# chosen by `piper tune --devices {args.devices} --memory {args.memory} --batch-size {batch}`: "
                    f"predicted step {fits[0].step_s * 1e3:.1f} ms, peak {format_bytes(fits[0].peak_bytes)} per device\n"
                    + best.script())
    tolerance, cal = search.tolerance, search.calibration
    numbers = groups(shown, tolerance)
    again: dict[int, float | None] = {}
    skipped = skip_summary(search.skipped, no_sequence=search.no_sequence)
    if args.format == "json":
        sys.stdout.write(json.dumps({"strategies": _json_rows(search, shown, numbers, measured, beside),
                                     "skipped": skipped}, indent=1) + "\n")
        return 0
    table = Table(title=f"piper tune: {len(fits)} of {len(every)} strategies fit {format_bytes(budget)} per device "
                        f"({args.devices} devices, batch {batch}; searched in {elapsed:.1f} s)")
    columns = ["#", "group", "strategy", "step (predicted)", "bubble", "peak / device (predicted)"]
    if measured:
        columns += ["step (measured)", "error", "peak (measured)"]
    for col in columns:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for i, r in enumerate(shown):
        row = [str(i + 1), f"≈{numbers[i]}", r.candidate.label(), f"{r.step_s * 1e3:.1f} ms", f"{r.bubble:.0%}",
               format_bytes(r.peak_bytes) + ("" if r.exact else " ~")]
        if measured:
            row += ([f"{measured[i][0] * 1e3:.1f} ms", f"{r.step_s / measured[i][0] - 1:+.0%}",
                     format_bytes(measured[i][1])] if i < len(measured) else ["", "", ""])
            if i < len(measured):
                again[i] = at_load(search, r, measured[i][2])
        table.add_row(*row)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)
    for line in group_notes(shown, numbers, tolerance, calibrated=cal is not None):
        console.print(line)
    for line in skip_lines(skipped):
        console.print(line, markup=False)
    for i, step in again.items():
        if step is not None:
            console.print(f"row {i + 1}: {measured[i][2]:.1f} cores busy with other work while it ran (load average "
                          f"{measured[i][3]:.1f}); predicted for that load {step * 1e3:.1f} ms "
                          f"({step / measured[i][0] - 1:+.0%} of the measured step)")
        if i in beside:
            console.print(f"row {i + 1}: recalibrated on {cal.candidate} stepped beside it: predicted "
                          f"{beside[i] * 1e3:.1f} ms ({beside[i] / measured[i][0] - 1:+.0%} of the measured step)")
    if cal is not None:
        console.print(f"[dim]steps predicted with the runtime's costs measured on {cal.candidate} "
                      f"({cal.measured * 1e3:.1f} ms measured, {cal.error:+.0%} predicted; "
                      f"steps varied ±{cal.spread:.0%}"
                      + (f"; {cal.wait * 1e3:.2f} ms more per collective, fitted beside {cal.fitted}, "
                         f"which it predicts {cal.fitted_error or 0.0:+.0%}" if cal.fitted else "")
                      + "),"
                      f" for {cal.external:.1f} of {cal.cores} cores busy with other work as then; "
                      "--recalibrate to measure again[/]")
    else:
        console.print("[dim]steps predicted from the computes alone (--no-calibrate): the runtime's own costs, "
                      "message latency and other load are left out, so a step runs longer than predicted[/]")
    console.print("[dim]~: activations scaled from another microbatch size; costs measured on this machine "
                  "(cached); -o writes the best as a .pps[/]")
    if args.output:
        console.print(f"wrote {args.output}: {fits[0].candidate.label()}")
    return 0


def _usage(message: str):
    from .diagnostics import UsageError

    return UsageError(message)
