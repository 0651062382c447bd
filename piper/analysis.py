"""Compile a strategy script without running it: for `piper check --model/--regions`,
`piper show`, `piper simulate` and `piper export`. Errors come back as
diagnostics against the script's spans."""
from __future__ import annotations

from .capture import Program, capture
from .compiler import Compiled
from .diagnostics import Diagnostic, PiperError, error
from .planning import compile_directives


def program_for(mesh, directives, *, model_spec: str | None = None, regions=None,
                batch_size: int | None = None) -> Program:
    """The regions to plan for: an abstract chain (`PP=8`) or a model captured on meta."""
    if regions:
        if len(regions) > 1:
            shown = ",".join(f"{k}={v}" for k, v in regions.items())
            raise error("bad-flag", f"--regions {shown} names {len(regions)} kinds of region; an abstract model "
                        "is one chain of a single kind", hint=f"pass one, e.g. --regions "
                        f"{next(iter(regions))}={next(iter(regions.values()))}, or --model PATH.py:FACTORY "
                        "for a model whose regions nest")
        return Program.chain(regions)
    if not model_spec:
        raise error("no-regions", "planning needs the model's regions",
                    hint="pass --model PATH.py:FACTORY or --regions PP=N")
    from .job import _microbatch_inputs, split_counts
    from .models import example_batch, load_model

    model, module = load_model(model_spec)
    micro, shards = split_counts(mesh, directives)
    inputs = example_batch(module, batch_size or micro * shards)
    return capture(model, _microbatch_inputs(inputs, mesh, directives)[0])


def compile_script(script, *, mesh=None, model_spec: str | None = None, regions=None,
                   batch_size: int | None = None) -> Compiled:
    """Build, lower, schedule and verify `script` (a loaded script or strategy)."""
    return compile_with_program(script, mesh=mesh, model_spec=model_spec, regions=regions,
                                batch_size=batch_size)[0]


def compile_with_program(script, *, mesh=None, model_spec: str | None = None, regions=None,
                         batch_size: int | None = None) -> tuple[Compiled, Program]:
    """`compile_script`, and the program it planned for (for memory prediction)."""
    mesh, directives = script.build(mesh)
    program = program_for(mesh, directives, model_spec=model_spec, regions=regions, batch_size=batch_size)
    compiled = compile_directives(program, mesh, directives)
    compiled.program = program       # for `piper show --what ir`: where each op went
    return compiled, program


def analyze(script, *, mesh, model_spec: str | None = None, regions: dict | None = None,
            batch_size: int | None = None) -> list[Diagnostic]:
    """Every problem the compiler finds for `script` on `mesh`; [] when it would run."""
    try:
        compiled = compile_script(script, mesh=mesh, model_spec=model_spec, regions=regions, batch_size=batch_size)
        return list(compiled.warnings)
    except PiperError as err:
        return list(err.diagnostics)
