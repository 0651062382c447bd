"""The house's layers: every import of `piper/` and `dsl/` runs one way, and no files import each other in a loop.

Layers, lowest first; a file imports only its own layer and those below it:

    base < front ends < IR < compiler < runtime < driver < top

The imports are read with `ast`, as a reader would: module level and inside functions, `import piper.x`,
`from . import x`, `from ..x import y`. Imports under `if TYPE_CHECKING:` are left out: they never run, so
they neither load a layer nor close a loop.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"piper": ROOT / "piper", "piper.dsl": ROOT / "dsl"}

LAYERS = ["base", "front end", "IR", "compiler", "runtime", "driver", "top"]

# Top-level modules of piper/, by what they are and what imports them.
TOP_LEVEL = {
    "piper.diagnostics": "base",   # diagnostics as data; everything reports through it
    "piper.render": "base",        # how diagnostics and tables print
    "piper.mesh": "base",          # the device mesh, read by front ends, compiler and runtime
    "piper.lazy": "base",          # modules loaded on first use (`piper check` without torch)
    "piper.gc_guard": "base",      # garbage-collector guard the runtime and the driver share
    "piper.cache_dir": "base",
    "piper.user_files": "base",    # the one bounded reader of files users and caches hand Piper     # where caches live; read by the parser (dsl) and by `piper tune`
    "piper.expert_context": "base",  # the calling thread's expert group: nn's MoE ops ask, the runtime sets it
    "piper.lane_context": "base",  # a per-thread group for ops issuing collectives (the expert and tensor contexts)
    "piper.tensor_context": "base",  # the calling thread's tensor-parallel group: the TP ops ask, the runtime sets it
    "piper.tensor_ops": "front end",  # the collectives of tensor parallelism, as ops capture records
    "piper.nn": "front end",       # the modules a model is written with (experts, annotations)
    "piper.data": "runtime",       # datasets the workers read; the driver hands them over
    "piper.data_order": "base",    # the shuffled order computed per index: piper.data's, no torch
    "piper.run_args": "top",       # the flags of `piper run` / `piper tune`, for the command line
    "piper.run_paths": "top",      # output paths `piper run` checks before starting
    "piper.run_recipe": "top",     # `piper run`'s recipe flags and --config files: reads the command line
    "piper.testing": "top",        # checks a strategy against one device: uses the whole stack
    "piper.cli": "top",
    "piper.cli_run": "top",
    "piper.cli_tune": "top",       # `piper tune`: the compiler's search, and the jobs that calibrate and verify it
    "piper.cli_export": "top",     # `piper export`: compiles, then the front end writes torch's CSV
    "piper": "top",                # piper/__init__.py, the public face
}
SUBPACKAGES = {
    "piper.dsl": "front end",
    "piper.frontend": "front end",
    "piper.ir": "IR",
    "piper.compiler": "compiler",
    "piper.runtime": "runtime",
    "piper.job": "driver",
    "piper.stdlib": "base",
    "piper.docs": "base",
}


def module_files() -> dict[str, Path]:
    """Every module of piper/ and dsl/ by its dotted name."""
    mods = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "piper" and parts and parts[0] == "dsl":
                continue
            mods[".".join([pkg, *parts])] = path
    return mods


def layer_of(mod: str) -> str:
    """The layer a module belongs to; a new top-level module must be placed in TOP_LEVEL by hand."""
    for pkg, layer in SUBPACKAGES.items():
        if mod == pkg or mod.startswith(pkg + "."):
            return layer
    assert mod in TOP_LEVEL, f"{mod}: a new top-level module of piper/; place it in TOP_LEVEL with a reason"
    return TOP_LEVEL[mod]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(mod: str, path: Path, mods: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module of piper) for every import a file makes, resolved to files."""
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    found = []

    def add(line: int, name: str) -> None:
        name = "piper.dsl" + name[len("dsl"):] if name == "dsl" or name.startswith("dsl.") else name
        while name and name not in mods:          # `import piper.compiler.plans.X` -> the file
            name = name.rpartition(".")[0]
        if name and name != mod:
            found.append((line, name))

    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("piper", "dsl"):
                    add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
                if target.split(".")[0] not in ("piper", "dsl"):
                    continue
            for alias in node.names:                  # `from . import x`: x may be a module
                sub = f"{target}.{alias.name}"
                add(node.lineno, sub if sub in mods or sub.replace("dsl", "piper.dsl", 1) in mods else target)
    return sorted(set(found))


def import_graph():
    mods = module_files()
    return mods, {mod: imports_of(mod, path, mods) for mod, path in mods.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node (iterative, so deep graphs do not overflow the stack)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop(); on_stack.discard(top); comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_tarjan_finds_loops_and_only_loops():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set(), "g": {"g"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_reader_resolves_relative_and_absolute_imports(tmp_path):
    mods = {"piper.ir.x": tmp_path / "x.py", "piper.ir": tmp_path / "__init__.py",
            "piper.compiler.plans": tmp_path / "p.py", "piper.diagnostics": tmp_path / "d.py",
            "piper.dsl.script": tmp_path / "s.py"}
    src = tmp_path / "x.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom ..diagnostics import error\n"
                   "def f():\n    import piper.compiler.plans\n    from ..dsl import script\n"
                   "if TYPE_CHECKING:\n    from ..compiler import plans\n"
                   "from dsl.script import run\n")
    assert imports_of("piper.ir.x", src, mods) == [
        (2, "piper.diagnostics"), (4, "piper.compiler.plans"), (5, "piper.dsl.script"), (8, "piper.dsl.script")]


def test_every_module_has_a_layer():
    for mod in module_files():
        assert layer_of(mod) in LAYERS


def test_imports_run_one_way():
    mods, graph = import_graph()
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    against = [f"{mods[mod].relative_to(ROOT)}:{line}: {mod} ({layer_of(mod)}) imports {dep} ({layer_of(dep)})"
               for mod, deps in sorted(graph.items()) for line, dep in deps
               if rank[layer_of(dep)] > rank[layer_of(mod)]]
    assert not against, "imports against the layers:\n" + "\n".join(against)


def test_no_loops_of_files():
    _, graph = import_graph()
    loops = strongly_connected({mod: {dep for _, dep in deps} for mod, deps in graph.items()})
    assert not loops, "files that import each other in a loop:\n" + "\n".join(" <-> ".join(c) for c in loops)


# piper/runtime/'s rooms, lowest first (piper/runtime/__init__.py says what each holds).
RUNTIME_ROOMS = ["launch", "communication", "state", "autograd", "moe", "execution", "health", "workers"]


def _room(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if parts[:2] == ["piper", "runtime"] and len(parts) > 2 else None


def test_every_runtime_file_is_in_a_room():
    loose = [m for m in module_files() if m.startswith("piper.runtime") and _room(m) not in RUNTIME_ROOMS
             and m != "piper.runtime"]
    assert not loose, f"runtime modules outside the rooms {RUNTIME_ROOMS}: {loose}"


def test_runtime_rooms_import_one_way():
    mods, graph = import_graph()
    rank = {room: i for i, room in enumerate(RUNTIME_ROOMS)}
    against = [f"{mods[mod].relative_to(ROOT)}:{line}: {mod} imports {dep}"
               for mod, deps in sorted(graph.items()) if _room(mod) in rank for line, dep in deps
               if dep == "piper.runtime" or (_room(dep) in rank and rank[_room(dep)] > rank[_room(mod)])]
    assert not against, "imports against the runtime's rooms:\n" + "\n".join(against)
