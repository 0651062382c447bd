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


# -- before a job starts (`piper.compile`; planning and `piper tune` may use meta models) ----------

def check_parameters(model) -> None:
    """Raise `meta-parameters` when the model's parameters or buffers are on the meta device: they
    hold no values, so the workers would have nothing to start from."""
    found = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if found:
        shown = ", ".join(f"`{n}`" for n in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise error("meta-parameters", f"{len(found)} of the model's tensors are on the meta device ({shown}): "
                    "they have shapes but no values, so there is nothing to train",
                    notes=("a model built under `torch.device('meta')` (or loaded with low_cpu_mem_usage) is fine "
                           "for `piper check`, `piper tune` and memory predictions, not for training",),
                    hint="build the model on the CPU, or materialise it first: model.to_empty(device='cpu') "
                         "and then load or initialise its weights (e.g. model.load_state_dict(...))")


def check_loss_gradient(program) -> None:
    """Raise `loss-without-gradient` when the captured loss cannot be differentiated: an integer loss,
    or one detached from every parameter (`.detach()`, `.item()` made a tensor again, `torch.no_grad`).
    The loss region runs once on the meta device (no memory, no compute) with its parameters and
    differentiable inputs requiring grad."""
    import torch

    region = next((r for r in program.regions if r.loss), None)
    if region is None or region.graph is None:
        return
    where = f" (returned by the region at {region.source})" if region.source else ""
    fix = ("return a floating-point loss computed from the model's outputs without .detach(), .item() or "
           "torch.no_grad(), e.g. torch.nn.functional.cross_entropy(logits, targets)")
    out = next(n for n in region.graph.graph.nodes if n.op == "output").args[0]
    last = out[-1] if isinstance(out, (tuple, list)) else out
    val = getattr(last, "meta", {}).get("val")
    if isinstance(val, torch.Tensor) and not (val.dtype.is_floating_point or val.dtype.is_complex):
        raise error("loss-without-gradient", f"forward returns a loss of dtype {val.dtype}{where}: an integer "
                    "tensor has no gradient, so backward cannot train anything", hint=fix)
    specs = {v.id: v for v in program.values}
    args = []
    for i in region.inputs:
        if i.kind == "param":
            s = program.params[i.ref]
            args.append(torch.empty(s.shape, dtype=s.dtype, device="meta", requires_grad=s.dtype.is_floating_point))
        elif i.kind == "buffer":
            s = program.buffers[i.ref]
            args.append(torch.empty(s.shape, dtype=s.dtype, device="meta"))
        elif i.kind == "batch":
            s = program.batch[i.ref]
            args.append(torch.empty(s.shape, dtype=s.dtype, device="meta"))
        else:
            v = specs[i.ref]
            args.append(torch.empty(v.spec.shape, dtype=v.spec.dtype, device="meta",
                                    requires_grad=v.differentiable and v.spec.dtype.is_floating_point))
    try:
        with torch.enable_grad():
            outs = region.graph(*args)
    except Exception:             # noqa: BLE001 - an op without a meta kernel: the workers will tell
        return
    loss = outs[-1] if isinstance(outs, (tuple, list)) else outs
    if isinstance(loss, torch.Tensor) and not loss.requires_grad:
        raise error("loss-without-gradient", f"the loss forward returns does not depend on any parameter "
                    f"through a differentiable path{where}: it was detached, so backward would fail on "
                    "every worker", hint=fix)
