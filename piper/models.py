"""Load a model named on the command line as `path.py:Factory`.

The factory takes no arguments and returns an nn.Module; the same file
defines `example_batch(batch_size)` returning the tensors forward takes,
and may define `batches(...)`-style data of its own for `piper run`.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from .diagnostics import error


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
        from .diagnostics import did_you_mean
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise error("bad-model-spec", f"{path} has no `{factory}`", hint=did_you_mean(factory, names)
                    or "name a function or class that builds the model with no arguments")
    return getattr(module, factory)(), module


def example_batch(module, batch_size: int):
    if not hasattr(module, "example_batch"):
        raise error("no-example-batch", f"{module.__file__} does not define example_batch(batch_size)",
                    hint="add `def example_batch(batch_size): return (inputs, targets)` to the model's file")
    return tuple(module.example_batch(batch_size))
