"""`piper run SCRIPT --model path.py:Factory [--steps N] [--batch-size N] [--optimizer adamw --lr 1e-3]
[--mesh ...] [--set ...] [--address ADDR] [--device cpu|cuda] [--save weights.pt|DIR]
[--checkpoint-dir DIR --checkpoint-every N] [--resume] [--max-restarts R] [--config run.toml]
[--lr-schedule warmup-cosine --warmup N] [--weight-decay W] [--data FILE.bin --block-size N]
[--eval-every N --eval-batches K --val-data FILE.bin] [--tensorboard DIR]`:
train a model with a strategy script on a Ray cluster (a local one unless --address),
saving checkpoints (`piper.job.checkpoint`) and restarting lost workers (`piper.job.recovery`).

The model's file provides the data: `training_batches(batch_size)`, an iterator of
input tuples, or else `example_batch(batch_size)`, which is then trained on again
and again (said with a warning), unless `--data FILE.bin` names a token file that the
workers read themselves. The flags are defined in `piper/run_args.py`; the recipe's
(config file, schedule, weight decay, token files, evaluation, TensorBoard) are read by
`piper/job/recipe.py`.
"""
from __future__ import annotations

import functools
import itertools

import torch
from rich.console import Console

from .job import checkpoint
from .diagnostics import error
from .job import compile
from .frontend.models import example_batch, load_model

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
    # -- the recipe's flags (`piper.job.recipe`): --config first, since it fills in the others --------
    from .job import recipe

    recipe.apply_config(args)
    problem = recipe.check(args)
    if problem:
        console.print(f"piper run: error: {problem}")
        return 2
    # ----------------------------------------------------------------------------------------------------
    steps = 20 if args.steps is None else args.steps
    batch_size = 16 if getattr(args, "batch_size", None) is None else args.batch_size
    if steps < 1 or batch_size < 1:
        console.print("piper run: error: --steps and --batch-size take whole numbers of at least 1")
        return 2
    problem = checkpoint.check_run_flags(args)
    if (getattr(args, "max_restarts", 0) or 0) < 0:
        problem = f"--max-restarts {args.max_restarts} is not a number of restarts (0 or more)"
    if problem:
        console.print(f"piper run: error: {problem}")
        return 2
    directory = getattr(args, "checkpoint_dir", None)
    torch.manual_seed(getattr(args, "seed", 0) or 0)
    model, module = load_model(args.model)
    # -- the recipe: token files read by the workers, weight decay, schedule ---------------------------
    train_data, val_data = recipe.datasets(args)
    if train_data is not None:
        stream, first = itertools.repeat(()), ()      # `job.step()`: the workers read the batch themselves
        count, unit = batch_size * args.block_size, "tok"
    else:
        stream, _ = training_data(module, batch_size, console)
        first = tuple(next(stream))
        count, unit = throughput(first)
    base = make_optimizer(getattr(args, "optimizer", "adamw"), getattr(args, "lr", 1e-3))
    optimizer = recipe.optimizer(args, base)
    recipe_kw = dict(lr_schedule=recipe.schedule(args, steps), data=train_data,
                     batch_size=batch_size if train_data is not None else None, shuffle=args.shuffle,
                     seed=getattr(args, "seed", 0) or 0, val_data=val_data)
    # ----------------------------------------------------------------------------------------------------
    params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]piper run[/] {args.script}: {type(model).__name__}, {params:,} parameters, "
                  f"batch {batch_size}, {steps} steps", highlight=False)
    if getattr(args, "max_restarts", 0):
        if train_data is not None or args.eval_every or args.tensorboard or recipe_kw["lr_schedule"]:
            console.print("piper run: error: --max-restarts does not combine with --data, --lr-schedule, "
                          "--eval-every or --tensorboard yet; leave those out or --max-restarts")
            return 2
        return _run_recoverable(args, model, module, batch_size, steps, optimizer, count, unit, console)
    with console.status("capturing the model, checking the plans, starting the workers on Ray "
                        "(a minute on a busy machine)..."):
        job = compile(model, first or None, strategy=args.script, mesh=args.mesh, optimizer=optimizer,
                      overrides=args.overrides or None, address=getattr(args, "address", None),
                      device=getattr(args, "device", "auto"), progress=lambda message: console.print(f"  {message}"),
                      **recipe_kw)
    observer = recipe.Observer(job, args, console, getattr(args, "lr", 1e-3))
    with job:
        console.print(f"mesh {job.mesh}: {job.mesh.world_size} workers ready ({job.device})", highlight=False)
        from .job.train import fit

        data = itertools.chain([first], stream) if first else stream
        start = checkpoint.resume(job, directory, data, console) if getattr(args, "resume", False) else 0
        if start >= steps:
            console.print(f"the checkpoint is at step {start}: nothing left of {steps} steps")
            return 0
        every = getattr(args, "checkpoint_every", None)
        stepper = checkpoint.Every(job, directory, every) if every else job
        try:
            losses = fit(stepper, data, steps - start, tokens_per_batch=count, unit=unit, console=console,
                         metrics=getattr(args, "metrics", None), after_step=observer)
        finally:
            observer.close()
        if getattr(args, "trace", None):
            console.print(f"trace of the last steps: {job.trace(args.trace)} (open it in ui.perfetto.dev)")
        if getattr(args, "save", None):
            save_outputs(job, args.save, console)
    span = f"steps {start + 1}-{steps}" if start else f"{steps} steps"
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {span}", highlight=False)
    return 0


def _run_recoverable(args, model, module, batch_size: int, steps: int, optimizer, count: int, unit: str,
                     console) -> int:
    """`--max-restarts R`: the loop of `piper.job.recovery`, with the data deterministic per step."""
    import os

    import ray

    from .job.recovery import Checkpoints, StepData, train

    quiet = Console(quiet=True)           # the repeated-batch warning was printed once already
    data = StepData(lambda: training_data(module, batch_size, quiet)[0])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray stays up across restarts: a job that started Ray would shut it down on close.
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address=getattr(args, "address", None), include_dashboard=False, logging_level="ERROR",
                 log_to_driver=True)

    def start_job():
        job = compile(model, data(0), strategy=args.script, mesh=args.mesh, optimizer=optimizer,
                      overrides=args.overrides or None, address=getattr(args, "address", None),
                      device=getattr(args, "device", "auto"), progress=lambda m: console.print(f"  {m}"))
        nodes = {}
        for rank, w in job.placement().items():
            nodes.setdefault(w["node"][:8], []).append(str(rank))
        console.print(f"mesh {job.mesh}: {job.mesh.world_size} workers ready ({job.device}; "
                      + "; ".join(f"node {n}: ranks {', '.join(r)}" for n, r in nodes.items()) + ")",
                      highlight=False)
        return job

    def on_step(step, loss, seconds):
        if step % 10 == 0 or step == steps - 1:
            console.print(f"step {step:3d}  loss {loss:.4f}  {count / seconds:,.0f} {unit}/s", highlight=False)

    def on_restart(r):
        console.print(f"[yellow]restart {r.error.code}[/]: {r.error.diagnostics[0].message}")
        console.print(f"  training again {r.seconds:.1f} s after the failure, from step {r.resumed_from} "
                      f"(failed at step {r.failed_at}), on node(s) {', '.join(n[:8] for n in r.nodes)}")

    def finish(job):
        if getattr(args, "save", None):
            save_outputs(job, args.save, console)

    directory = getattr(args, "checkpoint_dir", None)
    checkpoints = Checkpoints(directory, getattr(args, "checkpoint_every", None) or 0) if directory else None
    try:
        losses, restarts = train(start_job, data, steps, max_restarts=args.max_restarts, checkpoints=checkpoints,
                                 resume=bool(getattr(args, "resume", False)), on_step=on_step,
                                 on_restart=on_restart, finish=finish)
    finally:
        if owns_ray:
            ray.shutdown()
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps", highlight=False)
    if restarts:
        # Full precision: a recovered run ends exactly where an uninterrupted one does.
        console.print(f"restarted {len(restarts)} time(s); final loss {losses[-1]!r}", highlight=False)
    return 0


WEIGHT_FILES = (".pt", ".pth", ".bin")


def save_outputs(job, path: str, console) -> None:
    """`--save`: FILE.pt gets the trained weights (torch.save of model.state_dict()'s keys); any
    other path becomes a checkpoint directory (`job.save`: weights, optimizer state and step, each
    device writing its own shards), which `job.load` or `piper run --resume` continue from."""
    if path.endswith(WEIGHT_FILES):
        torch.save(job.state_dict(), path)
        console.print(f"saved the trained weights to {path} (load with "
                      f"model.load_state_dict(torch.load({path!r})))", highlight=False)
    else:
        job.save(path)
        console.print(f"saved a checkpoint to {path}/ (weights, optimizer state, step {job.steps}; continue "
                      f"with job.load({path!r}) under any strategy and mesh)", highlight=False)
