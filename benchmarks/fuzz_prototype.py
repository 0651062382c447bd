"""Fuzzing `piper import` over mutated prototype programs: every case is a diagnostic or a script, never a crash.

    python -m benchmarks.fuzz_prototype                      # 100,000 cases, seed 0, under a 2 GiB address space
    python -m benchmarks.fuzz_prototype --cases 5000 --seed 3 --out /tmp/fuzz.md

The seeds are the prototype's own programs (tests/data/prototype/: its examples and its builder's
output). Each case applies one to four mutations, to the parsed program (a value replaced by
another of any type, deep nesting, long strings, huge or negative numbers, wide device lists; a
field or element deleted, duplicated, swapped or renamed) or to its text (cut, characters and
digit runs inserted, NaN), then imports it. An outcome is `ok` (a .pps script, which must then
parse: no syntax error), a diagnostic code, or an internal error (any other exception, an import
taking over --limit CPU seconds, a MemoryError; the language's check of the script is timed apart). The report counts each; the benchmark passes with no
internal errors. tests/test_prototype_fuzz.py runs a few hundred cases of the same mutations
through hypothesis in the default suite.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sys
import time
from pathlib import Path

from piper.diagnostics import PiperError

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "prototype"
SEEDS = [json.loads(p.read_text()) for p in sorted(DATA.glob("*/*.json"))]
FIELDS = ["op", "filter", "filters", "devices", "device", "stream", "reduce_stream", "gather_stream",
          "bucket_size", "shard_grads", "shard_params", "dim_name", "num_microbatches", "PP", "EP", "MB", "PASS",
          "schedule", "dim", "parts", "mesh", "directives"]
PALETTE = [None, True, False, 0, 1, 2, -1, 3.5, 1e308, 2 ** 62, 2 ** 62 + 1, "", "*", "F", "B", "BI", "BW", "X",
           "MB", "PP", "EP", "place", "order", "split", "replicate", "shard", "0", "\x1b[2J", "\u202e", [], {}, [[0]],
           [0, 0], [0, 1], [1, 3], {"PP": 0}, {"PP": "*"}, {"PP": 0, "EP": "*"}, {"PASS": "F"}, [[{"PP": 0}]]]


class Draws:
    """Choices from a seeded `random.Random` (the benchmark)."""

    def __init__(self, rnd: random.Random):
        self.rnd = rnd

    def int(self, lo: int, hi: int) -> int:
        return self.rnd.randint(lo, hi)

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]


def _paths(value, path=()):
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, path + (i,))
    return out


def _get(value, path):
    for k in path:
        value = value[k]
    return value


def _set(value, path, new):
    """A copy of `value` with the item at `path` replaced by `new` (a `_DELETE` removes it)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    inner = _set(value[head], rest, new) if rest else new
    if inner is _DELETE:
        del copy[head]
    else:
        copy[head] = inner
    return copy


_DELETE = object()


def _value(draw: Draws, program):
    kind = draw.int(0, 7)
    if kind == 0:
        return draw.pick(PALETTE)
    if kind == 1:
        return draw.int(-3, 10 ** draw.int(1, 7))
    if kind == 2:
        return [draw.int(0, 10 ** draw.int(0, 6)) for _ in range(draw.int(0, 60))]     # a device list, wide
    if kind == 3:
        nested = draw.pick([0, "x", {}, {"PP": 0}])
        for _ in range(draw.int(1, 40)):
            nested = [nested] if draw.int(0, 1) else {"PP": nested}
        return nested
    if kind == 4:
        return draw.pick(["x", "PP", "\u00e9", "\ud800", " "]) * draw.int(1, 5000)
    if kind == 5:
        return _get(program, draw.pick(_paths(program)))            # another part of the program
    if kind == 6:
        return {draw.pick(FIELDS): draw.pick(PALETTE) for _ in range(draw.int(0, 4))}
    return [draw.pick(PALETTE) for _ in range(draw.int(0, 5))]


def _mutate(draw: Draws, program):
    paths = _paths(program)
    path = draw.pick(paths)
    kind = draw.int(0, 6)
    if kind <= 2:
        return _set(program, path, _value(draw, program))
    if kind == 3 and path:
        return _set(program, path, _DELETE)
    if kind == 4 and path:                                   # duplicate, or swap with a sibling
        parent = _get(program, path[:-1])
        if isinstance(parent, list) and parent:
            i, j = path[-1], draw.int(0, len(parent) - 1)
            items = list(parent)
            if draw.int(0, 1):
                items.insert(j, items[i])
            else:
                items[i], items[j] = items[j], items[i]
            return _set(program, path[:-1], items)
    if kind == 5 and path and isinstance(path[-1], str):     # rename a field
        parent = dict(_get(program, path[:-1]))
        value = parent.pop(path[-1])
        parent[draw.pick(FIELDS) if draw.int(0, 1) else path[-1][:-1] + "x"] = value
        return _set(program, path[:-1], parent)
    if kind == 6:                                            # a wide program: many stages of several devices
        p, d = draw.int(1, 3000), draw.int(1, 4)
        wide = [{"op": "place", "filter": {"PP": s}, "devices": [s + k * p for k in range(d)]} for s in range(p)]
        if draw.int(0, 1):
            wide += [{"op": "replicate", "filter": {"PP": s}, "devices": [s + k * p for k in range(d)]}
                     for s in range(p)]
        return wide + (program if isinstance(program, list) else [program])
    return program


def _mutate_text(draw: Draws, text: str) -> str:
    i = draw.int(0, len(text))
    kind = draw.int(0, 4)
    if kind == 0:
        return text[:i]
    if kind == 1:
        return text[:i] + draw.pick(list('[]{}",:0-.eE\\ ') + ["NaN", "Infinity", "\xff", "\ufeff"]) + text[i:]
    if kind == 2:
        return text[:i] + text[i + draw.int(1, 30):]
    if kind == 3:
        return text[:i] + "9" * draw.int(15, 6000) + text[i:]
    return text[:i] + "[" * draw.int(20, 5000) + text[i:]


def case(draw: Draws) -> str:
    """One mutated program's text."""
    program = draw.pick(SEEDS)
    for _ in range(draw.int(1, 4)):
        program = _mutate(draw, program)
    text = json.dumps(program, ensure_ascii=draw.int(0, 1) == 1)
    if draw.int(0, 3) == 0:
        text = _mutate_text(draw, text)
    return text


def _syntax_codes() -> frozenset:
    from piper.dsl.syntax_errors import EXAMPLES

    return frozenset(EXAMPLES) | {"syntax-error"}


SYNTAX = None


def imported(text: str) -> tuple[str, str | None]:
    """(`ok` and the script, or the first diagnostic's code, or `internal: TYPE` for anything else raised)."""
    from piper.frontend.prototype import import_text

    try:
        script, _ = import_text(text, file="fuzz.json")
    except PiperError as err:
        return err.diagnostics[0].code, None
    except Exception as err:        # noqa: BLE001 - what the fuzz is for
        return f"internal: {type(err).__name__}: {str(err)[:80]}", None
    return "ok", script


def parses(script: str) -> str:
    """`ok`, or `internal: ...` where the imported script has a syntax error (the language's own check)."""
    global SYNTAX
    from piper.dsl import check_source

    SYNTAX = SYNTAX or _syntax_codes()
    bad = [d for d in check_source(script, "imported.pps") if d.code in SYNTAX]
    return f"internal: the script does not parse ({bad[0].code}: {bad[0].message[:60]})" if bad else "ok"


def outcome(text: str) -> str:
    """`ok` (imported, and the script parses), a diagnostic code, or `internal: ...`."""
    result, script = imported(text)
    return parses(script) if script is not None else result


class _TimeOut(Exception):
    pass


def _alarm(signum, frame):
    raise _TimeOut


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=float, default=5.0,
                    help="CPU seconds per import before it counts as a time-out (CPU: the machine may be shared)")
    ap.add_argument("--memory", type=int, default=2, help="address-space limit in GiB (0: none)")
    ap.add_argument("--minutes", type=float, help="stop after this long, whatever --cases says (the report "
                    "says how many cases ran)")
    ap.add_argument("--out", help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    import resource

    if args.memory:
        resource.setrlimit(resource.RLIMIT_AS, (args.memory << 30, args.memory << 30))
    signal.signal(signal.SIGPROF, _alarm)
    draw = Draws(random.Random(args.seed))
    counts: collections.Counter = collections.Counter()
    bad: collections.Counter = collections.Counter()       # internal errors by kind: time-out, memory, other
    internal: list[tuple[str, str]] = []
    slowest, started, ran = 0.0, time.perf_counter(), 0
    for n in range(args.cases):
        if args.minutes is not None and time.perf_counter() - started > args.minutes * 60:
            break
        if n and n % 1000 == 0:
            print(f"{n:,} cases, {counts['internal']} internal ({dict(bad)}), slowest import {slowest:.2f} s "
                  f"CPU, max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB, "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        text = case(draw)
        t0 = time.process_time()
        signal.setitimer(signal.ITIMER_PROF, args.limit)
        try:
            result, script = imported(text)
        except _TimeOut:
            result, script = f"internal: time-out past {args.limit:g} s CPU", None
        except MemoryError:
            result, script = "internal: MemoryError", None
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        slowest = max(slowest, time.process_time() - t0)
        if script is not None:
            signal.setitimer(signal.ITIMER_PROF, 60)         # the language's check of the script, timed apart
            try:
                result = parses(script)
            except _TimeOut:
                result = "internal: checking the imported script took over 60 s CPU"
            except MemoryError:
                result = "internal: MemoryError checking the imported script"
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        ran += 1
        counts[result if not result.startswith("internal") else "internal"] += 1
        if result.startswith("internal"):
            bad["time-out" if "time-out" in result or "took over" in result else
                "memory" if "MemoryError" in result else "other"] += 1
            if len(internal) < 20:
                internal.append((result, text[:300]))
    wall = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines = [f"# piper import fuzz: {ran:,} mutated prototype programs (seed {args.seed})", "",
             f"{wall:.0f} s in all, {1000 * wall / max(ran, 1):.1f} ms a case (the import and the "
             f"language's check of each script it writes); the slowest import {slowest:.2f} s CPU; max RSS "
             f"{rss:.0f} MB; address space {args.memory} GiB, time-out {args.limit:g} s CPU per import", "",
             f"internal errors: {counts['internal']} (time-outs {bad['time-out']}, memory errors {bad['memory']}, "
             f"other {bad['other']})", "",
             "| outcome | cases |", "|---|---|"]
    lines += [f"| {k} | {v:,} |" for k, v in counts.most_common()]
    lines += [""] + [f"- {r}: `{t}`" for r, t in internal]
    report = "\n".join(lines) + "\n"
    print(report, flush=True)
    if args.out:
        Path(args.out).write_text(report)
    return 1 if counts["internal"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
