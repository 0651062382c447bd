"""`piper run`'s training recipe: `--config run.toml`, `--lr-schedule warmup-cosine --warmup N`,
`--weight-decay`, `--data FILE.bin --block-size N`, `--eval-every N --eval-batches K`, `--tensorboard DIR`.

    piper run job.pps --model examples/gpt.py:small_gpt --config run.toml --steps 300

    # run.toml: sections are for the reader; every key is a flag's name ('-' or '_'),
    # `model` and the strategy `script` too (`piper run --config run.toml` alone then runs)
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
import math
import re

from .diagnostics import clip, did_you_mean, error

_NOT_KEYS = {"func", "command", "overrides", "config", "_given"}
# Positional arguments a config may give too: argparse calls their action with None when absent.
_POSITIONAL = {"script"}
# A config of flags is a few hundred bytes (the docs' example: 330); a megabyte is thousands of keys.
MAX_CONFIG_BYTES = 1 << 20
# [section] headers and dotted keys only group flags (one or two levels); arrays and inline tables
# nest at most twice (`mesh = {dp = 2}`, `no_decay = ["**.bias"]`). Deeper ones are refused before
# tomllib reads them: it recurses per `[` or `{` (a RecursionError past about 1,000).
MAX_NESTING = 32
# Whole-number flags take TOML's own integers, 64-bit signed.
INT_RANGE = 2 ** 63


def apply_config(args) -> None:
    """Fill in from `args.config` (TOML) every flag the command line did not give (`model` and the
    positional `script` included); bad-config for a key that is no flag or a value of the wrong
    kind, naming the key and its line."""
    path = getattr(args, "config", None)
    if not path:
        return
    config = Config(path, _read(path))
    table = config.parse()
    given = set(getattr(args, "_given", frozenset()))
    given -= {dest for dest in _POSITIONAL if getattr(args, dest, None) is None}
    actions = _run_actions()
    known = {k for k in vars(args) if k not in _NOT_KEYS}
    for parts, value in _flatten(config, table):
        key = parts[-1]
        dest = key.replace("-", "_")
        if dest not in known:
            raise config.refusal(parts, f"`{_shown(key)}` is not a flag of piper run",
                               hint=did_you_mean(dest, sorted(known)) or "keys are the flags' names, e.g. "
                                                                          "steps, lr, batch_size, lr_schedule")
        if dest in given:
            continue                      # the command line overrides the file
        setattr(args, dest, _value(config, parts, dest, value, actions.get(dest)))
    if "set" not in given and getattr(args, "set", None):
        from .cli import _parse_sets
        from .diagnostics import UsageError

        try:
            args.overrides = _parse_sets(args.set)
        except UsageError as exc:          # `set = "x"`: what --set x says, as the file's own error
            raise config.refusal(("set",), _shown(str(exc).replace("--set takes", "`set` takes"), 200),
                               hint='write set = ["NAME=VALUE"], or NAME = VALUE under [set]') from None


def _read(path) -> str:
    """The config's text, through `user_files` (a regular file, at most MAX_CONFIG_BYTES);
    bytes that are not UTF-8 are bad-config naming their line."""
    from .user_files import read_bytes

    data = read_bytes(path, limit=MAX_CONFIG_BYTES, what="the config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error("bad-config", f"--config {clip(path, 120)}: line {line} is not UTF-8 text "
                    f"(byte {exc.start:,})", hint="save the config as UTF-8") from None


def _shown(text, limit: int = 60) -> str:
    """A key or value as a message quotes it: clipped, control characters escaped."""
    text = str(text)
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return clip(text, limit)


def _shown_value(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        return f"a {value.bit_length()}-bit number"      # str() of 4,300+ digits raises
    if isinstance(value, (dict, list)):
        return f"a {'table' if isinstance(value, dict) else 'list'}"
    return _shown(repr(value))


class Config:
    """A config file's path and text: parsed with a bound on nesting, and the line of a key found
    by scanning the text (tomllib keeps no positions)."""

    def __init__(self, path, text: str):
        self.path, self.text = path, text

    def refusal(self, parts, message: str, hint: str | None = None, line: int | None = None):
        line = line if line is not None else self.line_of(parts)
        where = f" (line {line})" if line else ""
        return error("bad-config", f"--config {clip(self.path, 120)}{where}: {message}", hint=hint)

    def parse(self) -> dict:
        import tomllib

        depth, line = _nesting(self.text)
        if depth > MAX_NESTING:
            raise self.refusal((), f"brackets nest {depth} deep; a config nests at most {MAX_NESTING}",
                             hint="write each flag as key = value under a [section]", line=line)
        try:
            return tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as exc:
            raise self.refusal((), f"not valid TOML: {_shown(exc, 200)}",
                             hint="write key = value lines under [section] headers") from None
        except (ValueError, RecursionError) as exc:        # an integer of over 4,300 digits
            digits = re.search(r"\d{4000,}", self.text)
            line = self.text.count("\n", 0, digits.start()) + 1 if digits else None
            raise self.refusal((), f"not valid TOML: {_shown(exc, 120)}", line=line,
                             hint="write numbers of at most 19 digits") from None

    def line_of(self, parts) -> int | None:
        """The line where the key `parts` (sections, then the key) is set: a line `key = ...` whose
        table header and dotted key spell `parts`, else the first that sets its last part."""
        if not parts:
            return None
        want = tuple(p.replace("-", "_") for p in parts)
        header: tuple = ()
        fallback = None
        for number, line in enumerate(self.text.split("\n"), 1):
            stripped = line.strip()
            head = re.match(r"\[\[?([^\]]*)\]", stripped)
            if head:
                header = _key_parts(head.group(1))
                continue
            if "=" not in stripped:
                continue
            lhs = _key_parts(stripped.split("=", 1)[0])
            if not lhs:
                continue
            full = header + lhs
            if full == want[:len(full)] or want == full[:len(want)]:
                return number
            if fallback is None and lhs[-1] == want[-1]:
                fallback = number
        return fallback


def _key_parts(text: str) -> tuple:
    return tuple(p.strip().strip("\"'").replace("-", "_") for p in text.split(".") if p.strip())


_SCAN = re.compile(r'"""|\'\'\'|"|\'|#|[\[\]{}]|\n')
_ENDS = {'"""': re.compile(r'(?:[^"\\]|\\.|"(?!""))*"""', re.S), "'''": re.compile(r"(?:[^']|'(?!''))*'''", re.S),
         '"': re.compile(r'(?:[^"\\\n]|\\.)*"'), "'": re.compile(r"[^'\n]*'"), "#": re.compile(r"[^\n]*")}


def _nesting(text: str) -> tuple[int, int]:
    """(the deepest nesting of `[` and `{` outside strings and comments, the line where it is)."""
    depth = deepest = 0
    line = at_line = 1
    pos = 0
    while True:
        found = _SCAN.search(text, pos)
        if found is None:
            return deepest, at_line
        token, pos = found.group(), found.end()
        if token == "\n":
            line += 1
        elif token in _ENDS:                  # skip a string or a comment whole
            end = _ENDS[token].match(text, pos)
            stop = end.end() if end else len(text)
            line += text.count("\n", pos, stop)
            pos = stop
        elif token in "[{":
            depth += 1
            if depth > deepest:
                deepest, at_line = depth, line
        else:
            depth = max(0, depth - 1)


def _flatten(config: Config, table: dict):
    """(key parts, value) of every entry, through sections ([training] steps = 200 is `steps`); a
    table under `mesh` or `set` is that flag's value. Walked without recursion, sections at most
    MAX_NESTING deep (dotted keys nest without brackets)."""
    stack = [((), table)]
    while stack:
        prefix, node = stack.pop()
        items = []
        for key, value in node.items():
            parts = prefix + (key,)
            if isinstance(value, dict) and key.replace("-", "_") not in ("mesh", "set"):
                if len(parts) >= MAX_NESTING:
                    raise config.refusal(parts, f"`{_shown('.'.join(parts[:3]))}...` nests tables "
                                       f"{len(parts)} deep; a config nests at most {MAX_NESTING}",
                                       hint="write each flag as key = value under a [section]")
                items.append((parts, value))
            else:
                yield parts, value
        stack.extend(reversed(items))


def _run_actions() -> dict:
    """dest -> the argparse action of each flag of `piper run`."""
    import argparse

    from .cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in commands.choices["run"]._actions}


_SCALAR = (str, int, float, bool)


def _value(config: Config, parts, dest, value, action):
    """A TOML value as the flag's own kind of value; bad-config naming the key and its line."""
    key = _shown(parts[-1])

    def bad(what: str, hint: str):
        return config.refusal(parts, f"`{key}` = {_shown_value(value)} {what}", hint=hint)

    if dest == "mesh" and isinstance(value, dict):
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < INT_RANGE for v in value.values()):
            raise bad("is not a table of axis sizes", f"write [{key}] dp = 2")
        return ",".join(f"{k}={v}" for k, v in value.items())
    if dest in ("set", "no_decay"):
        example = "NAME = VALUE under [set]" if dest == "set" else f'{key} = ["**.bias"]'
        if dest == "set" and isinstance(value, dict):
            if not all(isinstance(v, _SCALAR) and not (isinstance(v, int) and abs(v) >= INT_RANGE)
                       for v in value.values()):
                raise bad("holds a value that is not a string, number or true/false", f"write {example}")
            return [f"{k}={v}" for k, v in value.items()]
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise bad("is not a string or a list of strings", f"write {example}")
        return list(items)
    if isinstance(value, (dict, list)):
        raise bad("is not one value; the flag takes one", f"write {key} = <value>")
    if action is not None and action.nargs == 0:        # --shuffle, --resume
        if not isinstance(value, bool):
            raise bad("is not true or false", f"write {key} = true")
        return value
    kind = getattr(action, "type", None)
    if kind is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)                          # steps = 200.0
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("is not a whole number", f"write {key} = 200 (no quotes)")
        if abs(value) >= INT_RANGE:
            raise bad("is out of range", f"write a whole number below 2**63, e.g. {key} = 200")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(value, int) and abs(value) >= INT_RANGE):
            raise bad("is not a number", f"write {key} = 3e-4 (no quotes)")
        if not math.isfinite(value):
            raise bad("is not a finite number", f"write {key} = 3e-4")
        return float(value)
    if not isinstance(value, str):
        raise bad("is not a string", f'write {key} = "..." (in quotes)')
    if action is not None and action.choices and value not in action.choices:
        raise bad("is not one of " + ", ".join(map(repr, action.choices)),
                  did_you_mean(value, action.choices) or f"write {key} = {next(iter(action.choices))!r}")
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
