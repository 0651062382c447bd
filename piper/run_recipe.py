"""`piper run`'s training recipe: `--config run.toml`, `--lr-schedule warmup-cosine --warmup N`,
`--weight-decay`, `--data FILE.bin --block-size N`, `--eval-every N --eval-batches K`, `--tensorboard DIR`.

    piper run job.pps --model examples/gpt.py:small_gpt --config run.toml --steps 300

    # run.toml: sections are for the reader; every key is a flag's name ('-' or '_')
    [training]
    steps = 200
    batch_size = 16
    lr = 3e-4
    weight_decay = 0.1
    lr_schedule = "warmup-cosine"
    warmup = 20
    [data]
    data = "train.bin"
    val_data = "val.bin"
    block_size = 64
    [eval]
    eval_every = 50
    eval_batches = 4
    [metrics]
    tensorboard = "runs/gpt"
"""
from __future__ import annotations

import functools

from .diagnostics import did_you_mean, error

_NOT_KEYS = {"func", "command", "overrides", "config", "_given"}


def apply_config(args) -> None:
    """Fill in from `args.config` (TOML) every flag the command line did not give; bad-config
    for a key that is no flag or a value of the wrong kind."""
    path = getattr(args, "config", None)
    if not path:
        return
    import tomllib

    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise error("file-not-found", f"--config {path}: no such file",
                    hint="pass a TOML file of flags, e.g. [training] steps = 200") from None
    except tomllib.TOMLDecodeError as exc:
        raise error("bad-config", f"--config {path} is not valid TOML: {exc}",
                    hint="write key = value lines under [section] headers") from None
    given = getattr(args, "_given", frozenset())
    actions = _run_actions()
    known = {k for k in vars(args) if k not in _NOT_KEYS}
    for key, value in _flatten(table):
        dest = key.replace("-", "_")
        if dest not in known:
            raise error("bad-config", f"--config {path}: `{key}` is not a flag of piper run",
                        hint=did_you_mean(dest, sorted(known)) or "keys are the flags' names, e.g. steps, lr, "
                                                                  "batch_size, lr_schedule")
        if dest in given:
            continue                      # the command line overrides the file
        setattr(args, dest, _value(path, key, dest, value, actions.get(dest)))
    if "set" not in given and getattr(args, "set", None):
        from .cli import _parse_sets

        args.overrides = _parse_sets(args.set)


def _flatten(table: dict, prefix=()):
    """(key, value) of every entry, through sections ([training] steps = 200 is `steps`); a table
    under `mesh` or `set` is that flag's value."""
    for key, value in table.items():
        if isinstance(value, dict) and key.replace("-", "_") not in ("mesh", "set"):
            yield from _flatten(value, prefix + (key,))
        else:
            yield key, value


def _run_actions() -> dict:
    """dest -> the argparse action of each flag of `piper run`."""
    import argparse

    from .cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in commands.choices["run"]._actions}


def _value(path, key, dest, value, action):
    """A TOML value as the flag's own kind of value."""
    if dest == "mesh" and isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if dest in ("set", "no_decay"):
        if isinstance(value, dict):
            return [f"{k}={v}" for k, v in value.items()]
        return [value] if isinstance(value, str) else list(value)
    if isinstance(value, (dict, list)):
        raise error("bad-config", f"--config {path}: `{key}` is a {type(value).__name__}; the flag takes one value",
                    hint=f"write {key} = <value>")
    if action is not None and action.nargs == 0:        # --shuffle, --resume
        if not isinstance(value, bool):
            raise error("bad-config", f"--config {path}: `{key}` = {value!r} is not true or false",
                        hint=f"write {key} = true")
        return value
    kind = getattr(action, "type", None)
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                 or kind is int and value != int(value)):
        what, example = ("a whole number", "200") if kind is int else ("a number", "3e-4")
        raise error("bad-config", f"--config {path}: `{key}` = {value!r} is not {what}",
                    hint=f"write {key} = {example} (no quotes)")
    if kind in (int, float):
        value = kind(value)
    elif not isinstance(value, str):
        value = str(value)
    if action is not None and action.choices and value not in action.choices:
        raise error("bad-config", f"--config {path}: `{key}` = {value!r} is not one of "
                    + ", ".join(map(repr, action.choices)), hint=did_you_mean(value, action.choices))
    return value


def check(args) -> str | None:
    """What is wrong with the recipe's flags together, or None (printed as a usage error)."""
    from .run_args import LR_SCHEDULES

    if args.lr_schedule not in LR_SCHEDULES:
        return f"--lr-schedule {args.lr_schedule} is not one of {', '.join(LR_SCHEDULES)}"
    if args.warmup < 0:
        return f"--warmup {args.warmup} is not a number of steps (0 or more)"
    if (args.data or args.val_data) and not args.block_size:
        return "--data/--val-data need --block-size N, the tokens per sample (the model's context length)"
    if args.eval_every is not None and (args.eval_every < 1 or not args.val_data):
        return ("--eval-every N needs N >= 1 and --val-data FILE.bin, the token file it evaluates on"
                if args.eval_every >= 1 else f"--eval-every {args.eval_every} is not a positive number of steps")
    if args.eval_batches < 1:
        return f"--eval-batches {args.eval_batches} is not a positive number of batches"
    if args.no_decay and args.weight_decay is None:
        return "--no-decay names parameters exempt from --weight-decay: give --weight-decay W too"
    return None


def optimizer(args, base):
    """`--weight-decay` as parameter groups of the optimizer `base` (a partial of a torch class with
    its lr), else `base` itself."""
    if args.weight_decay is None:
        return base
    from .frontend.param_groups import param_groups

    if args.no_decay:
        return param_groups(base.func, weight_decay=args.weight_decay, no_decay=tuple(args.no_decay), **base.keywords)
    return functools.partial(_by_dimension, base.func, args.weight_decay, base.keywords)


def _by_dimension(cls, weight_decay: float, defaults: dict, named):
    """nanoGPT's rule: decay on parameters of two or more dimensions (matrices, embeddings), none
    on the rest (biases, norms)."""
    named = list(named)
    return cls([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], **defaults)


def schedule(args, steps: int):
    """`--lr-schedule` as `piper.compile`'s lr_schedule= (None: constant)."""
    if args.lr_schedule == "constant":
        return None
    from .frontend.lr_schedules import warmup_cosine

    return warmup_cosine(min(args.warmup, steps), steps, args.min_lr_ratio)


def datasets(args):
    """(train, val) token files of `--data` / `--val-data` (None where not given)."""
    from .data import TokenFile

    train = TokenFile(args.data, args.block_size) if args.data else None
    val = TokenFile(args.val_data, args.block_size) if args.val_data else None
    return train, val


class Observer:
    """After each step: `--eval-every`'s evaluation and `--tensorboard`'s scalars."""

    def __init__(self, job, args, console, base_lr: float):
        self.job, self.console, self.base_lr = job, console, base_lr
        self.every, self.batches = args.eval_every, args.eval_batches
        self.writer = None
        if args.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise error("bad-flag", "--tensorboard needs the tensorboard package, which is not installed",
                            hint="pip install tensorboard (or leave out --tensorboard; --metrics FILE.jsonl "
                                 "writes the same numbers)") from None
            self.writer = SummaryWriter(args.tensorboard)
        self.evals: list[tuple[int, float]] = []

    def __call__(self, step: int, loss: float, seconds: float, per_s: float, unit: str, metrics=None) -> None:
        """`step` is the number of optimizer steps done (1 after the first). `metrics`, a step of
        `job.train` (its workers still stepping, so nothing is asked of them here): the gradient norm
        comes with it, and the evaluation runs at the end of its stretch (`evaluate`)."""
        job = self.job
        scale = job.lr_schedule(step - 1) if job.lr_schedule is not None else 1.0
        if self.writer is not None:
            self.writer.add_scalar("train/loss", loss, step)
            self.writer.add_scalar("train/lr", self.base_lr * scale, step)
            self.writer.add_scalar("train/step_s", seconds, step)
            self.writer.add_scalar(f"train/{'tokens' if unit == 'tok' else unit}_per_s", per_s, step)
            norm = metrics["grad_norm"] if metrics is not None else job.grad_norm()
            if norm is not None:
                self.writer.add_scalar("train/grad_norm", norm, step)
        if metrics is None and self.every and step % self.every == 0:
            self.evaluate(step)
        elif self.writer is not None:
            self.writer.flush()

    def evaluate(self, step: int) -> None:
        """`--eval-every`'s evaluation after step `step`, said and written."""
        val = self.job.evaluate(batches=self.batches)
        self.evals.append((step, val))
        self.console.log(f"step {step:3d}  eval loss {val:.4f} ({self.batches} batch(es))")
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", val, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
