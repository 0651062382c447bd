"""`piper run SCRIPT --model path.py:Factory [--mesh ...] [--set ...] [--steps N]
[--checkpoint-dir DIR --checkpoint-every N] [--resume]`: train a model with a strategy
script on a local Ray cluster."""
from __future__ import annotations

import itertools

from rich.console import Console

from . import checkpoint
from .job import compile
from .models import example_batch, load_model


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
    model, module = load_model(args.model)
    batch_size = int(getattr(args, "batch_size", None) or 16)
    steps = args.steps or 20
    if hasattr(module, "training_batches"):
        stream = iter(module.training_batches(batch_size))
    else:
        stream = (example_batch(module, batch_size) for _ in itertools.count())
    first = next(stream)
    with compile(model, first, strategy=args.script, mesh=args.mesh, overrides=args.overrides or None) as job:
        console.print(f"[bold]piper run[/] {args.script} on mesh {job.mesh} ({job.mesh.world_size} workers)")
        from .train import fit

        tokens = first[0].numel()
        data = itertools.chain([first], stream)
        start = checkpoint.resume(job, directory, data, console) if getattr(args, "resume", False) else 0
        if start >= steps:
            console.print(f"the checkpoint is at step {start}: nothing left of {steps} steps")
            return 0
        every = getattr(args, "checkpoint_every", None)
        stepper = checkpoint.Every(job, directory, every) if every else job
        losses = fit(stepper, data, steps - start, tokens_per_batch=tokens, console=console)
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {start + 1}-{steps}")
    return 0
