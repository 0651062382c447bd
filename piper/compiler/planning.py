"""Directives -> IR -> lowered, scheduled, verified plans, without torch or Ray.

`piper.compile` and `piper check --regions` both come through here, so the
linter plans exactly what a job would run.
"""
from __future__ import annotations

from .plans import Compiled, compile_ir
from ..gc_guard import no_cycle_collection as _no_cycle_collection
from .simulate import check
from ..ir.size import check_lowering
from ..ir.statements import apply_all, initial_ir
from ..frontend.strategy import as_strategy
from ..mesh import Mesh


def compile_directives(program, mesh, directives) -> Compiled:
    """Apply the directives to the program's DAG, lower, schedule and verify."""
    from .stage_count import explain_unplaced   # a schedule placing fewer stages than the model has
    from .use_sites import at_use_sites, errors_traced

    with _no_cycle_collection(), errors_traced(directives), explain_unplaced(program, directives):
        ir = apply_all(initial_ir(program, mesh), directives)
        check_lowering(ir)
        compiled = compile_ir(ir)
        if ir.sharded("experts") is not None:      # expert parallelism: check it
            from ..ir import experts

            experts.check(program, compiled.ir)
        if ir.sharded("experts") is not None or ir.tensor_axis() is not None:
            from .cut_passes import add_exchanges      # passes cut at their all-to-alls and TP collectives
            from .tensor_exchanges import add_tp_collectives

            compiled = add_tp_collectives(add_exchanges(compiled, program), program)
        check(compiled)       # raises on deadlock before anything runs
    compiled.warnings = at_use_sites(compiled.warnings, directives)   # at the user's `use` lines
    return compiled


def plan(strategy, *, mesh=None, program, overrides: dict | None = None) -> Compiled:
    """Build and compile a strategy against a captured (or abstract) program."""
    with _no_cycle_collection():
        mesh, directives = build_strategy(strategy, mesh, overrides)
        return compile_directives(program, mesh, directives)


def build_strategy(strategy, mesh, overrides=None):
    strat = as_strategy(strategy)
    if overrides:
        strat = strat.bind(**overrides)
    mesh = Mesh.of(mesh) if mesh is not None else None
    if mesh is None:
        mesh = getattr(strat, "mesh", None) or Mesh(())
    return strat.build(mesh)
