"""Fuzzing `piper check` with mutated real scripts: every case must end in diagnostics, in bounded
time and memory.

The seeds are the standard library's and the examples' `.pps` files; a case is
one of them with a few edits: a number swapped for a hostile one (0, -1, 2^62,
a 5,000-digit number, 4,000,000 microbatches), a token dropped, doubled or
replaced from the language's vocabulary, a line dropped, doubled, swapped or
re-indented. Each case runs through `piper check` itself (its JSON output, the
planning of the regions the script names included) in a worker process held
under a 2 GiB address-space limit (RLIMIT_AS), with a per-case alarm after 5 s
of CPU time (the machine may be shared; the parent also gives up on a case
whose worker spent 10 s of CPU time, or 10 minutes of wall time, without an
answer, in case the alarm cannot fire). A case's
outcome is `ok` (diagnostics came back), `internal` (an exception that is not
the project's own `PiperError`, or an internal-error diagnostic), `memory`
(MemoryError), `timeout` (past the alarm) or `crashed` (the worker died).

    .venv/bin/python -m benchmarks.fuzz_scripts --cases 100000 --seed 0     # the benchmark run
    .venv/bin/python -m benchmarks.fuzz_scripts --cases 200 --show-failures

tests/test_fuzz_scripts.py runs a few hundred cases of it (drawn by hypothesis)
in the default suite.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ADDRESS_SPACE = 2 << 30           # bytes: what a worker may map, as the brief of `piper check` promises
CASE_SECONDS = 5.0                # a case past this much CPU time is a time-out (CPU: the machine is shared)
BAD = ("internal", "memory", "timeout", "crashed")

NUMBERS = ["0", "1", "-1", "2", "3", "7", "64", "100", "512", "8191", "8192", "8193", "65536", "100000",
           "4000000", str(2**31), str(2**62), str(2**62 + 1), str(2**63), "9" * 40, "9" * 5000]
VOCABULARY = [
    "mesh", "import", "strategy", "let", "split", "into", "place", "on", "shard", "over", "use", "for", "in",
    "if", "else", "order", "recompute", "and", "or", "not", "true", "false", "batch", "optimizer", "grads",
    "params", "experts", "MB", "B", "BI", "BW", "F", "UPD", "PP", "EP", "pp", "dp", "ep", "axis", "size", "min",
    "max", "s", "m", "p", "microbatches", "virtual", "zero3", "one_f_one_b", "dualpipev", "zbv", "=", "==", "<",
    "+", "-", "*", "//", "%", "(", ")", "[", "]", ":", ";", ",", "..", '"a.pps"', '"""doc"""', "#", "*",
]
_TOKEN = re.compile(r"\d+|\w+|\.\.|//|==|!=|<=|>=|[^\w\s]|\s+")


def seeds() -> list[tuple[str, str]]:
    """(file name, text) of every standard-library and example script."""
    paths = sorted((REPO / "stdlib").glob("*.pps")) + sorted((REPO / "examples").glob("*.pps"))
    return [(p.name, p.read_text(encoding="utf-8")) for p in paths]


def _with_use(name: str, text: str) -> str:
    """A stdlib file defines a strategy and runs nothing: give it a mesh and a `use`, so the
    concrete run and the planning of its regions are fuzzed too."""
    head = re.match(r"strategy (\w+)\(([^)]*)\)", text)
    if head is None or re.search(r"^(use|mesh) ", text, re.M):
        return text
    params = head.group(2)
    args = ", ".join(f"{p}=4" for p in ("microbatches", "virtual") if re.search(rf"\b{p}\b", params))
    axis = "dp" if re.search(r"axis\s*=\s*dp", params) else "pp"
    return f"mesh {axis}=4\n{text}\nuse {head.group(1)}({args}) on {axis}\n"


def mutate(text: str, rng: random.Random, edits: int | None = None) -> str:
    """`text` with 1 to 4 random edits of its numbers, tokens and lines."""
    for _ in range(edits if edits is not None else rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.45:                       # a token: a number swapped, or dropped, doubled, replaced
            tokens = _TOKEN.findall(text)
            spots = [i for i, t in enumerate(tokens) if not t.isspace()]
            if not spots:
                continue
            numbers = [i for i in spots if tokens[i].isdigit()]
            if numbers and rng.random() < 0.6:
                tokens[rng.choice(numbers)] = rng.choice(NUMBERS)
            else:
                i = rng.choice(spots)
                what = rng.random()
                tokens[i] = "" if what < 0.3 else tokens[i] * 2 if what < 0.5 else rng.choice(VOCABULARY + NUMBERS)
            text = "".join(tokens)
        else:                                 # a line: dropped, doubled, swapped, re-indented, or a loop around it
            lines = text.split("\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            what = rng.random()
            if what < 0.2:
                del lines[i]
            elif what < 0.4:
                lines.insert(i, lines[i])
            elif what < 0.55:
                lines[i], lines[j] = lines[j], lines[i]
            elif what < 0.75:
                lines[i] = " " * rng.choice((0, 2, 4, 8, 12)) + lines[i].lstrip()
            else:
                indent = re.match(r"\s*", lines[i]).group(0)
                lines[i:i + 1] = [f"{indent}for q in 0..{rng.choice(NUMBERS)}:", "    " + lines[i]]
            text = "\n".join(lines)
    return text


def case(rng: random.Random, pool=None) -> tuple[str, str]:
    """One fuzz case, (file name, text): a seed, mutated."""
    name, text = rng.choice(pool or _POOL)
    return name, mutate(text, rng)


_POOL = [(name, _with_use(name, text)) for name, text in seeds()]


# ---- the worker: cases in, outcomes out, under the address-space limit


class _TimeUp(BaseException):
    """A case ran past its alarm (a BaseException, so no `except Exception` in Piper swallows it)."""


def _alarm(signum, frame):
    raise _TimeUp


def run_limited(act, seconds: float = CASE_SECONDS, *, where: bool = False) -> dict:
    """`act()` (which returns its outcome and detail) under the CPU alarm of `seconds`, its ending
    classified: `timeout` (the alarm), `memory` (MemoryError), `ok` (the project's own PiperError,
    its first code the detail), `internal` (any other exception; with `where`, the line it came from).
    Every fuzzer's one case runs through here."""
    from piper.diagnostics import PiperError

    start = time.process_time()
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        outcome, detail = act()
    except _TimeUp:
        outcome, detail = "timeout", ""
    except MemoryError:
        outcome, detail = "memory", ""
    except PiperError as error:        # the project's own: a diagnostic
        outcome, detail = "ok", error.diagnostics[0].code
    except BaseException as error:     # noqa: BLE001 - what the fuzz is looking for
        if where:
            import traceback

            detail = (f"{type(error).__name__}: {error} @ "
                      f"{traceback.format_exc().splitlines()[-3].strip()}")[:400]
        else:
            detail = f"{type(error).__name__}: {error}"[:300]
        outcome = "internal"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    return {"outcome": outcome, "seconds": round(time.process_time() - start, 3), "detail": detail}


def check_case(folder: str, name: str, text: str, seconds: float = CASE_SECONDS, extra: tuple = ()) -> dict:
    """`piper check --format json` (then `extra`) on `text`, saved as `folder/name`: the outcome, its
    seconds, what went wrong where it did, and the codes of the diagnostics."""
    from piper.cli import main

    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    out, err = io.StringIO(), io.StringIO()

    def act():
        with redirect_stdout(out), redirect_stderr(err):
            main(["check", "--format", "json", path, *extra])
        return "ok", ""

    result = run_limited(act, seconds)
    if result["outcome"] == "ok" and "internal-error" in out.getvalue() + err.getvalue():
        result.update(outcome="internal", detail=(out.getvalue() + err.getvalue())[:300])
    try:
        result["codes"] = sorted({d["code"] for d in json.loads(out.getvalue() or "[]")})
    except (ValueError, TypeError, KeyError):
        result["codes"] = []
    return result


def run_case(folder: str, name: str, text: str, seconds: float = CASE_SECONDS) -> dict:
    """`piper check --format json` on `text`, saved as `folder/name` (`check_case`)."""
    return check_case(folder, name, text, seconds)


def serve(run_one, seconds: float = CASE_SECONDS, *, prefix: str, prepare=None, prepare_unlimited: bool = False):
    """A worker's loop: cases (JSON lines) from stdin, each `run_one(folder, case, seconds)` in a scratch
    folder, outcomes (JSON lines) to stdout; under the address-space limit and the alarm's handler,
    set before `prepare(folder)` (the worker's one-off setup) or, with `prepare_unlimited`, after it."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        signal.signal(signal.SIGPROF, _alarm)

    if not prepare_unlimited:
        limit()
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        if prepare is not None:
            prepare(folder)
        if prepare_unlimited:
            limit()
        for line in sys.stdin:
            result = run_one(folder, json.loads(line), seconds)
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()


def worker(seconds: float = CASE_SECONDS) -> None:
    """Read cases (JSON lines: name, text) from stdin; write outcomes (JSON lines) to stdout; a case
    past `seconds` of CPU time is a time-out."""
    os.environ["PIPER_DEBUG"] = "1"      # exceptions reach run_case instead of an internal-error line
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    serve(lambda folder, item, secs: run_case(folder, item["name"], item["text"], secs), seconds,
          prefix="piper-fuzz-")


class Worker:
    """A worker process under the address-space limit; `run` sends it one case. A case that kills
    it, or gets no answer while the worker spends 5 s of CPU past the alarm or for 10 x
    `hang_seconds` of wall time (the alarm did not fire: a hang in C), comes back as `crashed`
    or `timeout`, and the next case starts a new worker."""

    def __init__(self, hang_seconds: float = 60.0, case_seconds: float = CASE_SECONDS):
        self.hang_seconds, self.case_seconds = hang_seconds, case_seconds
        self.proc: subprocess.Popen | None = None
        self.cases = 0

    MODULE = "benchmarks.fuzz_scripts"    # the module whose `--worker` runs the cases

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return subprocess.Popen([sys.executable, "-m", self.MODULE, "--worker",
                                 "--case-seconds", str(self.case_seconds)], cwd=str(REPO),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, encoding="utf-8", errors="surrogateescape", env=env)

    CASES_PER_WORKER = 500      # a long-lived worker's heap grows (caches, fragments): start afresh

    def run(self, name: str, text: str) -> dict:
        if self.proc is not None and self.cases >= self.CASES_PER_WORKER:
            self.close()
        if self.proc is None or self.proc.poll() is not None:
            self.proc, self.cases = self._start(), 0
        self.cases += 1
        try:
            self.proc.stdin.write(json.dumps({"name": name, "text": text}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._lost("crashed", "the worker died before reading the case")
        started, cpu_at_start = time.monotonic(), self._cpu()
        while not select.select([self.proc.stdout], [], [], min(self.hang_seconds, 10.0))[0]:
            # No answer yet: a hang only if the worker has spent more CPU than the alarm allows (the
            # alarm did not fire), or no answer came for ten times the wait; a starved worker on a
            # shared machine (nice, load) is waited for.
            cpu = self._cpu() - cpu_at_start
            if cpu > self.case_seconds + 5 or time.monotonic() - started > 10 * self.hang_seconds:
                return self._lost("timeout", f"no answer after {cpu:.1f} s CPU, "
                                             f"{time.monotonic() - started:.0f} s wall")
        line = self.proc.stdout.readline()
        if not line:
            return self._lost("crashed", f"the worker exited ({self.proc.wait()})")
        result = json.loads(line)
        if result["outcome"] == "memory":    # its heap is near the limit now: the next case gets a fresh one
            self.close()
        return result

    def _cpu(self) -> float:
        """The worker's CPU seconds so far (Linux's /proc; 0 where it cannot be read)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return 0.0

    def _lost(self, outcome: str, detail: str) -> dict:
        self.close()
        return {"outcome": outcome, "seconds": None, "detail": detail}

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None


def drive(make_case, seed: int, runner, cases: int, *, minutes: float | None = None, show: bool = False,
          report=print, failures_to: str | None = None, slow_over: float | None = None,
          outcomes: tuple = ("ok",) + BAD, every: int = 1000, show_name: bool = False,
          show_chars: int | None = None, record_name: bool = True, progress_rss: bool = True) -> dict:
    """Every fuzzer's parent loop: `cases` cases of `make_case(rng)` (name, text) through `runner` (a
    `Worker`, which restarts a dead one), or until `minutes` pass; counts per outcome, the slowest case,
    the failures (each also appended to `failures_to`, one JSON line, as it happens; so is every `ok`
    case over `slow_over` CPU seconds, to find what is near the time-out), a progress line every
    `every` cases."""
    rng = random.Random(seed)
    counts = dict.fromkeys(outcomes, 0)
    failures, slowest, start = [], 0.0, time.monotonic()
    try:
        for i in range(cases):
            if minutes is not None and time.monotonic() - start > minutes * 60:
                break
            name, text = make_case(rng)
            result = runner.run(name, text)
            counts[result["outcome"]] += 1
            slowest = max(slowest, result.get("seconds") or 0.0)
            if slow_over is not None and result["outcome"] == "ok" and (result["seconds"] or 0) > slow_over \
                    and failures_to:
                with open(failures_to, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"name": name, "text": text, **result, "outcome": "slow"}) + "\n")
            if result["outcome"] in BAD:
                failures.append({"name": name, "text": text, **result} if record_name else {"text": text, **result})
                if failures_to:
                    with open(failures_to, "a", encoding="utf-8") as f:
                        f.write(json.dumps(failures[-1]) + "\n")
                if show:
                    report(f"--- case {i}{f' ({name})' if show_name else ''}: {result['outcome']} "
                           f"{result['detail']}\n{text[:show_chars] if show_chars else text}")
            if (i + 1) % every == 0:
                rss = f"; largest worker {_children_rss_mb():.0f} MB so far" if progress_rss else ""
                report(f"{i + 1:,} cases: {counts} ({time.monotonic() - start:.0f} s; slowest case "
                       f"{slowest:.2f} s CPU{rss})")
    finally:
        runner.close()
    return {"cases": sum(counts.values()), "counts": counts, "seconds": round(time.monotonic() - start, 1),
            "slowest_case_seconds": slowest, "max_worker_rss_mb": round(_children_rss_mb(), 1),
            "failures": failures}


def fuzz(cases: int, seed: int, *, minutes: float | None = None, show: bool = False, report=print,
         failures_to: str | None = None, slow_over: float | None = None) -> dict:
    """Run `cases` cases (or until `minutes` pass) through `drive`."""
    return drive(case, seed, Worker(), cases, minutes=minutes, show=show, report=report,
                 failures_to=failures_to, slow_over=slow_over, show_name=True)


def _children_rss_mb() -> float:
    """The peak resident memory of the largest worker that has ended (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def cli(argv, description: str, run_fuzz, run_worker=None, *, slow: bool = False) -> int:
    """Every fuzzer's command line: the flags, the worker (with `run_worker`: `--case-seconds`, `--worker`),
    the run by `run_fuzz(cases, seed, ...)` and its summary; 1 where a case failed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, help="stop after this long, whatever --cases says")
    parser.add_argument("--show-failures", action="store_true")
    parser.add_argument("--out", help="write the summary and every failing case here (JSON)")
    if slow:
        parser.add_argument("--slow", type=float, help="also write `ok` cases over this many CPU seconds to "
                            "--out's failures file")
    if run_worker is not None:
        parser.add_argument("--case-seconds", type=float, default=CASE_SECONDS,
                            help="CPU seconds a case may take")
        parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if run_worker is not None and args.worker:
        run_worker(args.case_seconds)
        return 0
    extra = {"slow_over": args.slow} if slow else {}
    summary = run_fuzz(args.cases, args.seed, minutes=args.minutes, show=args.show_failures,
                       report=lambda line: print(line, flush=True),
                       failures_to=args.out + ".failures" if args.out else None, **extra)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if not summary["failures"] else 1


def main(argv=None) -> int:
    return cli(argv, __doc__.split("\n")[0], fuzz, worker, slow=True)


if __name__ == "__main__":
    sys.exit(main())
