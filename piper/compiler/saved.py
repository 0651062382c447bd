"""Counting what autograd saves for backward in one forward.

The count comes from a `saved_tensors_hooks` pack hook. The hook hands
autograd a detached alias, not the tensor it was given: a tensor an op saves
of its own output (tanh, softmax, GELU's tanh form...) points back at that
op's node through `grad_fn`, so keeping it in the node closes a cycle that
runs through C++, where Python's collector cannot see it. A full backward
breaks the cycle when it frees each node's saved tensors; a split backward
does not. BI keeps the graph, and BW only frees the nodes between the saved
intermediates and the weights, so every node on the input path would keep
its activations for the life of the process (a ZB-V run grew by one step's
activations every step). The alias shares storage and version counter, so
autograd reads the same data and sees the same in-place checks.
"""
from __future__ import annotations

import torch


class SavedBytes:
    """`with SavedBytes(exclude) as saved: ...` runs a forward; `saved.size` is then the bytes
    of the storages autograd kept, each once, those in `exclude` (storage `_cdata`) left out."""

    __slots__ = ("exclude", "size", "_seen", "_hooks")

    def __init__(self, exclude=frozenset()):
        self.exclude = exclude
        self.size = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._seen and key not in self.exclude:
            self._seen.add(key)
            self.size += storage.nbytes()
        return t.detach()

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
