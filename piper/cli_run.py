"""`piper run SCRIPT --model path.py:Factory [--steps N] [--batch-size N] [--optimizer adamw --lr 1e-3]
[--mesh ...] [--set ...] [--address ADDR] [--device cpu|cuda] [--save weights.pt]
[--checkpoint-dir DIR --checkpoint-every N] [--resume]`:
train a model with a strategy script on a Ray cluster (a local one unless --address).

The model's file provides the data: `training_batches(batch_size)`, an iterator of
input tuples, or else `example_batch(batch_size)`, which is then trained on again
and again (said with a warning). The flags are defined in `piper/run_args.py`.
"""
from __future__ import annotations

import functools
import itertools

import torch
from rich.console import Console

from . import checkpoint
from .diagnostics import error
from .job import compile
from .models import example_batch, load_model

OPTIMIZER_CLASSES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad"}


def make_optimizer(name: str, lr: float):
    """`--optimizer adamw --lr 1e-3` as the callable piper.compile takes."""
    if not lr > 0:
        raise error("bad-optimizer", f"--lr {lr} is not a positive learning rate", hint="e.g. --lr 1e-3")
    return functools.partial(getattr(torch.optim, OPTIMIZER_CLASSES[name]), lr=lr)


def training_data(module, batch_size: int, console: Console):
    """An endless iterator of batches from the model's file, and whether it repeats one batch."""
    if hasattr(module, "training_batches"):
        return iter(module.training_batches(batch_size)), False
    first = example_batch(module, batch_size)
    console.print(f"[bold yellow]warning[/]: {module.__file__} defines no `training_batches(batch_size)`, so "
                  "this trains on one batch from `example_batch` again and again: the loss falls by memorising "
                  "it. Add `def training_batches(batch_size):` yielding (inputs..., targets) to train on data.",
                  markup=True, highlight=False)
    return itertools.repeat(first), True


def throughput(batch) -> tuple[int, str]:
    """What a step processes: tokens when the first input holds token ids, else samples."""
    first = batch[0]
    if isinstance(first, torch.Tensor) and not first.dtype.is_floating_point and first.dim() >= 2 \
            and first.dtype != torch.bool:
        return first.numel(), "tok"
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1, "samples"


def run(args) -> int:
    console = Console(stderr=True)
    if not args.model:
        console.print("piper run: error: --model PATH.py:FACTORY is required (e.g. examples/gpt.py:small_gpt)")
        return 2
    problem = checkpoint.check_run_flags(args)
    if problem:
        console.print(f"piper run: error: {problem}")
        return 2
    directory = getattr(args, "checkpoint_dir", None)
    steps = 20 if args.steps is None else args.steps
    batch_size = 16 if getattr(args, "batch_size", None) is None else args.batch_size
    if steps < 1 or batch_size < 1:
        console.print("piper run: error: --steps and --batch-size take whole numbers of at least 1")
        return 2
    torch.manual_seed(getattr(args, "seed", 0) or 0)
    model, module = load_model(args.model)
    stream, _ = training_data(module, batch_size, console)
    first = tuple(next(stream))
    count, unit = throughput(first)
    optimizer = make_optimizer(getattr(args, "optimizer", "adamw"), getattr(args, "lr", 1e-3))
    params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]piper run[/] {args.script}: {type(model).__name__}, {params:,} parameters, "
                  f"batch {batch_size}, {steps} steps", highlight=False)
    with console.status("capturing the model, checking the plans, starting the workers on Ray "
                        "(a minute on a busy machine)..."):
        job = compile(model, first, strategy=args.script, mesh=args.mesh, optimizer=optimizer,
                      overrides=args.overrides or None, address=getattr(args, "address", None),
                      device=getattr(args, "device", "auto"))
    with job:
        console.print(f"mesh {job.mesh}: {job.mesh.world_size} workers ready ({job.device})", highlight=False)
        from .train import fit

        data = itertools.chain([first], stream)
        start = checkpoint.resume(job, directory, data, console) if getattr(args, "resume", False) else 0
        if start >= steps:
            console.print(f"the checkpoint is at step {start}: nothing left of {steps} steps")
            return 0
        every = getattr(args, "checkpoint_every", None)
        stepper = checkpoint.Every(job, directory, every) if every else job
        losses = fit(stepper, data, steps - start, tokens_per_batch=count, unit=unit, console=console,
                     metrics=getattr(args, "metrics", None))
        if getattr(args, "trace", None):
            console.print(f"trace of the last steps: {job.trace(args.trace)} (open it in ui.perfetto.dev)")
        if getattr(args, "save", None):
            torch.save(job.state_dict(), args.save)
            console.print(f"saved the trained weights to {args.save} (load with "
                          f"model.load_state_dict(torch.load({args.save!r})))", highlight=False)
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {start + 1}-{steps}", highlight=False)
    return 0
