"""What every suite shares: results as data, the A/B alternation, the Ray
cluster, and a description of the machine.

A suite returns a `SuiteResult`: tables of formatted cells (what a reader
sees) and `metrics`, a flat dict of the raw numbers (what tests and scripts
read).
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


# -- results --------------------------------------------------------------------------------------

@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells) -> None:
        self.rows.append([fmt(c) for c in cells])


@dataclass
class SuiteResult:
    name: str
    number: int
    title: str
    command: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    implemented: bool = True


def fmt(value) -> str:
    """Cells: floats to 3 significant digits, None to an em dash, the rest as str."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "—"
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def short_error(exc: BaseException) -> str:
    """One line for a table cell: a PiperError's first line (its message), else the exception's last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    from piper.diagnostics import PiperError

    text = (lines[0] if isinstance(exc, PiperError) else lines[-1]) if lines else ""
    return f"{type(exc).__name__}: {text}"[:200]


def compile_or_failure(ctx, build):
    """`build()` (Piper's side of a comparison: a compiled job), or None and the failure for the
    table cell, its traceback in the log: one side failing leaves the other's numbers standing."""
    import traceback

    try:
        return build(), None
    except Exception as exc:
        ctx.log(traceback.format_exc())
        return None, f"failed: {short_error(exc)}"


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


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


# -- the Ray cluster ---------------------------------------------------------------------------------

@contextmanager
def ray_cluster():
    """A local Ray cluster for the suites that start workers; reuses one already running.

    Workers take a sliver of CPU each (as Piper's do), so a 4-device mesh and a
    4-process baseline can both be alive on a 2-core machine.
    """
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    owned = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        owned = True
    try:
        yield
    finally:
        if owned:
            ray.shutdown()


# -- the machine -------------------------------------------------------------------------------------

def machine(device: str = "cpu") -> dict[str, str]:
    """Cores, memory, CPU model and library versions (and the GPUs on CUDA), for the results header."""
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cores": str(os.cpu_count()), "torch": torch.__version__}
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        info["ray"] = "not installed"
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        info["memory"] = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        info["memory"] = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    try:
        info["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    if device == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["gpus"] = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
        info["cuda"] = str(torch.version.cuda)
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError):
            info["nccl"] = "unknown"
    else:
        info["threads per worker"] = ("1 (Ray sets OMP_NUM_THREADS=1 in actors; baselines call "
                                      "torch.set_num_threads(1))")
    return info


def python_command(args: list[str]) -> str:
    """The shell command that reruns the harness with `args`."""
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    return " ".join([exe, "-m", "benchmarks", *args])
