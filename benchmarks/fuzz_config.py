"""Fuzzing `piper run --config RUN.toml`: mutated configs through the config check (read, parsed,
every key turned into its flag, the flags checked together; nothing trains). Every case must end
in a diagnostic or a checked set of flags, in bounded time and memory.

The seeds are configs like the docs' (`piper/run_recipe.py`'s example, the recipe test's, one
with every kind of flag). A case is a seed with 1 to 4 edits: a value swapped for a hostile one
(inf, nan, 1e400, 2**63, a 5,000-digit number, a date, a table, a list of numbers), a key
swapped for another flag's name (`model`, `script`, `mesh`, `set`, `no_decay`...) or for junk,
a key of hundreds of dotted parts, brackets nested thousands deep, a line dropped, doubled or
cut, bytes that are not UTF-8; or the config path made a FIFO, a link to `/dev/zero` or a folder.
Each runs in a worker under the limits of `benchmarks.fuzz_scripts` (2 GiB of address space, an
alarm after 5 s of CPU). Outcomes: `ok` (a PiperError, or flags that check), `internal` (any
other exception), `memory`, `timeout`, `crashed`.

    .venv/bin/python -m benchmarks.fuzz_config --cases 100000 --seed 0
    .venv/bin/python -m benchmarks.fuzz_config --cases 200 --show-failures

tests/test_fuzz_config.py runs a few hundred cases of it (drawn by hypothesis).
"""
from __future__ import annotations

import json
import os
import random
import sys

from benchmarks import fuzz_checkpoints
from benchmarks.fuzz_scripts import CASE_SECONDS, run_limited, serve

SEEDS = [
    '[training]\nsteps = 200\nbatch_size = 16\nlr = 3e-4\nweight_decay = 0.1\nlr_schedule = "warmup-cosine"\n'
    'warmup = 20\n[data]\ndata = "train.bin"\nval_data = "val.bin"\nblock_size = 64\n[eval]\neval_every = 50\n'
    'eval_batches = 4\n[metrics]\ntensorboard = "runs/gpt"\n',
    '[training]\nsteps = 200\nlr = 3e-4\nlr_schedule = "warmup-cosine"\nwarmup = 20\nweight-decay = 0.1\n'
    '[data]\ndata = "train.bin"\nblock_size = 64\n[mesh]\ndp = 2\npp = 2\n',
    'model = "examples/gpt.py:small_gpt"\nscript = "job.pps"\nmesh = "dp=2"\nset = ["microbatches=4"]\n'
    'no_decay = ["**.bias", "**.ln_*.weight"]\nshuffle = true\nresume = false\ncheckpoint_dir = "ckpt"\n'
    'checkpoint_every = 10\nmax_restarts = 1\ntimeout = 60.0\nprecision = "bf16"\nclip_grad_norm = 1.0\n'
    'optimizer = "adamw"\nseed = 3\n[set]\nvirtual = 2\n',
]
KEYS = ["steps", "batch_size", "batch-size", "lr", "optimizer", "seed", "model", "script", "mesh", "set",
        "no_decay", "no-decay", "weight_decay", "lr_schedule", "warmup", "min_lr_ratio", "data", "val_data",
        "block_size", "shuffle", "eval_every", "eval_batches", "tensorboard", "checkpoint_dir",
        "checkpoint_every", "resume", "max_restarts", "timeout", "startup_timeout", "precision",
        "clip_grad_norm", "skip_nonfinite", "save", "trace", "metrics", "device", "address", "config",
        "func", "_given", "overrides", "stepz", "", '"quoted key"', "'x'", "a.b", "1", "é", "\u202e"]
VALUES = ["inf", "-inf", "nan", "+nan", "1e400", "-0.0", "0", "-1", "1", "3", str(2**63), str(2**63 - 1),
          "-" + str(2**63), "9" * 25, "9" * 5000, "0x" + "f" * 40, "0b1", "1_000", "3.5", "true", "false",
          '"x"', '""', '"' + "x" * 5000 + '"', "'lit'", '"""multi\nline"""', "[]", "[1, 2]", '["a", 1]',
          '["**.bias"]', "{}", "{dp = 2}", '{dp = "x"}', "{a = {b = 1}}", "1979-05-27", "07:32:00",
          "1979-05-27T07:32:00Z", '"warmup-cosine"', '"adamw"', '"dp=2,pp=2"', '"\\u0000"', '"\\u001b[2J"',
          "[[[[1]]]]", "{a = [1, {b = 2}]}"]


def case(rng: random.Random) -> dict:
    """One case: {"text": the config's bytes (as latin-1 text), "special": None or a kind of file}."""
    if rng.random() < 0.03:
        return {"text": "", "special": rng.choice(["fifo", "dev_zero", "folder", "missing"])}
    text = rng.choice(SEEDS)
    for _ in range(rng.randint(1, 4)):
        text = _edit(text, rng)
    return {"text": text.encode("utf-8", "surrogatepass").decode("latin-1"), "special": None}


def _edit(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    kind = rng.random()
    if kind < 0.35 and "=" in lines[i]:                    # a value
        key = lines[i].split("=", 1)[0]
        lines[i] = f"{key}= {rng.choice(VALUES)}"
    elif kind < 0.55:                                      # a key
        value = lines[i].split("=", 1)[1] if "=" in lines[i] else f" {rng.choice(VALUES)}"
        lines[i] = f"{rng.choice(KEYS)} ={value}"
    elif kind < 0.62:                                      # a dotted key or a header of many parts
        parts = ".".join(["a"] * rng.choice([2, 5, 31, 32, 33, 300, 3000])) + "." + rng.choice(KEYS)
        lines.insert(i, rng.choice([f"{parts} = 1", f"[{parts}]"]))
    elif kind < 0.68:                                      # brackets nested deep
        depth = rng.choice([31, 32, 33, 999, 3000])
        open_, close = rng.choice([("[", "]"), ("{a = ", "}")])
        lines.insert(i, f"{rng.choice(KEYS)} = {open_ * depth}1{close * depth}")
    elif kind < 0.8:                                       # a line dropped, doubled or cut
        what = rng.random()
        if what < 0.3:
            del lines[i]
        elif what < 0.6:
            lines.insert(i, lines[i])
        else:
            lines[i] = lines[i][:rng.randrange(len(lines[i]) + 1)]
    elif kind < 0.9:                                       # bytes that are not UTF-8 (surrogates stand for them)
        at = rng.randrange(len(lines[i]) + 1)
        lines[i] = lines[i][:at] + rng.choice(["\udcff", "\udcc3", "\x00", "\udce9\udcff"]) + lines[i][at:]
    else:                                                  # a section header
        lines.insert(i, rng.choice(["[training]", "[mesh]", "[set]", "[[a]]", "[a.b]", "[", "[]", "[mesh.x]"]))
    return "\n".join(lines)


def run_case(folder: str, item: dict, seconds: float = CASE_SECONDS) -> dict:
    """The config check of `item`'s config: read, applied to `piper run`'s flags, checked."""
    from piper import run_recipe
    from piper.cli import build_parser
    from piper.job import checkpoint

    path = os.path.join(folder, "run.toml")
    fuzz_checkpoints._remove(path)
    if item["special"]:
        fuzz_checkpoints._special(path, "dangling" if item["special"] == "missing" else item["special"], folder)
    else:
        with open(path, "wb") as f:
            f.write(item["text"].encode("latin-1"))

    def act():
        args = build_parser().parse_args(["run", "job.pps", "--config", path])
        run_recipe.apply_config(args)
        problem = run_recipe.check(args) or checkpoint.check_run_flags(args)
        return "ok", "checked" if problem is None else "problem"

    result = run_limited(act, seconds, where=True)
    return {**result, "codes": [result["detail"]] if result["outcome"] == "ok" else []}


def worker(seconds: float = CASE_SECONDS) -> None:
    """Read cases (JSON lines: name, text = the case as JSON) from stdin; outcomes to stdout."""
    def prepare(folder):
        from piper.job import checkpoint  # noqa: F401 - loaded once, outside the cases' time

    serve(lambda folder, item, secs: run_case(folder, json.loads(item["text"]), secs), seconds,
          prefix="piper-fuzz-config-", prepare=prepare)


class Worker(fuzz_checkpoints.Worker):
    MODULE = "benchmarks.fuzz_config"


if __name__ == "__main__":
    sys.exit(fuzz_checkpoints.main(run_worker=worker, make_case=case, worker_class=Worker))
