"""Which optimizers Piper can run exactly, checked at `piper.compile` rather than at the first step.

An optimizer's update is one of two kinds (`update_kind`):

- "element": each element on its own given the step count and hyper-parameters (SGD, Adam,
  AdamW...). Every device steps flat buffers: each region's parameters laid end to end, and
  under ZeRO only this device's slice of them; the update gives the same numbers there.
- "tensor": it looks across the elements of one parameter (Muon's orthogonalised matrices,
  Adafactor's row and column statistics, a trust ratio from a parameter's norm). Each such
  parameter is handed to the optimizer whole, with its own shape: every device under plain
  dp, its one owner along the ZeRO axis under ZeRO (`piper.compiler.flat_layout`).

An optimizer class of one's own says which with a class attribute `piper_update = "tensor"`
or `"element"` (`piper_elementwise = True` is the older spelling of "element"). LBFGS is
refused: it re-runs the model inside its step.
"""
from __future__ import annotations

import functools

import torch

from ..diagnostics import error

# torch.optim's updates that are elementwise given the step count and hyper-parameters.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Rprop", "ASGD", "Adadelta")
    if hasattr(torch.optim, name))
# torch.optim's updates of a whole parameter tensor at a time.
PER_TENSOR = tuple(getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name))
KINDS = ("element", "tensor")
_FIX = "pass e.g. optimizer=functools.partial(torch.optim.AdamW, lr=1e-3)"


def optimizer_class(optimizer) -> type | None:
    """The torch optimizer class behind `optimizer` (a class or a partial of one), else None."""
    target = optimizer
    while isinstance(target, functools.partial):   # partial(torch.optim.AdamW, lr=...): no need to build one
        target = target.func
    return target if isinstance(target, type) and issubclass(target, torch.optim.Optimizer) else None


def update_kind(cls: type) -> str | None:
    """"element", "tensor", or None (not known) for an optimizer class.

        update_kind(torch.optim.AdamW) == "element"; update_kind(torch.optim.Muon) == "tensor"
    """
    declared = getattr(cls, "piper_update", None)
    if declared is not None:
        if declared not in KINDS:
            raise error("bad-optimizer", f"{cls.__name__}.piper_update = {declared!r}; it is \"element\" (each "
                        "element updated on its own) or \"tensor\" (each parameter updated whole)",
                        hint=f"set `piper_update = \"tensor\"` on {cls.__name__} if its update reads a whole "
                             "parameter (a norm, a matrix product), else \"element\"")
        return declared
    if getattr(cls, "piper_elementwise", False) is True or cls in ELEMENTWISE:
        return "element"
    if cls in PER_TENSOR:
        return "tensor"
    return None


def check_optimizer(optimizer) -> str | None:
    """Raise bad-optimizer unless `optimizer` is None or a callable that builds a torch
    optimizer Piper can run exactly from a list of tensors; return its update kind
    ("element", "tensor"; None for None).

        check_optimizer(torch.optim.Muon) == "tensor"
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        raise error("bad-optimizer", f"optimizer={optimizer!r} is a name; Piper needs a callable that builds the "
                    "optimizer from a list of tensors (each device builds its own over its shard)", hint=_FIX)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise error("bad-optimizer", f"optimizer= is a {type(optimizer).__name__} already built on parameters; "
                    "Piper needs a callable that builds one, since each device builds its own over its shard",
                    hint=f"pass functools.partial(torch.optim.{type(optimizer).__name__}, lr=...) instead")
    if not callable(optimizer):
        raise error("bad-optimizer", f"optimizer={optimizer!r} is not callable", hint=_FIX)
    cls = optimizer_class(optimizer) or _built_class(optimizer)
    if issubclass(cls, torch.optim.LBFGS):
        raise error("bad-optimizer", "LBFGS needs a closure that re-evaluates the loss at each step, and "
                    "a Piper step is one forward and backward spread over the devices",
                    hint="use a first-order optimizer such as AdamW, or Muon for the matrices")
    kind = update_kind(cls)
    if kind is not None:
        return kind
    known = ", ".join(c.__name__ for c in ELEMENTWISE + PER_TENSOR)
    raise error("bad-optimizer", f"{cls.__name__} does not say how it updates a parameter: elementwise "
                "updates run on flat slices of the parameters, per-tensor ones on each parameter whole",
                notes=(f"known: {known}",),
                hint=f"set `piper_update = \"element\"` on {cls.__name__} if it updates each element on its own, "
                     "or `piper_update = \"tensor\"` if it reads a whole parameter (a norm, a matrix product)")


def _built_class(optimizer) -> type:
    """The class of what a callable that is not a class builds, from a probe matrix."""
    probe = torch.zeros(2, 2, requires_grad=True)     # a matrix: Muon takes only those
    try:
        built = optimizer([probe])
    except Exception as exc:  # noqa: BLE001 - the user's callable, reported with its own words
        raise error("bad-optimizer", f"optimizer([tensor]) raised {type(exc).__name__}: {exc}",
                    hint="the callable is given a list of parameter tensors; " + _FIX) from None
    if not isinstance(built, torch.optim.Optimizer):
        raise error("bad-optimizer", f"optimizer([tensor]) returned {type(built).__name__}, not a "
                    "torch.optim.Optimizer", hint=_FIX)
    return type(built)


def kind_of(optimizer) -> str:
    """The update kind of a checked optimizer callable (None: Piper's default AdamW)."""
    if optimizer is None:
        return "element"
    return update_kind(optimizer_class(optimizer) or _built_class(optimizer)) or "element"


def refuse_sharded(where: str, names, supported: str) -> None:
    """bad-optimizer for per-tensor updates of parameters a strategy divides (`where`: "tp",
    "shard experts"), until their gather-update-divide path exists."""
    names = sorted(names)
    raise error("bad-optimizer", f"a per-tensor optimizer updates {len(names)} parameter(s) that `{where}` "
                f"divides over devices ({', '.join(f'`{n}`' for n in names[:3])}{' ...' if len(names) > 3 else ''}), "
                "and Piper does not yet gather a divided parameter for its update: stepping each device's piece "
                "would train a different model",
                notes=(f"supported with per-tensor optimizers: {supported}",),
                hint="update those parameters with an elementwise optimizer, e.g. piper.per_group({\"**@2d\": "
                     "torch.optim.Muon, ...}) with a pattern that leaves them to AdamW, or drop the "
                     f"`{where}` statement")
