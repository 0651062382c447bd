"""Model-aware checks for `piper check --model/--regions`: the whole lowering
and verification of the compiler, reported against the script's spans."""
from __future__ import annotations

from .capture import Program, capture
from .compiler import compile_ir
from .diagnostics import Diagnostic, PiperError
from .simulate import verify
from .statements import apply_all, initial_ir


def analyze(script, *, mesh, model_spec: str | None = None, regions: dict | None = None,
            batch_size: int | None = None) -> list[Diagnostic]:
    """Every problem the compiler finds for `script` on `mesh`; [] when it would run."""
    try:
        mesh, directives = script.build(mesh)
        if regions:
            program = Program.chain(regions)
        else:
            from .job import _microbatch_inputs
            from .models import example_batch, load_model

            model, module = load_model(model_spec)
            shards = 1
            from .directives import Shard, Split
            micro = next((d.count for d in directives if isinstance(d, Split) and d.what == "MB"), 1)
            for d in directives:
                if isinstance(d, Shard) and "batch" in d.what:
                    shards *= mesh.size(d.over)
            inputs = example_batch(module, batch_size or micro * shards)
            program = capture(model, _microbatch_inputs(inputs, mesh, directives)[0])
        compiled = compile_ir(apply_all(initial_ir(program, mesh), directives))
        verify(compiled)
        return list(compiled.warnings)
    except PiperError as err:
        return list(err.diagnostics)
