"""`piper run SCRIPT --model path.py:Factory [--mesh ...] [--set ...] [--steps N]
[--checkpoint-dir DIR --checkpoint-every N] [--resume] [--address ADDRESS] [--max-restarts R]`:
train a model with a strategy script on a local Ray cluster, or on an existing
one (`--address`), restarting lost workers (`--max-restarts`, `piper.recovery`)."""
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
    if getattr(args, "max_restarts", 0) or getattr(args, "address", None):
        return _run_recoverable(args, model, module, batch_size, steps, console)
    if hasattr(module, "training_batches"):
        stream = iter(module.training_batches(batch_size))
    else:
        stream = (example_batch(module, batch_size) for _ in itertools.count())
    first = next(stream)
    with compile(model, first, strategy=args.script, mesh=args.mesh, overrides=args.overrides or None,
                 progress=lambda message: console.print(f"  {message}")) as job:
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


def _run_recoverable(args, model, module, batch_size: int, steps: int, console) -> int:
    """On a given Ray cluster, or restarting lost workers: the loop of `piper.recovery`."""
    import os

    import ray

    from .recovery import Checkpoints, StepData, train

    if hasattr(module, "training_batches"):
        data = StepData(lambda: module.training_batches(batch_size))
    else:
        data = StepData(lambda: (example_batch(module, batch_size) for _ in itertools.count()))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray stays up across restarts: a job that started Ray would shut it down on close.
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address=args.address, include_dashboard=False, logging_level="ERROR", log_to_driver=True)

    def start_job():
        job = compile(model, data(0), strategy=args.script, mesh=args.mesh, overrides=args.overrides or None,
                      address=args.address, progress=lambda m: console.print(f"  {m}"))
        nodes = {}
        for rank, w in job.placement().items():
            nodes.setdefault(w["node"][:8], []).append(str(rank))
        console.print(f"[bold]piper run[/] {args.script} on mesh {job.mesh} ({job.mesh.world_size} workers; "
                      + "; ".join(f"node {n}: ranks {', '.join(r)}" for n, r in nodes.items()) + ")")
        return job

    def on_step(step, loss, seconds):
        if step % 10 == 0 or step == steps - 1:
            console.print(f"step {step:3d}  loss {loss:.4f}  {seconds:.2f} s")

    def on_restart(r):
        console.print(f"[yellow]restart {r.error.code}[/]: {r.error.diagnostics[0].message}")
        console.print(f"  training again {r.seconds:.1f} s after the failure, from step {r.resumed_from} "
                      f"(failed at step {r.failed_at}), on node(s) {', '.join(n[:8] for n in r.nodes)}")

    # The checkpoint flags (--checkpoint-dir, --checkpoint-every, --resume) are `piper.checkpoint`'s.
    directory = getattr(args, "checkpoint_dir", None)
    checkpoints = Checkpoints(directory, getattr(args, "checkpoint_every", None) or 0) if directory else None
    try:
        losses, restarts = train(start_job, data, steps, max_restarts=args.max_restarts or 0,
                                 checkpoints=checkpoints, resume=bool(getattr(args, "resume", False)),
                                 on_step=on_step, on_restart=on_restart)
    finally:
        if owns_ray:
            ray.shutdown()
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps")
    if restarts:
        # Full precision: a recovered run ends exactly where an uninterrupted one does.
        console.print(f"restarted {len(restarts)} time(s); final loss {losses[-1]!r}")
    return 0
