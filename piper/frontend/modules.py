"""`piper.annotate_modules`: regions named by module path, for models you did not write.

    piper.annotate_modules(model, "PP", [
        ["m.model.embed_tokens", "m.model.layers.0", "m.model.layers.1"],
        ["m.model.layers.2", "m.model.layers.3", "m.model.norm", "m.lm_head"],
    ])

Each listed module's calls run inside region `PP=<its group's index>`, as if
its forward were wrapped in `with piper.annotate("PP")`; nothing else about
the model changes, and outside capture the wrapper only sets a dictionary
entry, so the model trains the same without Piper. Call it again with another
tag to nest regions (a `PP` region per stage, an `L` region per block).
"""
from __future__ import annotations

import types

import torch
import torch.fx.traceback as fx_traceback

from ..diagnostics import did_you_mean, error
from .name_patterns import match_names   # the one matcher; its old home, imported from here too

_ATTR = "_piper_regions"          # module -> {tag: group index}, read by the forward wrapper
_GROUPS = "_piper_module_groups"  # root model -> {tag: [[names]]}, read by capture's order check


def annotate_modules(model: torch.nn.Module, tag: str, groups) -> torch.nn.Module:
    """Run the calls of the modules in `groups[i]` inside region `tag=i`; returns `model`.

    Names are those of `model.named_modules()`; `*` matches within one dotted
    part (`"m.model.layers.*"` is every layer, not their submodules) and `**`
    across parts. Calling again with the same tag replaces its groups.

        piper.annotate_modules(model, "L", [[f"blocks.{i}"] for i in range(4)])
    """
    if not isinstance(model, torch.nn.Module):
        raise error("bad-model", f"annotate_modules needs a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(tag, str) or not tag.isidentifier():
        raise error("bad-annotation", f"the region tag {tag!r} is not a name",
                    hint='use a short name such as "PP" (stages) or "L" (layers)')
    if isinstance(groups, (str, bytes)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise error("bad-annotation", "groups must be a list of lists of module names",
                    hint='e.g. [["embed", "blocks.0"], ["blocks.1", "head"]]: one list per region')
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    chosen: dict[str, int] = {}
    for index, group in enumerate(groups):
        for pattern in group:
            found = _match(pattern, names)
            if not found:
                raise error("unknown-module", f"no module named `{pattern}` in the model "
                            f"({type(model).__name__})", hint=did_you_mean(pattern, names)
                            or "names are those of model.named_modules(), e.g. " + ", ".join(names[:3]))
            for name in found:
                if name in chosen and chosen[name] != index:
                    raise _overlap(tag, name, chosen[name], index, groups)
                chosen[name] = index
    for name, index in chosen.items():     # a module inside another's region must be in the same group
        parent = name
        while "." in parent:
            parent = parent.rpartition(".")[0]
            if parent in chosen and chosen[parent] != index:
                raise _overlap(tag, name, chosen[parent], index, groups, parent)
    for module in modules.values():        # calling again with a tag replaces its groups
        getattr(module, _ATTR, {}).pop(tag, None)
    for name, index in chosen.items():
        _wrap(modules[name])[tag] = index
    registry = dict(getattr(model, _GROUPS, {}))
    registry[tag] = [list(g) for g in groups]
    object.__setattr__(model, _GROUPS, registry)
    return model


_match = match_names


def _overlap(tag: str, name: str, first: int, second: int, groups, via: str | None = None):
    inside = f" (it is inside `{via}`)" if via else ""
    return error("overlapping-groups", f"module `{name}` is in group {first} and group {second} of "
                 f"`{tag}`{inside}", notes=(f"group {first}: {', '.join(groups[first])}",
                                            f"group {second}: {', '.join(groups[second])}"),
                 hint="each module runs in one region per tag: list it (and its parent) in one group only; "
                      "nest regions by calling annotate_modules again with another tag")


def _wrap(module: torch.nn.Module) -> dict:
    """Give `module` a forward that enters its regions; returns its {tag: index}."""
    regions = getattr(module, _ATTR, None)
    if regions is None:
        regions = {}
        object.__setattr__(module, _ATTR, regions)
        inner = module.__dict__.get("forward")           # a forward set on the instance already
        object.__setattr__(module, "_piper_inner_forward", inner)
        # A bound method (not a closure): deepcopy rebinds it to the copy, as capture needs.
        object.__setattr__(module, "forward", types.MethodType(_annotated_forward, module))
    return regions


def set_forward(module: torch.nn.Module, fn) -> None:
    """Make `fn(module, ...)` what `module` runs, inside any regions `annotate_modules` set on it
    (capture's meta copy: `tensor_parallel`)."""
    bound = types.MethodType(fn, module)
    object.__setattr__(module, "_piper_inner_forward" if _ATTR in module.__dict__ else "forward", bound)


def forward_of(module: torch.nn.Module):
    """What `module` runs inside its regions: a forward set on the instance, else its class's."""
    inner = module.__dict__.get("_piper_inner_forward" if _ATTR in module.__dict__ else "forward")
    return inner or types.MethodType(type(module).forward, module)


def _annotated_forward(self, *args, **kwargs):
    inner = self.__dict__.get("_piper_inner_forward")
    regions = self.__dict__.get(_ATTR) or {}
    with fx_traceback.annotate(dict(regions)):
        if inner is not None:
            return inner(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)


def module_groups(model: torch.nn.Module) -> dict[str, list[list[str]]]:
    """The groups `annotate_modules` set on `model`, by tag (for capture's diagnostics)."""
    return dict(getattr(model, _GROUPS, {}))
