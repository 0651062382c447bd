"""A loaded .pps script: checked when loaded, built against a mesh into directives.

    script = load_strategy("examples/gpt_zero3_1f1b.pps")
    mesh, directives = script.bind(microbatches=16).build(None)   # None: the script's own mesh
"""
from __future__ import annotations

import os
from pathlib import Path

from piper.diagnostics import Diagnostic, PiperError, clip
from piper.frontend.directives import Directive
from piper.mesh import Mesh

from . import nodes as n
from .check import (analyze_module, check_kept, check_overrides, declared_mesh, resolve_mesh, settable_names,
                    sole_strategy)
from .interpreter import Interpreter
from .program import Found, Program
from .source import SourceError, read_source
from .syntax import parse
from .values import Limits


def _errors(diagnostics) -> list[Diagnostic]:
    return [d for d in diagnostics if d.severity == "error"]


class Script:
    """A parsed and checked script, with `--set` values bound.

    `mesh` is the mesh the script declares (or None). A file that defines one
    strategy and runs nothing else stands for that strategy: `bind` sets its
    parameters and `build` runs it, so `piper.strategy`'s `s.use("zero3.pps")`
    works on it too.
    """

    def __init__(self, module: n.Module, program: Program, *, mesh: Mesh | None, overrides: dict,
                 limits: Limits = Limits(), built: dict | None = None):
        self.module = module
        self.program = program
        self.mesh = mesh
        self.overrides = dict(overrides)
        self.limits = limits
        self._built = dict(built or {})   # run mesh -> directives a run with these overrides made

    @property
    def file(self) -> str:
        return self.module.file

    @property
    def params(self) -> list[str]:
        """The names `bind` (and `--set`) accept."""
        return settable_names(self.module, self.program)

    def bind(self, **params) -> "Script":
        """A copy with these `--set` values: `script.bind(microbatches=16, axis="dp")`."""
        merged = {**self.overrides, **params}
        errors = check_overrides(self.module, self.program, params)
        if errors:
            raise PiperError(*errors)
        return Script(self.module, self.program, mesh=self.mesh, overrides=merged, limits=self.limits)

    __call__ = bind

    def build(self, mesh=None) -> tuple[Mesh, tuple[Directive, ...]]:
        """Run the script on `mesh` (None: its own mesh, else one device): (mesh, directives).

        Raises PiperError with every error the run meets (mesh-mismatch when
        `mesh` and the script's `mesh` line differ).
        """
        run_mesh, problems = resolve_mesh(self.module, self.mesh, mesh)
        if _errors(problems):
            raise PiperError(*_errors(problems))
        run_mesh = run_mesh if run_mesh is not None else Mesh(())
        if run_mesh in self._built:
            return run_mesh, self._built[run_mesh]
        runner = Interpreter(self.program, mesh=run_mesh, overrides=self.overrides, limits=self.limits)
        sole = sole_strategy(self.module)
        if sole is not None:
            runner.run_strategy(Found(sole, self.module), sole.name.span)
        elif not self.module.statements and len(self.module.strategies) > 1:
            names = ", ".join(f"`{s.name.name}`" for s in self.module.strategies)
            raise PiperError(Diagnostic(
                "ambiguous-strategy", f"this file defines {names} and uses none of them",
                span=self.module.strategies[1].name.span,
                hint=f"add a line such as `use {self.module.strategies[0].name.name}()` to say which one runs"))
        else:
            runner.run_module(self.module)
        if _errors(runner.diagnostics):
            raise PiperError(*_errors(runner.diagnostics))
        return run_mesh, tuple(runner.directives)

    def __repr__(self) -> str:
        bound = ", ".join(f"{k}={v!r}" for k, v in self.overrides.items())
        return f"<piper script {self.file}{' with ' + bound if bound else ''}>"


def _is_path(source) -> bool:
    if isinstance(source, os.PathLike):
        return True
    return isinstance(source, str) and "\n" not in source and source.strip().endswith(".pps")


def read_script(path) -> tuple[str, str]:
    """(text, file) of a .pps file; PiperError file-not-found when it cannot be read."""
    path = Path(path)
    try:
        return read_source(path), str(path)
    except SourceError as err:
        hint = "check the path; it is relative to the current folder" if err.reason == "no such file" else err.hint
        raise PiperError(Diagnostic(err.code, f"cannot read the script {clip(str(path), 200)!r}: {err.reason}",
                                    hint=hint)) from None


def load_strategy(path_or_text, *, overrides: dict | None = None, file: str | None = None,
                  limits: Limits = Limits()) -> Script:
    """Load a script from a path (str or PathLike ending in .pps) or from source text.

    Raises PiperError carrying every error found without a mesh (syntax,
    imports, names, types, arity, unknown `--set` names); warnings are left to
    `piper check`.

    >>> load_strategy("mesh dp=2\\nshard batch over dp\\n").build()[1][0].over
    'dp'
    """
    if _is_path(path_or_text):
        text, file = read_script(path_or_text)
    else:
        text, file = str(path_or_text), file or "<script>"
    module = parse(text, file)
    program = Program(module)
    mesh, problems = declared_mesh(module)
    problems += analyze_module(module, program, mesh=mesh, overrides=overrides, concrete=False, limits=limits)
    if _errors(problems):
        raise PiperError(*_errors(problems))
    return Script(module, program, mesh=mesh, overrides=dict(overrides or {}), limits=limits)


def check_and_build(text: str, file: str = "<script>", *, mesh=None, overrides: dict | None = None,
                    limits: Limits = Limits()) -> tuple[list[Diagnostic], Script | None]:
    """`check_source`, and the script as `load_strategy` would give it, its
    `build` already holding the directives the check's own run of the
    statements made (None when there was no such run: no mesh, no statements,
    a syntax error). `piper check --regions` plans from it instead of running
    the script twice more (at 64 stages x 512 microbatches a run is 0.1-0.2 s)."""
    found, kept = check_kept(text, file, mesh=mesh, overrides=overrides, limits=limits)
    if "built" not in kept:
        return found, None
    module, program, declared = kept["script"]
    return found, Script(module, program, mesh=declared, overrides=dict(overrides or {}), limits=limits,
                         built=dict([kept["built"]]))
