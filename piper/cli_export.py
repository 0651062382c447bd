"""`piper export`: a strategy's compiled schedule as a torch pipelining CSV (`frontend.interop` writes it).

    piper export stdlib/zbv.pps --regions PP=8 --mesh pp=4 --set microbatches=8 -o zbv.csv

At the top with the other commands: it compiles (the compiler) what the front end then writes out.
"""
from __future__ import annotations

import sys

from .diagnostics import error
from .frontend.interop import _regions, _sets, export_torch_csv


def export_main(args) -> int:
    """`piper export SCRIPT [--model PATH.py:FACTORY | --regions PP=8] [--mesh pp=4] [--set NAME=VALUE ...]
    [--format torch-csv] [-o FILE]`.

    `args` fields: script, model, regions ("PP=8" or a dict), mesh ("pp=4" or
    None for the script's own), set (a list of NAME=VALUE, or a dict),
    format ("torch-csv"), output (a path, or None / "-" for stdout), and
    optionally axis and batch_size. Returns the exit status.
    """
    from .compiler.analysis import compile_script
    from .dsl import load_strategy

    fmt = getattr(args, "format", None) or "torch-csv"
    if fmt != "torch-csv":
        raise error("bad-flag", f"unknown export format {fmt!r}", hint="the only format is torch-csv")
    script = load_strategy(args.script, overrides=_sets(getattr(args, "set", None)))
    regions = _regions(getattr(args, "regions", None))
    model = getattr(args, "model", None)
    if not regions and not model:
        raise error("bad-flag", "piper export needs the regions: --model PATH.py:FACTORY or --regions PP=N",
                    hint="e.g. piper export stdlib/zbv.pps --regions PP=8 --mesh pp=4 --set microbatches=8")
    compiled = compile_script(script, mesh=getattr(args, "mesh", None), model_spec=model, regions=regions,
                              batch_size=getattr(args, "batch_size", None))
    text = export_torch_csv(compiled, axis=getattr(args, "axis", None))
    output = getattr(args, "output", None)
    if output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(output, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    return 0
