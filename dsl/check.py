"""Every error and warning in a script, without running anything: what `piper check` reports.

The passes, in order: parse (every syntax error), read imports, the declared
mesh, the `--set` names, lint (unused-let, shadowed-name), the abstract run of
each strategy and of the top level (names, types, arity), and, when a mesh is
known, the concrete run of the top level (ranges, limits, the used strategies).
"""
from __future__ import annotations

from piper.diagnostics import Diagnostic, Label, PiperError, clip, did_you_mean
from piper.mesh import MAX_WORLD_SIZE, Mesh

from . import nodes as n
from .interpreter import Interpreter
from .lint import lint
from .program import Found, Program
from .source import bidi_warnings, cap_repeated, too_large
from .syntax import parse_recovering
from .values import Limits



def declared_mesh(module: n.Module) -> tuple[Mesh | None, list[Diagnostic]]:
    """The mesh of the script's `mesh` line, or None; with the problems of that line."""
    diagnostics: list[Diagnostic] = []
    if not module.meshes:
        return None, diagnostics
    first, *again = module.meshes
    for extra in again:
        diagnostics.append(Diagnostic("duplicate-name", "the mesh is declared twice", span=extra.span,
                                      labels=(Label(first.span, "first declared here"),),
                                      hint="keep one `mesh` line"))
    axes: dict[str, int] = {}
    spans = {}
    for axis in first.axes:
        name, size = axis.name.name, axis.size.value
        if name in axes:
            diagnostics.append(Diagnostic("duplicate-name", f"mesh axis `{name}` is declared twice", span=axis.span,
                                          labels=(Label(spans[name], "first declared here"),)))
            continue
        if size < 1 or size > MAX_WORLD_SIZE:
            shown = size if size < 1 else f"over {MAX_WORLD_SIZE:,}"
            diagnostics.append(Diagnostic("value-out-of-range", f"mesh axis `{name}` has size {shown}",
                                          span=axis.size.span, hint=f"every mesh axis has from 1 to "
                                          f"{MAX_WORLD_SIZE:,} devices"))
            size = 1
        axes[name] = size
        spans[name] = axis.span
    world = 1
    for size in axes.values():
        world *= size
    if world > MAX_WORLD_SIZE:
        diagnostics.append(Diagnostic("value-out-of-range", f"this mesh has {world:,} devices",
                                      span=first.span, hint=f"a mesh holds at most {MAX_WORLD_SIZE:,} devices"))
        return None, diagnostics
    return Mesh(tuple(axes.items())), diagnostics


def resolve_mesh(module: n.Module, declared: Mesh | None, given) -> tuple[Mesh | None, list[Diagnostic]]:
    """The mesh to run with: `given` (a Mesh, "dp=2,pp=2", a dict) or else the declared one."""
    if given is None:
        return declared, []
    try:
        mesh = Mesh.of(given)
    except PiperError as err:
        return declared, list(err.diagnostics)
    if declared is not None and dict(declared.axes) != dict(mesh.axes):
        span = module.meshes[0].span if module.meshes else None
        return mesh, [Diagnostic("mesh-mismatch", f"the script declares the mesh `{declared}`, but it is run on "
                                 f"`{mesh}`", span=span,
                                 hint="make the `mesh` line match the job's mesh, or drop one of them")]
    return mesh, []


def sole_strategy(module: n.Module) -> n.Strategy | None:
    """The strategy a file stands for when it defines exactly one and runs nothing else."""
    if not module.statements and len(module.strategies) == 1:
        return module.strategies[0]
    return None


def _uses(stmts):
    for stmt in stmts:
        if isinstance(stmt, n.Use):
            yield stmt
        elif isinstance(stmt, n.For):
            yield from _uses(stmt.body)
        elif isinstance(stmt, n.If):
            yield from _uses(stmt.then)
            yield from _uses(stmt.orelse)


def settable_names(module: n.Module, program: Program) -> list[str]:
    """What `--set NAME=VALUE` may name: top-level lets and the parameters of top-level `use`d strategies."""
    names: list[str] = []
    strategies = []
    sole = sole_strategy(module)
    if sole is not None:
        strategies.append(sole)
    for stmt in module.statements:
        if isinstance(stmt, n.Let):
            names.append(stmt.name.name)
    for use in _uses(module.statements):
        found = program.lookup(use.name.name, module)
        if isinstance(found, Found):
            strategies.append(found.strategy)
    for strategy in strategies:
        for param in strategy.params:
            names += [param.name.name, f"{strategy.name.name}.{param.name.name}"]
    return list(dict.fromkeys(names))


def check_overrides(module: n.Module, program: Program, overrides: dict | None) -> list[Diagnostic]:
    """unknown-parameter for every `--set` name that the script does not have."""
    if not overrides:
        return []
    known = settable_names(module, program)
    out = []
    for name in overrides:
        if name not in known:
            plain = [k for k in known if "." not in k]
            out.append(Diagnostic(
                "unknown-parameter", f"`--set {clip(name)}`: the script has no top-level `let` and no parameter "
                f"of a used strategy called `{clip(name)}`",
                hint=did_you_mean(name, known) or (f"it can set {', '.join(plain)}" if plain else
                                                   "this script has nothing to set")))
    return out


def analyze_module(module: n.Module, program: Program, *, mesh: Mesh | None, overrides: dict | None,
                   concrete: bool, limits: Limits = Limits(), built: list | None = None) -> list[Diagnostic]:
    """Diagnostics of every pass after parsing (see the module docstring), deduplicated.

    `built`, if given, receives `(mesh, directives)` of the concrete run: what
    `Script.build` would make, so planning need not run the script again."""
    out: list[Diagnostic] = list(program.diagnostics)
    out += check_overrides(module, program, overrides)
    out += lint(module, mesh_axes=mesh.names if mesh else ())
    checker = Interpreter(program, mesh=mesh, abstract=True, overrides=overrides, limits=limits)
    for strategy in module.strategies:
        checker.check_strategy(Found(strategy, module))
    checker.run_module(module)
    out += checker.diagnostics
    if concrete and mesh is not None and module.statements:
        runner = Interpreter(program, mesh=mesh, abstract=False, overrides=overrides, limits=limits)
        runner.run_module(module)
        out += runner.diagnostics
        if built is not None:
            built.append((mesh, tuple(runner.directives)))
    return dedupe(out)


def dedupe(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """Keep the first diagnostic of each code at each place."""
    seen, out = set(), []
    for diagnostic in diagnostics:
        key = (diagnostic.code, diagnostic.span)
        if key not in seen:
            seen.add(key)
            out.append(diagnostic)
    return out


def ordered(diagnostics: list[Diagnostic], file: str) -> list[Diagnostic]:
    """Sorted for reading: no-place first, then this file by position, then other files."""
    def key(d: Diagnostic):
        if d.span is None:
            return (0, "", 0, 0)
        return (1 if d.span.file == file else 2, d.span.file, d.span.line, d.span.column)
    return sorted(diagnostics, key=key)


def check_source(text: str, file: str = "<script>", *, mesh=None, overrides: dict | None = None,
                 limits: Limits = Limits()) -> list[Diagnostic]:
    """Every error and warning in a script; never raises for a user mistake.

    `mesh` (a Mesh, "dp=2,pp=4" or a dict) overrides the script's `mesh` line;
    `overrides` are `--set` values. Imports are read relative to `file`.

    >>> [d.code for d in check_source("let x = 1\\n")]
    ['unused-let']
    """
    return check_kept(text, file, mesh=mesh, overrides=overrides, limits=limits)[0]


def check_kept(text: str, file: str = "<script>", *, mesh=None, overrides: dict | None = None,
               limits: Limits = Limits()) -> tuple[list[Diagnostic], dict]:
    """`check_source`, and what its own run of the statements kept: `kept["script"]` (module, program,
    declared mesh) and `kept["built"]` (the directives it made), both absent when there was no such run
    (no mesh, no statements, a syntax error). `script.check_and_build` turns them into a loaded script."""
    kept: dict = {}
    try:
        found = _check(text, file, mesh=mesh, overrides=overrides, limits=limits, kept=kept)
    except RecursionError:  # every walk is bounded; this is the last line of defence
        return [Diagnostic("nesting-limit", "this script nests too deeply to check",
                           hint="flatten the blocks, or split long expressions with `let`")], {}
    return found, kept


def _check(text: str, file: str, *, mesh, overrides, limits: Limits, kept: dict | None = None) -> list[Diagnostic]:
    large = too_large(text, file)
    if large is not None:
        return [large]
    bidi = bidi_warnings(text, file)
    module, syntax = parse_recovering(text, file)
    if module is None:
        return bidi + syntax
    program = Program(module)
    declared, out = declared_mesh(module)
    run_mesh, problems = resolve_mesh(module, declared, mesh)
    out += problems
    built: list = []
    out += analyze_module(module, program, mesh=run_mesh, overrides=overrides, concrete=True, limits=limits,
                          built=built)
    if kept is not None and built:
        kept["script"], kept["built"] = (module, program, declared), built[0]
    return cap_repeated(ordered(dedupe(bidi + out), file))
