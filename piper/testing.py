"""Check a strategy against single-device training of the same model.

    losses, ref_losses, state, ref_state = piper.testing.train_both(
        make_model, strategy, mesh={"pp": 2}, batches=batches, steps=3)

Both runs start from the same weights and see the same global batches; a
correct strategy gives the same losses and parameters up to rounding.
"""
from __future__ import annotations

import copy
import functools

import torch


def single_device(model: torch.nn.Module, batches, optimizer, clip_grad_norm: float | None = None
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `model` (in place) on `batches`, one optimizer step per batch (gradients clipped
    by `torch.nn.utils.clip_grad_norm_` first, if `clip_grad_norm` is given)."""
    opt = optimizer(list(model.parameters()))
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_both(model: torch.nn.Module, strategy, *, mesh, batches, optimizer=None, job_hook=None, **compile_kw):
    """Train a copy of `model` with `strategy` and another copy on one device.

    Returns (piper_losses, reference_losses, piper_state, reference_state).
    `job_hook(job)` runs after the last step, before the job closes (for
    inspecting memory, plans...).
    """
    from .job import compile

    optimizer = optimizer or functools.partial(torch.optim.AdamW, lr=1e-3)
    batches = list(batches)
    reference = copy.deepcopy(model)
    with compile(copy.deepcopy(model), batches[0], strategy=strategy, mesh=mesh, optimizer=optimizer,
                 **compile_kw) as job:
        losses = [job.step(*b) for b in batches]
        state = job.state_dict()
        if job_hook is not None:
            job_hook(job)
    ref_losses, ref_state = single_device(reference, batches, optimizer, compile_kw.get("clip_grad_norm"))
    return losses, ref_losses, state, ref_state
