"""Running a region marked by `recompute` (piper/ir/recompute.py): forward without a
graph, keeping only the inputs; the first backward pass of the microbatch (B, or
BI under a split backward) runs the forward again with gradients on.

The second forward sees the same inputs: parameters are the unit's own leaf
tensors (a ZeRO-3 unit is gathered again for the backward, as it is anyway),
values are the detached input leaves kept from the forward, so their
gradients land where the executor looks for them. A region with random ops
(dropout) replays the random number generator's state of its forward, as
torch.utils.checkpoint does.
"""
from __future__ import annotations

import contextlib

import torch

from ...compiler.saved import SavedBytes

_RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "exponential", "poisson")
_random_graphs: dict[int, bool] = {}


class Kept:
    """What a recomputed region keeps from its forward: its inputs, and the RNG state if it draws."""

    __slots__ = ("args", "rng")

    def __init__(self, args, rng):
        self.args = args
        self.rng = rng


def _draws_random(graph) -> bool:
    key = id(graph)
    found = _random_graphs.get(key)
    if found is None:
        found = _random_graphs[key] = any(
            node.op == "call_function" and any(word in str(node.target) for word in _RANDOM)
            for node in graph.graph.nodes)
    return found


def _rng_state(device: torch.device):
    state = [torch.get_rng_state()]
    if device.type == "cuda":
        state.append(torch.cuda.get_rng_state(device))
    return state


def forward(graph, args, device: torch.device, exclude) -> tuple[tuple, Kept, int]:
    """The forward without a graph: (outputs, what to keep, bytes kept).

    The bytes kept are the inputs' storages (parameters, in `exclude`, not counted)."""
    rng = _rng_state(device) if _draws_random(graph) else None
    with torch.no_grad():
        outs = graph(*args)
    seen, size = set(), 0
    for a in args:
        if isinstance(a, torch.Tensor):
            storage = a.untyped_storage()
            key = storage._cdata
            if key not in seen and key not in exclude:
                seen.add(key)
                size += storage.nbytes()
    return outs, Kept(args, rng), size


def rerun(graph, kept: Kept, device: torch.device, exclude) -> tuple[tuple, int]:
    """The forward again, with gradients: (outputs, bytes autograd saved)."""
    # The kept inputs are counted already (`forward`): what the rerun saves beyond them.
    exclude = set(exclude) | {a.untyped_storage()._cdata for a in kept.args if isinstance(a, torch.Tensor)}
    replay = contextlib.nullcontext()
    if kept.rng is not None:
        replay = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with replay:
        if kept.rng is not None:
            torch.set_rng_state(kept.rng[0])
            if device.type == "cuda":
                torch.cuda.set_rng_state(kept.rng[1], device)
        with torch.enable_grad(), SavedBytes(exclude) as saved:
            outs = graph(*kept.args)
    return outs, saved.size
