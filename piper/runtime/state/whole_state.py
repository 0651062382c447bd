"""The optimizer state of a unit's `whole` buckets (parameters a per-tensor optimizer such as
Muon or Adafactor updates whole) as the checkpoint keys it: `optim.state.<name>.<key>`, torch's
own state names, each tensor one chunk at offset 0 of its own shape.

Each such parameter's state lives on its one owner (`Bucket.owned`): the owner writes it and,
loading, asks for it whole, whichever device owned it when it was saved; a job with another
owner, dp size or ZeRO level reads the same keys. Its shape is the optimizer's, not always
the parameter's (Adafactor keeps a row and a column vector for a matrix).
"""
from __future__ import annotations

import torch


def whole_state(unit, b: int, chunks, saving: bool = False) -> dict[str, dict]:
    """{parameter name: {state key: chunks or value}} for bucket `b` of `unit` (a `whole` one), each
    tensor as one box of `chunks` (`checkpoint.Chunks`, handed in: that module imports this one).
    Under tp every tp index holds the same whole state (a divided parameter is updated whole on
    each): tp index 0 writes it, every index reads it."""
    out: dict[str, dict] = {}
    if saving and unit.layout.tensor_index > 0:
        return out
    for view, e in unit.whole[b]:
        for key, value in unit.optimizer.state.get(view, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                out.setdefault(e.name, {})[key] = chunks(tuple(value.shape), [((0,) * value.dim(), value)])
            else:          # a step count
                out.setdefault(e.name, {})[key] = value
    return out


def restore_values(unit, loaded: dict) -> None:
    """After a load: hand the state values that are not tensors (a plain-number count), which DCP
    puts into `loaded` ({name: {key: value}}) rather than in place, to each whole parameter's state."""
    for whole in unit.whole:
        for view, e in whole:
            mine = unit.optimizer.state.get(view, {})
            for key, value in mine.items():
                if not torch.is_tensor(value) and key in loaded.get(e.name, {}):
                    mine[key] = loaded[e.name][key]
