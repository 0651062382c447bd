"""`job.step`'s inputs checked in the driver against what was captured, before any worker sees them.

Capture fixed every input's shape and dtype (a microbatch's slice of the
example batch); a step with a different feature size, sequence length, rank or
dtype would otherwise reach the workers and fail inside a collective, killing
the job. Here it is a `bad-inputs` error naming the input, and the job stays
usable.
"""
from __future__ import annotations

import inspect

import torch

from ..diagnostics import error


def input_names(model, count: int) -> tuple[str, ...]:
    """The names of forward's first `count` parameters (`x`, `y`), or `input 0`, `input 1`..."""
    try:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return tuple(f"`{names[i]}`" if i < len(names) else f"input {i}" for i in range(count))


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_step_inputs(batch, specs, batch_size: int, names) -> None:
    """Raise bad-inputs unless `batch` holds one tensor per captured input, each of shape
    (batch_size, *captured shape[1:]) and the captured dtype."""
    if len(batch) != len(specs):
        raise error("bad-inputs", f"step takes {len(specs)} batch tensor(s) ({', '.join(names)}), got {len(batch)}",
                    hint="pass the same inputs as example_inputs")
    for x, spec, name in zip(batch, specs, names):
        if not isinstance(x, torch.Tensor):
            raise error("bad-inputs", f"{name} is a {type(x).__name__}, not a tensor",
                        hint="pass the same kind of inputs as example_inputs")
        expected = (batch_size, *spec.shape[1:])
        if x.dim() >= 1 and x.shape[0] != batch_size and tuple(x.shape[1:]) == expected[1:]:
            raise error("bad-inputs", f"step got a batch of {x.shape[0]} in {name}; this job was compiled for "
                        f"{batch_size}", hint="keep the global batch size fixed, or compile again")
        if tuple(x.shape) != expected:
            what = "rank" if x.dim() != len(expected) else "shape"
            raise error("bad-inputs", f"{name} has shape {_shape(x.shape)}; this job was compiled for "
                        f"{_shape(expected)} (a wrong {what})",
                        notes=("every step's inputs keep the example inputs' shapes: capture fixed them",),
                        hint="pass tensors shaped like example_inputs (pad or cut sequences to the same length), "
                             "or compile again for the new shape")
        if x.dtype != spec.dtype:
            raise error("bad-inputs", f"{name} has dtype {x.dtype}; this job was compiled for {spec.dtype}",
                        hint=f"convert it first, e.g. x.to({spec.dtype})")
