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

import os
import random
import re
import sys

from .fuzz_scripts import CASE_SECONDS, Worker, check_case, cli, drive, mutate, serve
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
    return check_case(folder, name, text, seconds, ("--model", MODEL))


def worker(seconds: float = CASE_SECONDS) -> None:
    """`benchmarks.fuzz_scripts.worker` for model cases: torch and the model's file are imported
    (one clean check) before the limit and the cases, so a case's CPU is its own check's."""
    os.environ["PIPER_DEBUG"] = "1"
    serve(lambda folder, item, secs: run_case(folder, item["name"], item["text"], secs), seconds,
          prefix="piper-fuzz-model-", prepare_unlimited=True,
          prepare=lambda folder: run_case(folder, "warm.pps", "mesh tp=2\n" + PLAN, seconds=120.0))


class ModelWorker(Worker):
    """`benchmarks.fuzz_scripts.Worker` running this module's worker."""

    MODULE = "benchmarks.fuzz_model_check"
    CASES_PER_WORKER = 200


def fuzz(cases: int, seed: int, *, minutes: float | None = None, show: bool = False, report=print,
         failures_to: str | None = None) -> dict:
    """Run `cases` cases (or until `minutes` pass): counts per outcome, the slowest, the failures."""
    return drive(case, seed, ModelWorker(hang_seconds=120.0), cases, minutes=minutes, show=show, report=report,
                 failures_to=failures_to, every=100)


def main(argv=None) -> int:
    return cli(argv, __doc__.split("\n")[0], fuzz, worker)


if __name__ == "__main__":
    sys.exit(main())
