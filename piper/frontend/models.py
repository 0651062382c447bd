"""Load a model named on the command line as `path.py:Factory`.

The factory takes no arguments and returns an nn.Module; the same file
defines `example_batch(batch_size)` returning the tensors forward takes,
and may define `batches(...)`-style data of its own for `piper run`.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from ..diagnostics import error


def load_module(path: str):
    if not os.path.exists(path):
        raise error("model-not-found", f"no file {path!r}", hint="write --model path/to/model.py:Factory")
    name = "piper_user_" + os.path.splitext(os.path.basename(path))[0]
    directory = os.path.dirname(os.path.abspath(path))
    root = os.path.dirname(directory)
    for p in (directory, root):   # so the file can import its siblings and its package
        if p not in sys.path:
            sys.path.insert(0, p)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_model(spec: str):
    """`"examples/gpt.py:small_gpt"` -> (model, module)."""
    path, colon, factory = spec.rpartition(":")
    if not colon or not path:
        raise error("bad-model-spec", f"cannot read model spec {spec!r}",
                    hint="write PATH.py:FACTORY, e.g. examples/gpt.py:small_gpt")
    module = load_module(path)
    if not hasattr(module, factory):
        from ..diagnostics import did_you_mean
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise error("bad-model-spec", f"{path} has no `{factory}`", hint=did_you_mean(factory, names)
                    or "name a function or class that builds the model with no arguments")
    build = getattr(module, factory)
    needs = _required_arguments(build)
    if needs:
        names = [n for n in dir(module) if not n.startswith("_") and n != factory
                 and callable(getattr(module, n)) and not _required_arguments(getattr(module, n))
                 and getattr(getattr(module, n), "__module__", None) == module.__name__
                 and not any(word in n for word in ("batch", "load", "data", "corpus"))]   # data, not models
        raise error("bad-model-spec", f"`{factory}` in {path} needs argument{'s' if len(needs) > 1 else ''} "
                    f"{', '.join(f'`{a}`' for a in needs)}; --model names something that builds the model "
                    "with no arguments", hint=(f"name one of {', '.join(names[:6])}, or " if names else "")
                    + f"add a function such as `def make(): return {factory}(...)` to the file")
    try:
        return build(), module
    except Exception as exc:  # noqa: BLE001 - the user's code: say where it failed, in its words
        raise error("bad-model", f"`{factory}()` from {path} raised {type(exc).__name__}: {exc}",
                    hint="fix the model's file; run it with python to see the traceback") from None


def _required_arguments(factory) -> list[str]:
    """The parameters `factory()` would be missing ([] when it can be called with none)."""
    import inspect

    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values() if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def example_batch(module, batch_size: int):
    if not hasattr(module, "example_batch"):
        raise error("no-example-batch", f"{module.__file__} does not define example_batch(batch_size)",
                    hint="add `def example_batch(batch_size): return (inputs, targets)` to the model's file")
    return tuple(module.example_batch(batch_size))
