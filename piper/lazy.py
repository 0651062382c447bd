"""Modules loaded on first use: `piper check` plans a script without importing torch.

    torch = LazyModule("torch")      # nothing imported yet
    torch.float32                    # imports torch here, then forwards
"""
from __future__ import annotations

import importlib


class LazyModule:
    """Stands for the module `name` and imports it at the first attribute read."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._name)
        value = getattr(module, attr)
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
