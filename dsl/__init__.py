"""The .pps strategy language (installed as `piper.dsl`).

    from piper.dsl import load_strategy, parse, check_source
    script = load_strategy("examples/gpt_zero3_1f1b.pps", overrides={"microbatches": 16})
    mesh, directives = script.build(None)        # the script's own `mesh` line
    for d in check_source(open("x.pps").read(), file="x.pps"): print(d)

Text -> `parse` (syntax tree with spans) -> `Interpreter` -> the records of
`piper.frontend.directives`, the same ones the `@piper.strategy` Python API makes.
"""
from .check import check_source
from .script import Script, load_strategy
from .syntax import parse
from .values import Limits

__all__ = ["load_strategy", "parse", "check_source", "Script", "Limits"]
