"""Directives -> IR -> lowered, scheduled, verified plans, without torch or Ray.

`piper.compile` and `piper check --regions` both come through here, so the
linter plans exactly what a job would run.
"""
from __future__ import annotations

import contextlib
import gc

from .compiler import Compiled, compile_ir
from .simulate import verify
from .statements import apply_all, initial_ir


@contextlib.contextmanager
def _no_cycle_collection():
    """The IR is hundreds of thousands of small acyclic objects: the cyclic
    collector would re-scan them again and again while they are built.

    What survives (the compiled IR and plans) lives as long as the job, so it
    joins the oldest generation directly: otherwise the first young collection
    after this scans every object compiled (0.2 s at 200k nodes), only to
    promote them all. Skipped if anything is frozen already (gc.freeze is the
    caller's, then), as unfreezing would release it.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            if not gc.get_freeze_count():
                gc.freeze()       # every tracked object, young ones included...
                gc.unfreeze()     # ...back, into the oldest generation
            gc.enable()


def compile_directives(program, mesh, directives) -> Compiled:
    """Apply the directives to the program's DAG, lower, schedule and verify."""
    with _no_cycle_collection():
        compiled = compile_ir(apply_all(initial_ir(program, mesh), directives))
        verify(compiled)       # raises on deadlock before anything runs
    return compiled
