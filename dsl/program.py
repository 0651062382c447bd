"""Which strategy a name means: the script's own, an imported file's, or the standard library's.

A `Program` is the main module plus every file it imports (read when the
program is made, relative to the importing script) and the standard-library
files it `use`s (read on first use, from the package `piper.stdlib`). Reading
.pps files is the only file access a script has.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from piper.diagnostics import Diagnostic, Label, Span, clip, did_you_mean

from . import nodes as n
from .source import SourceError, read_source, resolve_import
from .syntax import parse_recovering

MAX_IMPORT_DEPTH = 64
STDLIB_PACKAGE = "piper.stdlib"


def stdlib_root():
    """The folder (a Traversable) that holds the standard library's .pps files."""
    return resources.files(STDLIB_PACKAGE)


def stdlib_names() -> list[str]:
    """Names of the standard-library strategies (file stems), for suggestions."""
    try:
        return sorted(p.name[:-4] for p in stdlib_root().iterdir() if p.name.endswith(".pps"))
    except (OSError, ModuleNotFoundError, TypeError):
        return []


@functools.lru_cache(maxsize=256)
def parse_cached(text: str, file: str) -> tuple[n.Module | None, tuple[Diagnostic, ...]]:
    """`parse_recovering`, remembered: stdlib files are parsed once per process."""
    module, diagnostics = parse_recovering(text, file)
    return module, tuple(diagnostics)


@dataclass(frozen=True)
class Found:
    """A strategy definition and the module it lives in."""

    strategy: n.Strategy
    module: n.Module


def _imported_here(trace: tuple[Span, ...]) -> tuple[Label, ...]:
    """Labels for the `import` lines that led to a file (nearest first)."""
    return tuple(Label(span, "imported here") for span in reversed(trace))


def _with_labels(diagnostic: Diagnostic, labels: tuple[Label, ...]) -> Diagnostic:
    return Diagnostic(diagnostic.code, diagnostic.message, diagnostic.severity, diagnostic.span,
                      diagnostic.labels + labels, diagnostic.notes, diagnostic.hint, diagnostic.trace)


def _stdlib_text(name: str):
    """The standard library's `name.pps` (a Traversable) and its text, or None for the text."""
    try:
        entry = stdlib_root() / f"{name}.pps"
        return entry, (entry.read_text(encoding="utf-8") if entry.is_file() else None)
    except (OSError, UnicodeDecodeError, ModuleNotFoundError, TypeError):
        return None, None


def _defined_twice(name: str, first: Found, span: Span, trace) -> Diagnostic:
    return Diagnostic(
        "duplicate-name", f"strategy `{name}` is defined twice", span=span,
        labels=(Label(first.strategy.name.span, "first defined here"),) + _imported_here(trace),
        hint="rename one of them; a script sees its own strategies and those of the files it imports")


def _read_import(module: n.Module, item: n.Import, *, chain: tuple[str, ...], stack, trace
                 ) -> tuple[Path, str] | Diagnostic:
    """The file an `import` names and its text, or why it cannot be read: a path that is not a
    relative .pps name, a cycle back through `chain` (the importing files' keys), nesting too
    deep, or a missing/unreadable file."""
    path_text = item.path
    if any(ord(c) < 32 or c == "\x7f" for c in path_text):
        return Diagnostic(
            "bad-import", f"cannot import {clip(path_text, 200)!r}: the path holds a control character",
            span=item.span, labels=_imported_here(trace),
            hint="write the file's name plainly, e.g. `import \"common.pps\"`")
    if not path_text.endswith(".pps") or Path(path_text).is_absolute() or path_text.startswith("~"):
        return Diagnostic(
            "bad-import", f"cannot import {clip(path_text, 200)!r}: an import names a .pps file relative to this script",
            span=item.span, labels=_imported_here(trace),
            hint="write e.g. `import \"common.pps\"` or `import \"../lib/pipeline.pps\"`")
    base = Path(module.file).parent if Path(module.file).suffix == ".pps" else Path(".")
    path = base / path_text
    key = str(path.resolve())
    if key in chain:
        return Diagnostic(
            "import-cycle", f"importing {clip(path_text, 200)!r} here leads back to this file: the imports form a cycle",
            span=item.span, labels=tuple(Label(span, "imported from here") for _, span in stack),
            notes=tuple(f"{Path(k).name} imports {Path(nxt).name}" for k, nxt in zip(chain, chain[1:] + (key,))),
            hint="move the shared strategies into a file that imports neither")
    if len(stack) >= MAX_IMPORT_DEPTH:
        return Diagnostic(
            "recursion-limit", f"imports are nested more than {MAX_IMPORT_DEPTH} files deep", span=item.span,
            hint="import fewer files in a chain")
    try:
        return path, read_source(resolve_import(base, path_text))
    except SourceError as err:
        if err.code == "bad-import":        # a link out of the folder tree, or to another kind of file
            return Diagnostic("bad-import", f"cannot import {clip(path_text, 200)!r}: {err.reason} ({clip(path, 200)})", span=item.span,
                              labels=_imported_here(trace), hint=err.hint)
        return Diagnostic(
            "import-not-found", f"cannot import {clip(path_text, 200)!r}: {err.reason} ({clip(path, 200)})", span=item.span,
            labels=_imported_here(trace),
            hint="the path is relative to the importing script's folder" if err.reason == "no such file"
            else err.hint)


class Program:
    """The main module and the strategies it can name.

    `diagnostics` holds what went wrong while reading imports (missing files,
    cycles, syntax errors in imported files, one name defined twice).
    """

    def __init__(self, main: n.Module):
        self.main = main
        self.diagnostics: list[Diagnostic] = []
        self._scopes: dict[str, dict[str, Found]] = {}
        self._stdlib: dict[str, Found | tuple[Diagnostic, ...] | None] = {}
        self._keys: dict[int, str] = {}
        self._alive: list[n.Module] = []
        self._load(main, stack=(), trace=())

    # ---- imports

    def _key(self, module: n.Module) -> str:
        key = self._keys.get(id(module))
        if key is None:
            path = Path(module.file)
            key = str(path.resolve()) if path.suffix == ".pps" else module.file
            self._keys[id(module)] = key
            self._alive.append(module)  # keeps id(module) from being reused while cached
        return key

    def _load(self, module: n.Module, *, stack: tuple[tuple[str, Span], ...], trace: tuple[Span, ...]) -> None:
        """Fill the scope of `module`: its own strategies, then those of the files it imports."""
        key = self._key(module)
        if key in self._scopes:
            return
        scope: dict[str, Found] = {}
        self._scopes[key] = scope
        for strategy in module.strategies:
            self._add(scope, strategy.name.name, Found(strategy, module), strategy.name.span, trace)
        for item in module.imports:
            imported = self._import(module, item, stack=stack, trace=trace)
            if imported is None:
                continue
            for name, found in self._scopes.get(self._key(imported), {}).items():
                if found.module is imported:
                    self._add(scope, name, found, item.span, trace)

    def _add(self, scope: dict[str, Found], name: str, found: Found, span: Span, trace) -> None:
        first = scope.setdefault(name, found)
        if first.strategy is not found.strategy:
            self.diagnostics.append(_defined_twice(name, first, span, trace))

    def _import(self, module: n.Module, item: n.Import, *, stack, trace) -> n.Module | None:
        chain = tuple(k for k, _ in stack) + (self._key(module),)
        read = _read_import(module, item, chain=chain, stack=stack, trace=trace)
        if isinstance(read, Diagnostic):
            self.diagnostics.append(read)
            return None
        path, text = read
        imported, errors = parse_cached(text, str(path))
        if imported is None:
            self.diagnostics.extend(_with_labels(d, _imported_here(trace + (item.span,))) for d in errors)
            return None
        self._load(imported, stack=stack + ((self._key(module), item.span),), trace=trace + (item.span,))
        return imported

    # ---- lookup

    def visible(self, module: n.Module) -> dict[str, Found]:
        """The strategies `module` can name without the standard library."""
        key = self._key(module)
        if key not in self._scopes:
            self._load(module, stack=(), trace=())
        return self._scopes[key]

    def lookup(self, name: str, module: n.Module) -> Found | tuple[Diagnostic, ...] | None:
        """The strategy `name` as seen from `module`: Found, the stdlib file's errors, or None."""
        found = self.visible(module).get(name)
        if found is not None:
            return found
        return self._from_stdlib(name)

    def _from_stdlib(self, name: str):
        if name in self._stdlib:
            return self._stdlib[name]
        result = None
        entry, text = _stdlib_text(name)
        if text is not None:
            module, errors = parse_cached(text, str(entry))
            if module is None:
                result = errors
            else:
                before = len(self.diagnostics)
                scope = self.visible(module)
                result = scope.get(name)
                if len(self.diagnostics) > before:  # the stdlib file's own imports failed
                    result = tuple(self.diagnostics[before:])
                    del self.diagnostics[before:]
        self._stdlib[name] = result
        return result

    def suggest(self, name: str, module: n.Module) -> str | None:
        """A "did you mean" over every strategy `module` could name."""
        return did_you_mean(name, list(self.visible(module)) + stdlib_names())
