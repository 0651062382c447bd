"""Parameter groups for `piper.compile(..., optimizer=...)`: torch-style groups chosen by the
model's parameter names, checked at compile time.

    optimizer=piper.param_groups(torch.optim.AdamW, lr=3e-4, weight_decay=0.1,
                                 no_decay=("**.bias", "**.ln_*.weight", "wte.weight"))
    optimizer=lambda named: [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]

A function of the named parameters (a list of `(name, parameter)` pairs, as
`model.named_parameters()` gives) returns either the groups (then AdamW with
lr 1e-3 unless a group says otherwise) or a torch optimizer built on them,
whose class and defaults every device then uses. `resolve` turns either into
the `Grouped` record the workers build from.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch

from ..diagnostics import Diagnostic, PiperWarning, error
from .modules import match_names


@dataclass(frozen=True)
class Grouped:
    """Parameter groups as the workers build them (`runtime.state.optimizers.build`).

        Grouped(torch.optim.AdamW, {"lr": 3e-4}, ({"weight_decay": 0.1}, {"weight_decay": 0.0}),
                {"wte.weight": 1, "blocks.0.mlp.0.weight": 0, ...})
    """

    cls: type
    defaults: dict
    options: tuple[dict, ...]                  # per group, its options other than "params"
    of: dict[str, int] = field(default_factory=dict)     # parameter name -> its group

    def make(self, tensors, groups) -> torch.optim.Optimizer:
        """The optimizer over `tensors`, `groups[i]` the group of `tensors[i]` (groups with no
        tensor here are left out)."""
        found: dict[int, list] = {}
        for t, g in zip(tensors, groups):
            assert g is not None, "a tensor without a parameter group under param_groups"
            found.setdefault(g, []).append(t)
        return self.cls([{"params": found[g], **self.options[g]} for g in sorted(found)], **self.defaults)


DEFAULT = (torch.optim.AdamW, {"lr": 1e-3})     # a bare list of groups: Piper's default optimizer


class ParamGroups:
    """`piper.param_groups(cls, lr=..., weight_decay=..., no_decay=patterns, **defaults)`: two
    groups, weight decay on every parameter but those a `no_decay` pattern names (`*` within
    a dotted part, `**` across parts; a leading `**.` matches no part too)."""

    def __init__(self, cls, *, no_decay=(), weight_decay: float = 0.0, **defaults):
        if isinstance(no_decay, str):
            no_decay = (no_decay,)
        self.cls = cls
        self.no_decay = tuple(no_decay)
        self.weight_decay = weight_decay
        self.defaults = {**defaults, "weight_decay": weight_decay}

    def __call__(self, named) -> list[dict]:
        named = list(named)
        names = [n for n, _ in named]
        exempt: set[str] = set()
        for pattern in self.no_decay:
            found = match_names(pattern, names)
            if not found:
                warnings.warn(PiperWarning(Diagnostic(
                    "no-decay-unmatched", f"the no_decay pattern `{pattern}` matches no parameter of the model, "
                    "so it exempts nothing from weight decay", "warning",
                    hint="patterns are model.named_parameters() names, e.g. "
                         + ", ".join(names[:3]) + "; `**.bias` is every bias")), stacklevel=3)
            exempt.update(found)
        decay = [p for n, p in named if n not in exempt]
        rest = [p for n, p in named if n in exempt]
        return [g for g in ({"params": decay, "weight_decay": self.weight_decay},
                            {"params": rest, "weight_decay": 0.0}) if g["params"]]

    def __repr__(self) -> str:
        return f"param_groups({self.cls.__name__}, {self.defaults}, no_decay={self.no_decay})"


def param_groups(cls, *, no_decay=(), weight_decay: float = 0.0, **defaults) -> ParamGroups:
    """Weight decay `weight_decay` on every parameter except those `no_decay`'s patterns name,
    for `piper.compile(..., optimizer=...)`; `defaults` (lr, betas...) go to `cls`.

        piper.param_groups(torch.optim.AdamW, lr=3e-4, weight_decay=0.1,
                           no_decay=("**.bias", "**.ln_*.weight", "wte.weight"))
    """
    return ParamGroups(cls, no_decay=no_decay, weight_decay=weight_decay, **defaults)


def _is_flat(optimizer) -> bool:
    """An optimizer class (or a partial of one): it takes a list of tensors, no groups."""
    target = optimizer
    while isinstance(target, functools.partial):
        target = target.func
    return isinstance(target, type)


def resolve(optimizer, model: torch.nn.Module):
    """`(Grouped over model.named_parameters() names, or None for a flat optimizer)`.

    A function that is not a groups function (it raises, or returns something else, given
    the named parameters) is left to `optim_check.check_optimizer` as a flat optimizer; so is
    one that handed the (name, parameter) pairs to a torch optimizer as they are (torch takes
    them as one group: `lambda params: SGD(params, lr=0.1)`)."""
    if optimizer is None or isinstance(optimizer, (str, torch.optim.Optimizer)) or _is_flat(optimizer) \
            or not callable(optimizer):
        return None
    named = list(model.named_parameters())
    if isinstance(optimizer, ParamGroups):
        cls, defaults, groups = optimizer.cls, dict(optimizer.defaults), optimizer(named)
    else:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made = optimizer(named)
        except Exception:  # noqa: BLE001 - a flat optimizer given (name, tensor) pairs: not groups
            return None
        if isinstance(made, torch.optim.Optimizer) and not any("param_names" in g for g in made.param_groups):
            cls, defaults = type(made), _accepted(type(made), made.defaults)
            groups = [dict(g) for g in made.param_groups]
            for g in groups:        # the options torch filled in from the defaults are the defaults'
                for key in [k for k in g if k != "params" and k in made.defaults and g[k] is made.defaults[k]]:
                    del g[key]
                g.pop("initial_lr", None)
        elif isinstance(made, (list, tuple)) and made and all(isinstance(g, dict) for g in made):
            cls, defaults = DEFAULT[0], dict(DEFAULT[1])
            groups = list(made)
        else:
            return None
    grouped = Grouped(cls, defaults, *_assign(groups, named))
    try:            # what every worker will do, once here: a wrong option is a compile-time error
        grouped.make([torch.zeros(1, requires_grad=True) for _ in grouped.options], range(len(grouped.options)))
    except Exception as exc:  # noqa: BLE001 - the user's options, reported with torch's words
        raise error("bad-param-groups", f"{cls.__name__} refuses these groups: {type(exc).__name__}: {exc}",
                    hint="give each group only options the optimizer takes (lr, weight_decay, betas...)") from None
    return grouped


def _accepted(cls, defaults: dict) -> dict:
    """The `defaults` that `cls`'s constructor takes (AdamW's defaults hold a flag that it sets itself)."""
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return dict(defaults)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _assign(groups: list[dict], named) -> tuple[tuple[dict, ...], dict[str, int]]:
    """(each group's options, parameter name -> its group), checking every parameter is in
    exactly one group."""
    name_of = {id(p): n for n, p in named}
    of: dict[str, int] = {}
    options = []
    for g, group in enumerate(groups):
        if "params" not in group:
            raise error("bad-param-groups", f"parameter group {g} has no \"params\"",
                        hint='each group is a dict {"params": [tensors], ...options}, as torch.optim takes')
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if not isinstance(p, torch.Tensor) or id(p) not in name_of:
                what = type(p).__name__ if not isinstance(p, torch.Tensor) else f"a tensor of shape {tuple(p.shape)}"
                raise error("bad-param-groups", f"parameter group {g} holds {what}, which is not one of the "
                            "model's parameters", hint="build the groups from the (name, parameter) pairs "
                            "the function is given, e.g. [p for n, p in named if p.dim() >= 2]")
            name = name_of[id(p)]
            if name in of and of[name] != g:
                raise error("param-in-two-groups", f"parameter `{name}` is in group {of[name]} and group {g}",
                            notes=(f"group {of[name]}: {_options(groups[of[name]])}", f"group {g}: {_options(group)}"),
                            hint="put each parameter in exactly one group (torch.optim refuses the same)")
            of[name] = g
        options.append({k: v for k, v in group.items() if k != "params"})
    missing = [n for n, _ in named if n not in of]
    if missing:
        raise error("param-not-in-group", f"{len(missing)} parameter(s) are in no group: "
                    + ", ".join(f"`{n}`" for n in missing[:5]) + (" ..." if len(missing) > 5 else ""),
                    hint="every parameter trains, so each needs a group; to freeze some, give their group lr=0.0")
    return tuple(options), of


def _options(group: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in group.items() if k != "params") or "no options of its own"


def for_program(grouped: Grouped, model: torch.nn.Module, program_params) -> Grouped:
    """The same groups keyed by the captured program's parameter names (one name per tensor:
    a tied weight under the name capture kept)."""
    names = {id(p): n for n, p in model.named_parameters()}
    of = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name in program_params and id(t) in names:
            of[name] = grouped.of[names[id(t)]]
    return Grouped(grouped.cls, grouped.defaults, grouped.options, of)
