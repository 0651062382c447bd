"""Which optimizers Piper can run exactly, checked at `piper.compile` rather than at the first step.

Every device steps flat buffers: each region's parameters laid end to end (and
under ZeRO only this device's slice of them). An update that treats every
element on its own (SGD, Adam, AdamW...) gives the same numbers on a flat slice
as on the parameters; one that looks across elements (Adafactor's row and
column statistics, Muon's orthogonalised matrices, LAMB's per-tensor trust
ratio) would train a different model without any error, so it is refused.
"""
from __future__ import annotations

import functools

import torch

from ..diagnostics import error

# torch.optim's updates that are elementwise given the step count and hyper-parameters.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Rprop", "ASGD", "Adadelta")
    if hasattr(torch.optim, name))
_FIX = "pass e.g. optimizer=functools.partial(torch.optim.AdamW, lr=1e-3)"
_WHY = ("each device steps flat buffers of its regions' parameters (under ZeRO, only its slice of them), so "
        "an optimizer that looks across the elements of a parameter would train a different model")


def check_optimizer(optimizer) -> None:
    """Raise bad-optimizer unless `optimizer` is None or a callable that builds an elementwise
    torch optimizer from a list of tensors. An optimizer class of one's own that is elementwise
    says so with a class attribute `piper_elementwise = True`."""
    if optimizer is None:
        return
    if isinstance(optimizer, str):
        raise error("bad-optimizer", f"optimizer={optimizer!r} is a name; Piper needs a callable that builds the "
                    "optimizer from a list of tensors (each device builds its own over its shard)", hint=_FIX)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise error("bad-optimizer", f"optimizer= is a {type(optimizer).__name__} already built on parameters; "
                    "Piper needs a callable that builds one, since each device builds its own over its shard",
                    hint=f"pass functools.partial(torch.optim.{type(optimizer).__name__}, lr=...) instead")
    if not callable(optimizer):
        raise error("bad-optimizer", f"optimizer={optimizer!r} is not callable", hint=_FIX)
    target = optimizer
    while isinstance(target, functools.partial):   # partial(torch.optim.AdamW, lr=...): no need to build one
        target = target.func
    cls = target if isinstance(target, type) and issubclass(target, torch.optim.Optimizer) else None
    if cls is None:
        probe = torch.zeros(4, requires_grad=True)
        try:
            built = optimizer([probe])
        except Exception as exc:  # noqa: BLE001 - the user's callable, reported with its own words
            raise error("bad-optimizer", f"optimizer([tensor]) raised {type(exc).__name__}: {exc}",
                        hint="the callable is given a list of flat parameter tensors; " + _FIX) from None
        if not isinstance(built, torch.optim.Optimizer):
            raise error("bad-optimizer", f"optimizer([tensor]) returned {type(built).__name__}, not a "
                        "torch.optim.Optimizer", hint=_FIX)
        cls = type(built)
    if issubclass(cls, torch.optim.LBFGS):
        raise error("bad-optimizer", "LBFGS needs a closure that re-evaluates the loss at each step, and "
                    "a Piper step is one forward and backward spread over the devices",
                    notes=(_WHY,), hint="use a first-order optimizer such as AdamW or SGD")
    if getattr(cls, "piper_elementwise", False) is True or cls in ELEMENTWISE:
        return
    raise error("bad-optimizer", f"{cls.__name__} is not known to update each element on its own: {_WHY}",
                notes=(f"known elementwise: {', '.join(c.__name__ for c in ELEMENTWISE)}",),
                hint=f"use one of those; if {cls.__name__} is elementwise, set `piper_elementwise = True` "
                     "on its class")
