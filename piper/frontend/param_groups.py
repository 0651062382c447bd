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
from dataclasses import dataclass, field, replace

import torch

from ..diagnostics import Diagnostic, PiperWarning, clip, error
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
    # `piper.per_group`: each group's own (class, defaults); empty when every group uses cls/defaults
    makers: tuple[tuple[type, dict], ...] = ()

    def maker(self, g: int) -> tuple[type, dict]:
        return self.makers[g] if self.makers else (self.cls, self.defaults)

    def kind(self, g: int) -> str:
        """Group `g`'s update kind, "element" or "tensor" (`optim_check.update_kind`)."""
        from .optim_check import update_kind

        return update_kind(self.maker(g)[0]) or "element"

    def make(self, tensors, groups) -> torch.optim.Optimizer:
        """The optimizer over `tensors`, `groups[i]` the group of `tensors[i]` (groups with no
        tensor here are left out). Under `per_group` one optimizer per class and defaults,
        stepped together (`combined_optimizer.Combined`)."""
        from .combined_optimizer import Combined

        found: dict[int, list] = {}
        for t, g in zip(tensors, groups):
            assert g is not None, "a tensor without a parameter group under param_groups"
            found.setdefault(g, []).append(t)
        by_maker: dict = {}           # groups sharing a class and defaults share one optimizer
        for g in sorted(found):
            cls, defaults = self.maker(g)
            by_maker.setdefault((cls, repr(sorted(defaults.items()))), []).append(g)
        built = []
        for gs in by_maker.values():
            cls, defaults = self.maker(gs[0])
            built.append(cls([{"params": found[g], **self.options[g]} for g in gs], **defaults))
        # one optimizer as torch builds it; a Combined under per_group, or with none here (a
        # member that owns no parameter of a per-tensor optimizer's bucket)
        return built[0] if len(built) == 1 and not self.makers else Combined(built)


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


class PerGroup:
    """`piper.per_group({pattern: optimizer, ...})`: each parameter stepped by the optimizer of
    the first pattern that names it (see `per_group`)."""

    def __init__(self, by_pattern: dict):
        from .optim_check import check_optimizer, optimizer_class

        if not isinstance(by_pattern, dict) or not by_pattern:
            raise error("bad-param-groups", "piper.per_group takes a non-empty dict {pattern: optimizer}",
                        hint='e.g. piper.per_group({"**.weight@2d": torch.optim.Muon, "*": torch.optim.AdamW})')
        self.by_pattern = []
        for key, value in by_pattern.items():
            if not isinstance(key, str):
                raise error("bad-param-groups", f"per_group's key {key!r} is not a pattern",
                            hint='keys are parameter-name patterns such as "**.weight@2d", or "*" for the rest')
            pattern, ndim = _split_dims(key)
            if not isinstance(value, ParamGroups) and optimizer_class(value) is None:
                raise error("bad-param-groups", f"per_group's `{key}` gives {value!r}; each value is an optimizer "
                            "class, a functools.partial of one, or piper.param_groups(...) over one",
                            hint="e.g. functools.partial(torch.optim.Muon, lr=0.02)")
            check_optimizer(value.cls if isinstance(value, ParamGroups) else value)
            self.by_pattern.append((key, pattern, ndim, value))

    def resolve(self, named) -> Grouped:
        """The `Grouped` record over `named` ((name, parameter) pairs)."""
        names = [n for n, _ in named]
        ndim = {n: p.dim() for n, p in named}
        left = list(names)
        options, makers, of = [], [], {}
        for key, pattern, dims, value in self.by_pattern:
            found = set(left if pattern == "*" else match_names(pattern, names))
            taken = [n for n in left if n in found and (dims is None or ndim[n] == dims)]
            if not taken:
                warnings.warn(PiperWarning(Diagnostic(
                    "optimizer-pattern-unmatched", f"per_group's pattern `{key}` names no parameter that an "
                    "earlier pattern did not already take, so its optimizer steps nothing", "warning",
                    hint="patterns are model.named_parameters() names with an optional @2d (number of "
                         "dimensions), e.g. " + ", ".join(names[:3]))), stacklevel=3)
                continue
            left = [n for n in left if n not in taken]
            subset = [(n, p) for n, p in named if n in taken]
            if isinstance(value, ParamGroups):
                cls, defaults, groups = value.cls, dict(value.defaults), value(subset)
            else:
                cls, defaults = _partial_parts(value)
                groups = [{"params": [p for _, p in subset]}]
            part_options, part_of = _assign(groups, subset)
            for name, g in part_of.items():
                of[name] = g + len(options)
            options += part_options
            makers += [(cls, defaults)] * len(part_options)
        if left:
            raise error("param-not-in-group", f"{len(left)} parameter(s) match no pattern of per_group: "
                        + ", ".join(f"`{n}`" for n in left[:5]) + (" ..." if len(left) > 5 else ""),
                        hint='add a last pattern "*" for the rest, e.g. "*": torch.optim.AdamW')
        grouped = Grouped(makers[0][0], makers[0][1], tuple(options), of, tuple(makers))
        _try_make(grouped, named)
        return grouped

    def build(self, named) -> torch.optim.Optimizer:
        """The optimizer one device builds over `named` ((name, parameter) pairs): the reference
        a job with this `optimizer=` is equal to (`piper.testing.single_device`).

            opt = per.build(model.named_parameters())
        """
        named = list(named)
        grouped = self.resolve(named)
        return grouped.make([p for _, p in named], [grouped.of[n] for n, _ in named])

    def __repr__(self) -> str:
        return "per_group({" + ", ".join(f"{k!r}: {v!r}" for k, _, _, v in self.by_pattern) + "})"


def per_group(by_pattern: dict) -> PerGroup:
    """Different optimizers for different parameters, in one job, for
    `piper.compile(..., optimizer=...)`: each parameter goes to the first pattern that names it.

        piper.per_group({"**.weight@2d": functools.partial(torch.optim.Muon, lr=0.02),
                         "*": piper.param_groups(torch.optim.AdamW, lr=3e-4, no_decay="**.bias")})

    A pattern is a `model.named_parameters()` name pattern as in `param_groups` (`*` within one
    dotted part, `**` across parts), with an optional suffix `@Nd` (`@2d`: only the parameters
    with 2 dimensions; `@matrix` means `@2d`). `"*"` alone is every parameter no earlier
    pattern took. A value is an optimizer class, a `functools.partial` of one, or
    `piper.param_groups(...)` over one. A parameter no pattern names is an error
    (param-not-in-group); a pattern that takes none is a warning (optimizer-pattern-unmatched).
    Each optimizer keeps its state under torch's names (Muon's `momentum_buffer`, AdamW's
    `exp_avg`...) per parameter, in checkpoints too.
    """
    return PerGroup(by_pattern)


def _split_dims(key: str) -> tuple[str, int | None]:
    """("**.weight", 2) from "**.weight@2d"; (key, None) without a suffix."""
    if "@" not in key:
        return key, None
    pattern, _, suffix = key.rpartition("@")
    if suffix == "matrix":
        return pattern, 2
    # ASCII digits, at most 2 (no tensor has 100 dimensions): int() of 5,000 digits or of `²` raises.
    number = suffix[:-1]
    if suffix.endswith("d") and 1 <= len(number) <= 2 and number.isascii() and number.isdigit():
        return pattern, int(number)
    raise error("bad-param-groups", f"per_group's pattern `{clip(key)}` ends in `@{clip(suffix)}`, which is not a number of "
                "dimensions", hint="write @2d for matrices (or @matrix), @1d for vectors")


def _partial_parts(value) -> tuple[type, dict]:
    """(class, keyword defaults) of a class or a (nested) functools.partial of one."""
    keywords: dict = {}
    while isinstance(value, functools.partial):
        if value.args:
            raise error("bad-param-groups", f"{value!r} passes positional arguments; per_group builds each "
                        "optimizer from its parameter groups and keywords", hint="pass lr=... as a keyword")
        keywords = {**value.keywords, **keywords}
        value = value.func
    return value, keywords


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
    if isinstance(optimizer, PerGroup):
        return optimizer.resolve(list(model.named_parameters()))
    if optimizer is None or isinstance(optimizer, (str, torch.optim.Optimizer)) or not callable(optimizer):
        return None
    if _is_flat(optimizer):
        _check_whole(optimizer, model)
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
    _try_make(grouped, named)
    return grouped


def _try_make(grouped: Grouped, named) -> None:
    """Build the optimizer once here, as every worker will, over one meta tensor per group of
    the shape of a parameter in it (Muon takes only matrices): a wrong option is a
    compile-time error."""
    shape_of = {n: tuple(p.shape) for n, p in named}
    first: dict[int, tuple] = {}
    for name, g in grouped.of.items():
        first.setdefault(g, shape_of[name])
    groups = sorted(first)
    try:
        grouped.make([torch.empty(first[g], device="meta", requires_grad=True) for g in groups], groups)
    except Exception as exc:  # noqa: BLE001 - the user's options, reported with torch's words
        names = sorted({grouped.maker(g)[0].__name__ for g in groups})
        raise error("bad-param-groups", f"{', '.join(names)} refuses these groups: {type(exc).__name__}: {exc}",
                    hint="give each group only options the optimizer takes (lr, weight_decay, betas...), and a "
                         "matrix-only optimizer such as Muon only 2-D parameters (piper.per_group's `@2d`)") from None


def _check_whole(optimizer, model: torch.nn.Module) -> None:
    """A per-tensor optimizer class over every parameter: built once over meta tensors of the
    parameters' shapes, so Muon given a bias is refused here, not on every worker."""
    from .optim_check import optimizer_class, update_kind

    cls = optimizer_class(optimizer)
    if cls is None or update_kind(cls) != "tensor":
        return
    for name, p in model.named_parameters():
        try:
            optimizer([torch.empty(p.shape, device="meta", requires_grad=True)])
        except Exception as exc:  # noqa: BLE001 - the optimizer's own words
            raise error("bad-optimizer", f"{cls.__name__} refuses parameter `{name}` of shape {tuple(p.shape)}: "
                        f"{type(exc).__name__}: {exc}",
                        hint=f"give {cls.__name__} only the parameters it takes and the rest to another optimizer: "
                             f"optimizer=piper.per_group({{\"**@2d\": {cls.__name__}_fn, \"*\": adamw_fn}})") from None


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
    return replace(grouped, of=of)


def whole_params(optimizer, names) -> frozenset[str]:
    """The parameter names (of `names`) whose optimizer updates a tensor at a time
    (`optim_check.update_kind` "tensor"): all of them for a flat Muon, a group's under `per_group`."""
    from .optim_check import kind_of

    if isinstance(optimizer, Grouped):
        kinds = {g: optimizer.kind(g) for g in range(len(optimizer.options))}
        return frozenset(n for n in names if n in optimizer.of and kinds[optimizer.of[n]] == "tensor")
    if optimizer is None or not callable(optimizer):
        return frozenset()
    return frozenset(names) if kind_of(optimizer) == "tensor" else frozenset()
