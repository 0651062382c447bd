"""Compile a strategy script without running it: for `piper check --model/--regions`,
`piper show`, `piper simulate` and `piper export`. Errors come back as
diagnostics against the script's spans."""
from __future__ import annotations

from ..frontend.capture import Program, capture
from .plans import Compiled
from ..diagnostics import Diagnostic, PiperError, error
from .planning import compile_directives


def program_for(mesh, directives, *, model_spec: str | None = None, regions=None,
                batch_size: int | None = None, precision: str = "fp32") -> Program:
    """The regions to plan for: an abstract chain (`PP=8`) or a model captured on meta
    (in the compute dtype of `precision`, with float32 masters, as `piper.compile` captures it)."""
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
    from ..frontend.directives import Shard
    from ..frontend.microbatches import microbatch_inputs, split_counts
    from ..frontend.models import example_batch, load_model

    from ..frontend.options import TrainingOptions, compute_dtype

    model, module = load_model(model_spec)
    micro, shards = split_counts(mesh, directives)
    if batch_size is not None and batch_size % (micro * shards):
        # Said before the batch is made: a mesh's shards may ask for more rows than memory holds.
        raise error("indivisible-batch", f"the global batch of {batch_size} does not divide into {micro} "
                    f"microbatch(es) x {_count(shards)} data-parallel shard(s)",
                    hint="use a batch size that is a multiple of their product")
    if batch_size is None:
        # Capture sees one microbatch of one data-parallel shard: a batch of one row per microbatch
        # gives it the rows a global batch of one row per microbatch and shard would, without
        # making rows in proportion to the mesh (dp=65,536 would make 65,536; a batch sharded
        # over dp three times, dp^3, before the plan says `sharded-twice`).
        directives = [d for d in directives if not (isinstance(d, Shard) and "batch" in d.what)]
    inputs = example_batch(module, batch_size or micro)
    training = TrainingOptions(compute_dtype(precision))
    mb_inputs = microbatch_inputs(inputs, mesh, directives)[0]
    from ..frontend.tensor_parallel import plan_of

    # Divided over tp as `piper.compile` divides it: the plan's modules checked against the model.
    program = capture(training.capture_model(model), tuple(map(training.cast, mb_inputs)),
                      tensor=plan_of(directives, mesh))
    training.master_specs(program, model, mb_inputs)
    return program


def _count(number: int) -> str:
    """A count as a message shows it: digits, or their number where there are too many to read."""
    text = str(number)
    return text if len(text) <= 24 else f"a {len(text)}-digit number of"


def compile_script(script, *, mesh=None, model_spec: str | None = None, regions=None,
                   batch_size: int | None = None) -> Compiled:
    """Build, lower, schedule and verify `script` (a loaded script or strategy)."""
    return compile_with_program(script, mesh=mesh, model_spec=model_spec, regions=regions,
                                batch_size=batch_size)[0]


def compile_with_program(script, *, mesh=None, model_spec: str | None = None, regions=None,
                         batch_size: int | None = None, precision: str = "fp32") -> tuple[Compiled, Program]:
    """`compile_script`, and the program it planned for (for memory prediction)."""
    from .use_sites import errors_traced

    mesh, directives = script.build(mesh)
    with errors_traced(directives):       # the model's capture checks a `use`d strategy's TP lines
        program = program_for(mesh, directives, model_spec=model_spec, regions=regions, batch_size=batch_size,
                              precision=precision)
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
