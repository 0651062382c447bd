"""Layers Piper cannot train as one device would, named before capture says something opaque.

BatchNorm in training mode normalises each batch by its own statistics and
updates running statistics in place. Piper cuts the global batch into
microbatches and data-parallel shards, so each slice would be normalised by its
own, smaller batch (a different model from one device's), and buffer updates
inside forward are not captured. Frozen BatchNorm (`eval()`: running
statistics, as when fine-tuning) is fine.
"""
from __future__ import annotations

from ..diagnostics import error


def check_layers(model) -> None:
    """Raise unsupported-model naming the first BatchNorm layer in training mode."""
    import torch   # here, not at the top: capture's module is imported by torch-free planning
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training:
            kind = type(module).__name__
            raise error("unsupported-model", f"`{name or 'model'}` is a {kind} in training mode: it normalises "
                        "by the statistics of each batch, and Piper runs each microbatch and data-parallel "
                        "shard on its own, so every slice would see different statistics than one device does",
                        notes=("running statistics updated in place inside forward are not captured either",),
                        hint=f"replace {kind} with LayerNorm or GroupNorm (torch.nn.GroupNorm(1, C) normalises "
                             f"like LayerNorm over channels), or freeze it with `model.{name}.eval()` to use "
                             "its running statistics")
