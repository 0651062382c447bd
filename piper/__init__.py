"""Piper: a programmable distributed training system for PyTorch.

    with piper.annotate("PP"): ...          # mark regions in forward
    piper.annotate_modules(model, "PP", [["embed", "blocks.0"], ["blocks.1", "head"]])   # or by module name
    @piper.strategy def zero3(s): ...       # or a .pps script
    job = piper.compile(model, example_inputs=(x, y), strategy=zero3, mesh={"dp": 2})
    loss = job.step(x, y)
"""
from .frontend.annotate import annotate
from .diagnostics import Diagnostic, PiperError, PiperWarning, Span
from .frontend.loss_scaling import FP16, loss_scale
from .mesh import Mesh
from .frontend.lr_schedules import warmup_cosine
from .frontend.strategy import strategy

__all__ = ["annotate", "annotate_modules", "strategy", "compile", "Mesh", "PiperError", "PiperWarning", "Diagnostic",
           "Span", "FP16", "loss_scale", "param_groups", "per_group", "warmup_cosine"]


def __getattr__(name):
    # `piper.nn` as `torch.nn` is: there after `import piper`, but loaded on first use, so that
    # `piper check` (which imports piper) never imports torch.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'piper' has no attribute {name!r}")


def compile(*args, **kwargs):
    """Compile a model and a strategy into a running job (see `piper.job.compile`)."""
    from .job import compile as _compile

    return _compile(*args, **kwargs)


def annotate_modules(model, tag, groups):
    """Run the calls of the modules in `groups[i]` inside region `tag=i` (see `piper.frontend.modules`)."""
    from .frontend.modules import annotate_modules as _annotate_modules

    return _annotate_modules(model, tag, groups)


def param_groups(cls, *, no_decay=(), weight_decay: float = 0.0, **defaults):
    """Weight decay on every parameter but those `no_decay`'s name patterns match, as the
    `optimizer=` of `piper.compile` (see `piper.frontend.param_groups`)."""
    from .frontend.param_groups import param_groups as _param_groups

    return _param_groups(cls, no_decay=no_decay, weight_decay=weight_decay, **defaults)


def per_group(by_pattern):
    """Each parameter stepped by the optimizer of the first name pattern that takes it, as the
    `optimizer=` of `piper.compile`: `piper.per_group({"**.weight@2d": torch.optim.Muon, "*":
    torch.optim.AdamW})` (see `piper.frontend.param_groups.per_group`)."""
    from .frontend.param_groups import per_group as _per_group

    return _per_group(by_pattern)
