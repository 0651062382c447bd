"""Fuzzing `piper check --model` on a small model: meshes, strategies and TP lines against
examples/llama_tp.py's Llama (2 PP regions, 2 blocks), which the check captures and plans for.

A case is a script in the form of `benchmarks/fuzz_tp_scripts.py`'s (its meshes, strategies and
shard lines, patterns drawn mostly from the model's own module names, hostile sizes and
patterns sometimes), mutated half the time. Each runs through `piper check --format json FILE
--model examples/llama_tp.py:make_model` in a worker process that imported torch once, held under
a 2 GiB address-space limit with an alarm after 5 s of CPU a case; the outcomes are
`benchmarks/fuzz_scripts.py`'s (`ok`, or `internal`, `memory`, `timeout`, `crashed`). A case
costs about 1 s (the model's capture), so a long run is hours:

    .venv/bin/python -m benchmarks.fuzz_model_check --cases 100000 --seed 0 --minutes 600
    .venv/bin/python -m benchmarks.fuzz_model_check --cases 50 --show-failures

tests/test_fuzz_model_check.py runs a few dozen of them (drawn by hypothesis) in the default suite.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from .fuzz_scripts import ADDRESS_SPACE, BAD, CASE_SECONDS, REPO, Worker, _alarm, _children_rss_mb, _TimeUp, mutate
from .fuzz_tp_scripts import HOSTILE, tp_script

MODEL = "examples/llama_tp.py:make_model"
MODULES = ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", "blocks.*.mlp.up",
           "blocks.*.attn.o", "blocks.*.mlp.down", "embed", "head", "blocks.0.attn.q", "blocks.1.mlp.up",
           "norm", "blocks", "blocks.*", "**.q", "**", "blocks.*.attn"]
PLAN = ('shard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", '
        '"blocks.*.mlp.up" over tp\nshard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp\n')


def _patterns_of_the_model(text: str, rng: random.Random) -> str:
    """`text` with each statement's quoted patterns swapped for the model's module names (mostly;
    a hostile pattern one time in ten), distinct within the statement."""
    def line(match):
        quoted = re.findall(r'"(?:[^"\\]|\\.)*"', match.group(0))
        names = rng.sample(MODULES, min(len(quoted), len(MODULES)))
        names = [n if rng.random() < 0.9 else rng.choice(HOSTILE[:8]) for n in names]
        return match.group(1) + ", ".join(f'"{n}"' for n in dict.fromkeys(names)) + match.group(3)
    return re.sub(r'^(shard \w+ of )(.*)( over \w+)$', line, text, flags=re.M)


def case(rng: random.Random) -> tuple[str, str]:
    """One fuzz case, (file name, text)."""
    text = tp_script(rng)
    if rng.random() < 0.5:         # Megatron's plan for the model, so many cases plan divided
        text = "\n".join(t for t in text.split("\n") if not t.startswith("shard ")) + PLAN
    else:
        text = _patterns_of_the_model(text, rng)
    return "model.pps", mutate(text, rng) if rng.random() < 0.4 else text


def run_case(folder: str, name: str, text: str, seconds: float = CASE_SECONDS) -> dict:
    """`piper check --format json FILE --model MODEL` on `text`: the outcome, as
    `benchmarks.fuzz_scripts.run_case` gives it."""
    from piper.cli import main
    from piper.diagnostics import PiperError

    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    out, err = io.StringIO(), io.StringIO()
    start = time.process_time()
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main(["check", "--format", "json", path, "--model", MODEL])
        outcome, detail = "ok", ""
    except _TimeUp:
        outcome, detail = "timeout", ""
    except MemoryError:
        outcome, detail = "memory", ""
    except PiperError as error:
        outcome, detail = "ok", error.diagnostics[0].code
    except BaseException as error:     # noqa: BLE001 - what the fuzz is looking for
        outcome, detail = "internal", f"{type(error).__name__}: {error}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    seconds = time.process_time() - start
    if outcome == "ok" and "internal-error" in out.getvalue() + err.getvalue():
        outcome, detail = "internal", (out.getvalue() + err.getvalue())[:300]
    try:
        codes = sorted({d["code"] for d in json.loads(out.getvalue() or "[]")})
    except (ValueError, TypeError, KeyError):
        codes = []
    return {"outcome": outcome, "seconds": round(seconds, 3), "detail": detail, "codes": codes}


def worker(seconds: float = CASE_SECONDS) -> None:
    """`benchmarks.fuzz_scripts.worker` for model cases: torch and the model's file are imported
    (one clean check) before the limit and the cases, so a case's CPU is its own check's."""
    import resource

    os.environ["PIPER_DEBUG"] = "1"
    with tempfile.TemporaryDirectory(prefix="piper-fuzz-model-") as folder:
        run_case(folder, "warm.pps", "mesh tp=2\n" + PLAN, seconds=120.0)
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        signal.signal(signal.SIGPROF, _alarm)
        for line in sys.stdin:
            item = json.loads(line)
            result = run_case(folder, item["name"], item["text"], seconds)
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()


class ModelWorker(Worker):
    """`benchmarks.fuzz_scripts.Worker` running this module's worker."""

    CASES_PER_WORKER = 200

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return subprocess.Popen([sys.executable, "-m", "benchmarks.fuzz_model_check", "--worker",
                                 "--case-seconds", str(self.case_seconds)], cwd=str(REPO),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, encoding="utf-8", errors="surrogateescape", env=env)


def fuzz(cases: int, seed: int, *, minutes: float | None = None, show: bool = False, report=print,
         failures_to: str | None = None) -> dict:
    """Run `cases` cases (or until `minutes` pass): counts per outcome, the slowest, the failures."""
    rng = random.Random(seed)
    counts = dict.fromkeys(("ok",) + BAD, 0)
    failures, slowest, start = [], 0.0, time.monotonic()
    runner = ModelWorker(hang_seconds=120.0)
    try:
        for i in range(cases):
            if minutes is not None and time.monotonic() - start > minutes * 60:
                break
            name, text = case(rng)
            result = runner.run(name, text)
            counts[result["outcome"]] += 1
            slowest = max(slowest, result["seconds"] or 0.0)
            if result["outcome"] in BAD:
                failures.append({"name": name, "text": text, **result})
                if failures_to:
                    with open(failures_to, "a", encoding="utf-8") as f:
                        f.write(json.dumps(failures[-1]) + "\n")
                if show:
                    report(f"--- case {i}: {result['outcome']} {result['detail']}\n{text}")
            if (i + 1) % 100 == 0:
                report(f"{i + 1:,} cases: {counts} ({time.monotonic() - start:.0f} s; slowest case "
                       f"{slowest:.2f} s CPU; largest worker {_children_rss_mb():.0f} MB so far)")
    finally:
        runner.close()
    return {"cases": sum(counts.values()), "counts": counts, "seconds": round(time.monotonic() - start, 1),
            "slowest_case_seconds": slowest, "max_worker_rss_mb": round(_children_rss_mb(), 1),
            "failures": failures}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, help="stop after this long, whatever --cases says")
    parser.add_argument("--show-failures", action="store_true")
    parser.add_argument("--out", help="write the summary and every failing case here (JSON)")
    parser.add_argument("--case-seconds", type=float, default=CASE_SECONDS, help="CPU seconds a case may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.case_seconds)
        return 0
    summary = fuzz(args.cases, args.seed, minutes=args.minutes, show=args.show_failures,
                   report=lambda line: print(line, flush=True),
                   failures_to=args.out + ".failures" if args.out else None)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
