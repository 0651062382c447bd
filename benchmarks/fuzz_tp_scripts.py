"""Fuzzing `piper check` on tensor-parallel scripts: hostile patterns, meshes and kinds.

A case is a script built from parts (a mesh, a pipeline or data-parallel `use`, `shard columns /
rows / vocab of ...` lines with patterns drawn from real ones and hostile ones, `shard sequence`,
the stdlib's `llama_tensor_parallel`, an expert-parallel line), then mutated as
`benchmarks/fuzz_scripts.py` mutates the stdlib's scripts. Each runs through `piper check` in the
same worker, under the same 2 GiB address-space limit and 5 s of CPU a case; the outcomes are
counted the same way (`ok`, or `internal`, `memory`, `timeout`, `crashed`).

    .venv/bin/python -m benchmarks.fuzz_tp_scripts --cases 100000 --seed 0     # the benchmark run
    .venv/bin/python -m benchmarks.fuzz_tp_scripts --cases 200 --show-failures

tests/test_fuzz_scripts.py runs a few hundred of them (drawn by hypothesis) in the default suite.
"""
from __future__ import annotations

import random
import sys

from .fuzz_scripts import Worker, cli, drive, mutate

REAL = ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", "blocks.*.mlp.up",
        "blocks.*.attn.o", "blocks.*.mlp.down", "embed", "head", "**.q_proj", "**.o_proj", "**.embed_tokens",
        "**.lm_head", "model.layers.*.self_attn.q_proj", "lm_head"]
HOSTILE = ["", "*", "**", "***", "*" * 60 + "x", "**." * 40 + "q", "a" * 5000, "*a" * 200 + "b", ".", "..",
           "a..b", "**.**.**", "[abc]", "a\\b", "é.ü", "\u202e", "x\x00y", "?", "a.*.*.*.*.*.*.*.*.*.*.*z",
           "**" * 100, "blocks.*" * 50, " ", "*" * 3000]
KINDS = ["columns", "rows", "vocab", "sequence", "batch", "experts", "params", "grads", "optimizer",
         "heads", "columns, rows", "vocab, vocab"]
AXES = ["tp", "dp", "pp", "ep", "cp", "xx"]
SIZES = [0, 1, 2, 3, 4, 7, 8, 64, 8192, 65536, 2**20, 2**20 + 1, 2**62]


def _quoted(pattern: str) -> str:
    return '"' + pattern.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _mesh(rng: random.Random) -> str:
    """Mostly a real mesh (dp, pp, tp of a few devices), so most cases reach the planner; a hostile
    size or axis one time in ten."""
    if rng.random() < 0.1:
        axes = rng.sample(AXES, rng.randint(1, 3))
        return "mesh " + ", ".join(f"{a}={rng.choice(SIZES)}" for a in axes)
    axes = [a for a in ("dp", "pp") if rng.random() < 0.6] + ["tp"]
    return "mesh " + ", ".join(f"{a}={rng.choice((1, 2, 2, 4))}" for a in axes)


def _shard(rng: random.Random) -> str:
    """A TP line: mostly columns, rows or vocab over tp; sometimes another kind or axis."""
    kind = rng.choice(KINDS) if rng.random() < 0.15 else rng.choice(("columns", "rows", "vocab", "sequence"))
    axis = rng.choice(AXES) if rng.random() < 0.1 else "tp"
    if kind == "sequence" or rng.random() < 0.05:
        return f"shard {kind} over {axis}"
    pool = HOSTILE if rng.random() < 0.3 else REAL
    patterns = [rng.choice(pool) for _ in range(rng.choice((1, 1, 2, 5, 40)))]
    return f"shard {kind} of {', '.join(map(_quoted, dict.fromkeys(patterns)))} over {axis}"


def tp_script(rng: random.Random) -> str:
    """A tensor-parallel script of a mesh, a few strategies and shard lines, unmutated."""
    lines = [_mesh(rng)]
    if "pp=" in lines[0] and rng.random() < 0.8:       # a pipeline: the script names its regions
        lines.append(f"use one_f_one_b(microbatches={rng.choice((1, 2, 4, 64))}) on pp")
    if "dp=" in lines[0] and rng.random() < 0.8:
        lines.append(rng.choice(["use dp() on dp", "use zero3() on dp", "use zero1() on dp"]))
    for _ in range(rng.randint(0, 1)):
        lines.append(rng.choice([
            "use expert_parallel() on dp", "split MB into 2", "place PP=0 on pp[0]",
            f"use llama_tensor_parallel(sequence={rng.choice(('true', 'false'))}) on {rng.choice(AXES)}",
            f"place PP=1 on tp[{rng.choice((0, 1, 9))}]",
        ]))
    for _ in range(rng.randint(1, 5)):
        lines.append(_shard(rng))
    if rng.random() < 0.1:        # statements out of their usual order
        rng.shuffle(lines)
    return "\n".join(lines) + "\n"


def case(rng: random.Random) -> tuple[str, str]:
    """One fuzz case, (file name, text): a TP script, mutated half the time."""
    text = tp_script(rng)
    return "tp.pps", mutate(text, rng) if rng.random() < 0.5 else text


def fuzz(cases: int, seed: int, *, minutes: float | None = None, show: bool = False, report=print,
         failures_to: str | None = None) -> dict:
    """`benchmarks.fuzz_scripts.fuzz` over these cases."""
    return drive(case, seed, Worker(), cases, minutes=minutes, show=show, report=report, failures_to=failures_to)


def main(argv=None) -> int:
    return cli(argv, __doc__.split("\n")[0], fuzz)


if __name__ == "__main__":
    sys.exit(main())
