"""Suite 6, `compiler`: time to compile and verify a strategy without running it.

`piper.job.plan(strategy, mesh={"dp": dp, "pp": p}, program=Program.chain("PP=p"))`
for a 1F1B pipeline over p stages with m microbatches (plus `shard batch
over dp` when dp > 1): strategy interpretation, statements, lowering,
scheduling, per-device plans and the simulator's verification. Reports
nodes per second and the growth exponent (slope of log time against log
nodes), then profiles the biggest point that ran.

    python -m benchmarks --suite compiler
    python -m benchmarks.suites.compiler 16 512 8      # one point, as the profiler runs it
"""
from __future__ import annotations

import contextlib
import cProfile
import gc
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import piper

from ..harness.results import SuiteResult, Table
from ..harness.timing import fit_exponent
from ..harness.workloads import REPO, schedule_strategy

POINT_LIMIT_S = 60.0          # skip a point predicted (or seen) to take longer
# The functions piper.job.plan calls, timed by name (whichever exist: the compiler is still changing).
PHASES = ("build_strategy", "initial_ir", "apply_all", "compile_ir", "simulate", "check", "verify")


def grid(quick: bool) -> list[tuple[int, int, int]]:
    """(p, m, dp) points, smallest first within each dp."""
    if quick:
        ps, ms_, dps = (4, 8), (8, 16), (1, 2)
    else:
        ps, ms_, dps = (4, 16, 64), (8, 64, 512), (1, 8)
    return sorted(((p, m, dp) for p in ps for m in ms_ for dp in dps), key=lambda x: (x[2], x[0] * x[1], x[0]))


def strategy_for(p: int, m: int, dp: int):
    """1F1B over pp (the stdlib script when it loads), data parallel over dp when dp > 1."""
    base, source, _ = schedule_strategy("1f1b", pp=p, microbatches=m)
    if dp == 1:
        return base, source

    @piper.strategy
    def composed(s):
        s.use(base)
        s.shard("batch", over="dp")

    return composed, f"{source} + shard batch over dp"


@contextlib.contextmanager
def phase_timer():
    """Time the steps of `piper.job.plan` by wrapping the functions it calls (restored afterwards)."""
    import piper.job as job_module
    import piper.compiler.planning as planning_module

    spent: Counter = Counter()
    # plan() builds the strategy in piper.job and compiles in piper.compiler.planning.
    originals = {(module, name): getattr(module, name) for module in (job_module, planning_module)
                 for name in PHASES if callable(getattr(module, name, None))}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    for (module, name), fn in originals.items():
        setattr(module, name, timed(name, fn))
    try:
        yield spent
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise _Timeout after `seconds` (SIGALRM; a no-op off the main thread or without SIGALRM)."""
    import threading

    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def compile_point(p: int, m: int, dp: int, *, profiler: cProfile.Profile | None = None):
    """Plan one point: (compiled, seconds, per-phase seconds, strategy source).

    `profiler`, if given, is enabled around `plan` only (not the stdlib look-up).
    """
    from piper.frontend.capture import Program
    from piper.job import plan

    strategy, source = strategy_for(p, m, dp)
    program = Program.chain(f"PP={p}")
    with phase_timer() as spent:
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        compiled = plan(strategy, mesh={"dp": dp, "pp": p}, program=program)
        seconds = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
    return compiled, seconds, dict(spent), source


FRESH_OVER_S = 0.3        # points predicted longer run in fresh processes


def fresh_point(p: int, m: int, dp: int) -> dict:
    """Plan one point in a new interpreter, as `piper check` on a big mesh would: no heap left over
    from the points before it (which made the biggest point about 25% slower in-process)."""
    import json

    out = subprocess.run([sys.executable, "-m", "benchmarks.suites.compiler", str(p), str(m), str(dp), "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=POINT_LIMIT_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _predict(done: list[dict], p: int, m: int, dp: int) -> float | None:
    """Extrapolate from the biggest finished point with the same dp, by size p*m."""
    same = [d for d in done if d["dp"] == dp and d["seconds"] > 0]
    if not same:
        return None
    base = max(same, key=lambda d: d["p"] * d["m"])
    big = [d for d in same if d["seconds"] > 0.05]
    k = fit_exponent([d["p"] * d["m"] for d in big], [d["seconds"] for d in big]) if len(big) >= 2 else None
    k = min(max(k or 1.5, 1.0), 3.0)
    return base["seconds"] * ((p * m) / (base["p"] * base["m"])) ** k


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    budget = 60.0 if quick else 240.0
    result = SuiteResult("compiler", 6, "Compile + verify time and scaling", ctx.command("compiler"))
    table = Table("piper.job.plan on Program.chain(PP=p): 1F1B over pp with m microbatches (+ shard batch over dp)",
                  ["p", "m", "dp", "devices", "IR nodes", "plan actions", "seconds", "nodes/s",
                   "strategy", "statements", "compile_ir", "verify"])
    done: list[dict] = []
    sources = set()
    t_suite = time.perf_counter()
    for p, m, dp in grid(quick):
        predicted = _predict(done, p, m, dp)
        elapsed = time.perf_counter() - t_suite
        if predicted is not None and predicted > POINT_LIMIT_S:
            table.add(p, m, dp, p * dp, None, None, f"skipped (predicted {predicted:.0f} s > {POINT_LIMIT_S:.0f} s)",
                      *[None] * 5)
            continue
        if predicted is not None and elapsed + predicted > budget:
            table.add(p, m, dp, p * dp, None, None, f"skipped (suite budget {budget:.0f} s; predicted {predicted:.0f} s)",
                      *[None] * 5)
            continue
        ctx.log(f"compiler: p={p} m={m} dp={dp}" + (f" (predicted {predicted:.1f} s)" if predicted else ""))
        try:
            fresh = predicted is not None and predicted >= FRESH_OVER_S
            seconds, spent, source, nodes, actions = _time_point(p, m, dp, fresh=fresh)
        except (_Timeout, subprocess.TimeoutExpired):
            table.add(p, m, dp, p * dp, None, None, f"stopped after {POINT_LIMIT_S:.0f} s", *[None] * 5)
            done.append({"p": p, "m": m, "dp": dp, "seconds": POINT_LIMIT_S, "nodes": None})
            continue
        sources.add(source)
        table.add(p, m, dp, p * dp, nodes, actions, seconds, nodes / seconds, *_phase_shares(spent, seconds))
        done.append({"p": p, "m": m, "dp": dp, "seconds": seconds, "nodes": nodes, "actions": actions})
        result.metrics[f"p{p}.m{m}.dp{dp}.seconds"] = seconds
        result.metrics[f"p{p}.m{m}.dp{dp}.nodes_per_s"] = nodes / seconds
    ran = [d for d in done if d["nodes"]]
    table.notes += _notes(sources)
    result.tables += [table, _exponents(ran, result)]
    if ran:
        biggest = max(ran, key=lambda d: d["nodes"])
        ctx.log(f"compiler: profiling p={biggest['p']} m={biggest['m']} dp={biggest['dp']}")
        result.tables.append(profile_point(biggest["p"], biggest["m"], biggest["dp"], use_pyspy=not quick))
    return result


def _time_point(p: int, m: int, dp: int, *, fresh: bool) -> tuple[float, dict, str, int, int]:
    """(seconds, per-phase seconds, strategy source, IR nodes, plan actions) of one point: the median of
    three runs, each in a fresh process (`fresh`) or here after gc.collect()."""
    if fresh:
        runs = sorted((fresh_point(p, m, dp) for _ in range(3)), key=lambda r: r["seconds"])
        run_ = runs[1]          # the median of three fresh processes
        return tuple(run_[k] for k in ("seconds", "phases", "source", "nodes", "actions"))
    with time_limit(POINT_LIMIT_S):
        runs = []
        for _ in range(3):         # median of 3 (one GC pause can double a small point)
            gc.collect()
            runs.append(compile_point(p, m, dp))
        compiled, seconds, spent, source = sorted(runs, key=lambda r: r[1])[1]
        nodes = len(compiled.ir.nodes)
        actions = sum(len(plan) for plan in compiled.plans.values())
        del compiled, runs
    return seconds, spent, source, nodes, actions


def _phase_shares(spent: dict[str, float], seconds: float) -> list[str | None]:
    """The four phase columns: strategy, statements, compile_ir, verify, as shares of the planning time."""
    total = sum(spent.values()) or seconds

    def share(*names):
        if not any(n in spent for n in names):
            return None
        return f"{100 * sum(spent.get(n, 0.0) for n in names) / total:.0f}%"

    return [share("build_strategy"), share("initial_ir", "apply_all"), share("compile_ir"),
            share("simulate", "check", "verify")]


def _exponents(ran: list[dict], result: SuiteResult) -> Table:
    """The growth exponent of seconds against IR nodes: over every point, dp=1, and the largest dp."""
    exponents = Table("Growth exponent: least-squares slope of log(seconds) against log(IR nodes)",
                      ["points", "exponent", "range of nodes"])
    for label, pts in (("all", ran), ("dp=1", [d for d in ran if d["dp"] == 1]),
                       (f"dp={max(d['dp'] for d in ran) if ran else '-'}",
                        [d for d in ran if ran and d["dp"] == max(x["dp"] for x in ran) and d["dp"] > 1])):
        pts = [d for d in pts if d["seconds"] > 0.02] or pts    # tiny points are timer noise
        k = fit_exponent([d["nodes"] for d in pts], [d["seconds"] for d in pts])
        if k is not None:
            exponents.add(f"{label} ({len(pts)})", f"{k:.2f}",
                          f"{min(d['nodes'] for d in pts):,} – {max(d['nodes'] for d in pts):,}")
            result.metrics[f"exponent.{label.replace('=', '')}"] = k
    exponents.notes.append("1.0 is linear; points under 20 ms are left out of the fit (timer noise).")
    return exponents


def _notes(sources: set[str]) -> list[str]:
    return [
        f"strategy source: {', '.join(sorted(sources)) or '—'}.",
        "IR nodes: the lowered global DAG (compute, SEND/RECV and collective nodes); plan actions: the sum of "
        "every device's plan length. The phase columns split the time of piper.job.plan: strategy = building "
        "the directives (the .pps interpreter), statements = initial_ir + apply_all, compile_ir = placement, "
        "transfers, scheduling, collectives and projection (with the walk that finds whether the plans can "
        "deadlock), verify = what the deadlock check simulates beyond that (nothing, unless the walk cannot tell).",
        f"A point predicted (by the fitted growth from smaller points) to take over {POINT_LIMIT_S:.0f} s is "
        f"skipped; one that runs over is stopped at {POINT_LIMIT_S:.0f} s.",
        f"seconds: the median of 3 runs; points predicted to take {FRESH_OVER_S} s or more run each time in a "
        "fresh process (python -m benchmarks.suites.compiler P M DP --json), as a user's one `piper check` "
        "would, smaller ones in this process after gc.collect().",
    ]


# -- profiling -------------------------------------------------------------------------------------

def _where(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except (ValueError, OSError):
        parts = Path(path).parts
        return str(Path(*parts[-3:])) if len(parts) > 3 else path


def profile_point(p: int, m: int, dp: int, *, use_pyspy: bool, top: int = 12) -> Table:
    """Profile one point: py-spy (sampling, in a subprocess) when available, else cProfile in-process."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if use_pyspy and os.path.exists(pyspy):
        table = _pyspy(pyspy, p, m, dp, top)
        if table is not None:
            return table
    return _cprofile(p, m, dp, top)


def _pyspy(pyspy: str, p: int, m: int, dp: int, top: int) -> Table | None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        cmd = [pyspy, "record", "--format", "raw", "--rate", "100", "--output", str(raw), "--",
               sys.executable, "-m", "benchmarks.suites.compiler", str(p), str(m), str(dp)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0 or not raw.exists():
            return None
        stacks = []
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks.append((stack.split(";"), int(count)))
    # Only samples inside piper.job.plan: start-up and imports are not the compiler.
    inside = [(frames[next(i for i, f in enumerate(frames) if f.startswith("plan ") and "piper/job/__init__.py" in f):], n)
              for frames, n in stacks if any(f.startswith("plan ") and "piper/job/__init__.py" in f for f in frames)]
    total = sum(n for _, n in inside)
    if not total:
        return None
    own: Counter = Counter()
    cumulative: Counter = Counter()
    for frames, n in inside:
        # A dataclass's generated __init__ lives in "<string>": name its caller instead.
        leaf = frames[-1]
        if "(<string>:" in leaf and len(frames) > 1:
            leaf = f"{leaf} [called from {frames[-2]}]"
        own[leaf] += n
        for name in dict.fromkeys(_function(f) for f in frames):
            cumulative[name] += n
    table = Table(f"Profile of the biggest point that ran (p={p}, m={m}, dp={dp}): py-spy, {total} samples at 100 Hz "
                  "inside piper.job.plan", ["kind", "where (file:line)", "function", "share of samples"])
    for frame, n in own.most_common(top):
        frame, _, caller = frame.partition(" [called from ")
        func, loc = _split(frame)
        if caller:
            cfunc, cloc = _split(caller.rstrip("]"))
            func = f"{func} (called from {cfunc}, {cloc})"
        table.add("self", loc, func, f"{100 * n / total:.1f}%")
    shown = [(name, n) for name, n in cumulative.most_common()
             if name[0] != "plan" and not name[1].startswith("benchmarks/")][:top]
    for (func, loc), n in shown:
        table.add("inclusive", loc, func, f"{100 * n / total:.1f}%")
    table.notes.append("self: the line a sample was executing; inclusive: samples with the function anywhere "
                       "on the stack (file:line is the function's first sampled line).")
    table.notes.append("Line numbers are those of the working tree when this ran (piper/ is still changing).")
    table.notes.append(f"reproduce: py-spy record --format raw -o profile.txt -- python -m benchmarks.suites.compiler "
                       f"{p} {m} {dp}")
    return table


def _split(frame: str) -> tuple[str, str]:
    """'func (path:line)' -> ('func', 'relpath:line')."""
    func, _, loc = frame.rpartition(" (")
    path, _, line = loc.rstrip(")").rpartition(":")
    return func, f"{_where(path)}:{line}"


_first_line: dict[tuple[str, str], str] = {}


def _function(frame: str) -> tuple[str, str]:
    func, loc = _split(frame)
    path = loc.rpartition(":")[0]
    key = (func, path)
    return func, _first_line.setdefault(key, loc)


def _cprofile(p: int, m: int, dp: int, top: int) -> Table:
    profiler = cProfile.Profile()
    compile_point(p, m, dp, profiler=profiler)
    stats = pstats.Stats(profiler)
    entries = stats.stats  # (file, line, func) -> (cc, nc, tottime, cumtime, callers)
    total = max((v[3] for k, v in entries.items() if k[2] == "plan" and k[0].endswith("job/__init__.py")), default=0) or \
        sum(v[2] for v in entries.values())
    table = Table(f"Profile of the biggest point that ran (p={p}, m={m}, dp={dp}): cProfile, {total:.2f} s in "
                  "piper.job.plan (deterministic profiling slows Python-heavy code)",
                  ["kind", "where (file:line)", "function", "share of time"])
    for (path, line, func), v in sorted(entries.items(), key=lambda kv: -kv[1][2])[:top]:
        table.add("self", f"{_where(path)}:{line}", func, f"{100 * v[2] / total:.1f}%")
    inclusive = [(k, v) for k, v in entries.items()
                 if _where(k[0]).startswith(("piper/", "dsl/")) and k[2] != "plan"]
    for (path, line, func), v in sorted(inclusive, key=lambda kv: -kv[1][3])[:top]:
        table.add("inclusive", f"{_where(path)}:{line}", func, f"{100 * v[3] / total:.1f}%")
    table.notes.append("self: time in the function's own code (file:line is where it is defined); inclusive: "
                       "with everything it calls (functions in piper/ and dsl/ only).")
    return table


# -- where `piper check` spends its time, pass by pass --------------------------------------------

def pass_times(script: str, regions: int, repeats: int = 5) -> dict[str, float]:
    """CPU seconds (the least of `repeats`, each on the same input) of every step
    `piper check FILE --regions PP=<regions>` takes after running the script: the
    statements and each pass of `compile_ir`, with the cyclic collector paused as
    the check pauses it. A pass's input is built once by the passes before it; the
    passes from `add_transfers` on fill one table, so each repeat starts from a copy
    of the table it read. `project` includes the walk that finds each action's waits
    and whether the verifier's replay runs to the end (`piper.compiler.replay`);
    `check` is what the compile does with that, and `verify` the replay's times,
    which only a caller that asks for them pays.

        python -m benchmarks.suites.compiler --passes big.pps 64
    """
    from piper.compiler import plans as compiler
    from piper.compiler.plan_waits import waits_by_number
    from piper.compiler.simulate import check, verify
    from piper.dsl import load_strategy
    from piper.frontend.capture import Program
    from piper.ir import lower
    from piper.ir.statements import apply_all, initial_ir

    mesh, directives = load_strategy(Path(script).read_text(), file=script).build(None)
    spent: dict[str, float] = {}

    def timed(name, fn, fresh=lambda: None):
        best = out = None
        for _ in range(repeats):
            fresh()
            t0 = time.process_time()
            out = fn()
            seconds = time.process_time() - t0
            best = seconds if best is None else min(best, seconds)
        spent[name] = best
        return out

    collecting = gc.isenabled()
    gc.disable()
    try:
        ir = timed("statements", lambda: apply_all(initial_ir(Program.chain({"PP": regions}), mesh), directives))
        placed = timed("resolve_placement", lambda: lower.resolve_placement(ir, []))
        zero = lower.zero_levels(placed)
        table = timed("add_transfers", lambda: lower.lower_transfers(placed))
        order, computes_at = timed("schedule", lambda: compiler.schedule_table(table))
        columns = (table.nodes, table.ops, table.groups, table.pairs, table.peer_groups)
        size = len(table.nodes)

        def unplaced():         # the table as the schedule left it: the collectives join it
            for column in columns:
                del column[size:]

        order, (src, dst), release = timed("add_collectives", lambda: compiler.place_collectives(
            table, order, zero, computes_at), unplaced)
        table.src += src
        table.dst += dst
        waits = timed("waits", lambda: waits_by_number(table))
        plans = timed("project", lambda: compiler.project_table(table, order, release, waits))
        compiled = compiler.Compiled(None, None, plans, zero)
        timed("check", lambda: check(compiled))
        replay_args = plans._replay
        timed("verify", lambda: verify(compiled), lambda: setattr(plans, "_replay", replay_args))
    finally:
        if collecting:
            gc.enable()
    return spent


if __name__ == "__main__" and sys.argv[1:2] == ["--passes"]:
    times = pass_times(sys.argv[2], int(sys.argv[3]))
    for name, seconds in times.items():
        print(f"{name:18s} {seconds:.3f} s CPU")
    print(f"{'sum':18s} {sum(times.values()):.3f} s CPU")
elif __name__ == "__main__":
    # One point, for the profiler or a fresh process: python -m benchmarks.suites.compiler P M DP [--json]
    p_, m_, dp_ = (int(x) for x in sys.argv[1:4])
    compiled_, secs, phases, src = compile_point(p_, m_, dp_)
    if "--json" in sys.argv:
        import json

        print(json.dumps({"seconds": secs, "phases": phases, "source": src, "nodes": len(compiled_.ir.nodes),
                          "actions": sum(len(plan) for plan in compiled_.plans.values())}))
    else:
        print(f"p={p_} m={m_} dp={dp_}: {secs:.2f} s ({src}); "
              + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
