"""Flat parameter units on a worker: a bucket's named tensors packed into its flat buffer and back.

The layout itself (`UnitLayout`, `layout_unit`) is the compiler's (`piper.compiler.flat_layout`): the
memory model replays it without torch's tensors.
"""
from __future__ import annotations

import torch

from ...compiler.flat_layout import Bucket


def flatten(bucket: Bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The full padded flat buffer of a bucket from named tensors (on CPU)."""
    flat = torch.zeros(bucket.padded, dtype=bucket.dtype)
    for e in bucket.entries:
        flat[e.offset:e.offset + e.numel] = tensors[e.name].detach().reshape(-1).to(bucket.dtype)
    return flat


def unflatten(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Named tensors (copies) from a full flat buffer."""
    return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape).clone() for e in bucket.entries}
