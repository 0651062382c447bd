"""`piper run SCRIPT --model path.py:Factory [--mesh ...] [--set ...] [--steps N]`:
train a model with a strategy script on a local Ray cluster."""
from __future__ import annotations

import itertools

from rich.console import Console

from .job import compile
from .models import example_batch, load_model


def run(args) -> int:
    console = Console(stderr=True)
    if not args.model:
        console.print("piper run: error: --model PATH.py:FACTORY is required (e.g. examples/gpt.py:small_gpt)")
        return 2
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
        losses = fit(job, itertools.chain([first], stream), steps, tokens_per_batch=tokens, console=console,
                     metrics=getattr(args, "metrics", None))
        if getattr(args, "trace", None):
            console.print(f"trace of the last steps: {job.trace(args.trace)} (open it in ui.perfetto.dev)")
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps")
    return 0
