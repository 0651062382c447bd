"""One microbatch's run through a cut region (`pieces`), and the small
bookkeeping its pieces share: gradient sums, view copies, saved-bytes accounting.
"""
from __future__ import annotations

import torch

from ...ir.cut_parts import Source

PARAM, VALUE = "param", "value"


class _Pass:
    """One microbatch's run of a cut region, from its first forward piece to its last backward piece."""

    def __init__(self, args, leaves):
        self.args = args                    # the region's inputs (`Executor._args`)
        self.leaves = leaves                # value id -> leaf, for the region's differentiable value inputs
        self.values: dict[Source, object] = {}          # what pieces and exchanges produced
        self.differentiable: set[Source] = set()        # exchange outputs that carry a gradient back
        self.outs: dict[int, tuple] = {}                # piece -> its outputs (kept for its backward)
        self.boundary: dict[int, list] = {}             # piece -> [(Source, leaf)] it read
        self.grads: dict[Source, torch.Tensor] = {}     # gradients waiting for their producer's backward
        self.input_grads: dict[int, torch.Tensor] = {}  # value id -> gradient (BI)
        self.weight_states: dict[int, object] = {}      # piece -> what its BW needs (BI)
        self.kept: dict[int, object] = {}               # piece -> its inputs (a recomputed region)
        self.saved: dict[int, set] = {}                 # piece -> storages its autograd graph saved
        self.shapes: dict[Source, tuple] = {}           # a let-go exchange result -> (shape, dtype, device)
        self.seeded = False


def _add(grads: dict, key, g) -> None:
    grads[key] = grads[key] + g if key in grads else g


def _no_views(outs) -> tuple:
    """A piece's outputs, a view of its input (a reshape) copied: its own backward for inputs
    (`split_backward`) detaches its outputs in place, which a view does not allow."""
    return tuple(o.clone() if torch.is_tensor(o) and o.requires_grad and o._is_view() else o for o in outs)


def _count(ex, key, size: int) -> None:
    """`size` more bytes saved for the backward of pass `key` (the executor's activation accounting)."""
    with ex._lock:
        ex.saved_bytes[key] += size
        ex.activations += size
        ex.activation_peak = max(ex.activation_peak, ex.activations)


def let_go(run: _Pass, source: Source, readers: tuple[int, ...], *, exchange: bool) -> None:
    """After the last piece that reads `source` has run (`Cut.after_piece`): drop the pass's
    reference, and the data too where no autograd graph of the pieces that made or read it saved
    its storage (the tensor stays where a backward starts from it, its storage emptied). Only
    differentiable values that are not views, in a training pass whose pieces ran with autograd
    (a recomputed piece keeps its inputs to run again)."""
    value = run.values.pop(source, None)
    if not torch.is_tensor(value):
        return
    if exchange:
        run.shapes[source] = (value.shape, value.dtype, value.device)
    differentiable = source in run.differentiable if exchange else value.requires_grad
    saved = [run.saved.get(r) for r in readers] + ([] if exchange else [run.saved.get(source.index)])
    if not differentiable or value._is_view() or any(s is None for s in saved):
        return
    storage = value.untyped_storage()
    if not any(storage._cdata in s for s in saved):
        storage.resize_(0)
