"""`piper run SCRIPT --model path.py:Factory [--steps N] [--batch-size N] [--optimizer adamw --lr 1e-3]
[--mesh ...] [--set ...] [--address ADDR] [--device cpu|cuda] [--save weights.pt|DIR]
[--checkpoint-dir DIR --checkpoint-every N] [--resume] [--max-restarts R] [--timeout S]
[--precision bf16] [--clip-grad-norm 1.0] [--skip-nonfinite] [--metrics F.jsonl] [--trace F.json]
[--config run.toml] [--lr-schedule warmup-cosine --warmup N] [--weight-decay W] [--data FILE.bin --block-size N]
[--eval-every N --eval-batches K --val-data FILE.bin] [--tensorboard DIR]`:
train a model with a strategy script on a Ray cluster (a local one of its own unless --address),
saving checkpoints (`piper.job.checkpoint`) and restarting lost workers (`piper.job.recovery`,
whose loop every run goes through: with R = 0 it only saves, resumes and numbers the steps).

The model's file provides the data: `training_batches(batch_size)`, an iterator of
input tuples, or else `example_batch(batch_size)`, which is then trained on again
and again (said with a warning). The flags are defined in `piper/run_args.py`.
"""
from __future__ import annotations

import functools
import itertools
import os

import torch
from rich.console import Console

from .job import checkpoint, checkpoint_lock
from .diagnostics import error
from .job import compile
from .frontend.models import example_batch, load_model
from .run_paths import WEIGHT_FILES, check_output_paths
from .job.quiet import quiet_driver_noise

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
    # Lines are not broken at the console's width: a log or a pipe (80 columns) would otherwise
    # split the paths it names (checkpoints, shards) across lines; a terminal wraps them itself.
    # Nor does a line carry rich's file:line column (`log_path`): it names Piper's source, not the run.
    console = Console(stderr=True, soft_wrap=True, log_path=False)
    # The recipe's flags (`piper.run_recipe`): --config first, since it fills in the others
    # (the model and the script too).
    from . import run_recipe as recipe

    recipe.apply_config(args)
    if not args.script:
        console.print("piper run: error: the strategy SCRIPT is required (or `script = \"job.pps\"` in --config)")
        return 2
    if not args.model:
        console.print("piper run: error: --model PATH.py:FACTORY is required (e.g. examples/gpt.py:small_gpt)")
        return 2
    steps = 20 if args.steps is None else args.steps
    batch_size = 16 if getattr(args, "batch_size", None) is None else args.batch_size
    if steps < 1 or batch_size < 1:
        console.print("piper run: error: --steps and --batch-size take whole numbers of at least 1")
        return 2
    problem = recipe.check(args) or checkpoint.check_run_flags(args) or _problem_with_limits(args)
    if not problem and getattr(args, "max_restarts", 0) and (
            getattr(args, "data", None) or args.eval_every or args.tensorboard or args.lr_schedule != "constant"):
        problem = ("--max-restarts does not combine with --data, --lr-schedule, --eval-every or --tensorboard "
                   "yet; leave those out or --max-restarts")
    if problem:
        console.print(f"piper run: error: {problem}")
        return 2
    check_output_paths(args)          # before anything trains: a run is not lost to a bad --save at its end
    # One run per checkpoint folder, held until the run ends (`piper.job.checkpoint_lock`).
    directory = getattr(args, "checkpoint_dir", None)
    try:
        with checkpoint_lock.hold(directory if directory and (args.checkpoint_every or os.path.isdir(directory))
                                  else None):
            return _load_and_train(args, steps, batch_size, console)
    except KeyboardInterrupt:         # in training, `_train` says what was kept; before it, nothing was
        console.print("\ninterrupted (Ctrl-C) while loading the model: nothing was trained", highlight=False)
        return 130


def _load_and_train(args, steps: int, batch_size: int, console) -> int:
    """The model, its data and optimizer, then `_train`."""
    from . import run_recipe as recipe

    quiet_driver_noise()
    torch.manual_seed(getattr(args, "seed", 0) or 0)
    model, module = load_model(args.model)
    train_data, val_data = recipe.datasets(args)
    if train_data is not None:        # `job.step()`: the workers read each batch themselves
        count, unit = batch_size * args.block_size, "tok"
    else:
        stream, _ = training_data(module, batch_size, console)
        count, unit = throughput(tuple(next(stream)))
    optimizer = recipe.optimizer(args, make_optimizer(getattr(args, "optimizer", "adamw"), getattr(args, "lr", 1e-3)))
    recipe_kw = dict(lr_schedule=recipe.schedule(args, steps), data=train_data,
                     batch_size=batch_size if train_data is not None else None, shuffle=args.shuffle,
                     seed=getattr(args, "seed", 0) or 0, val_data=val_data)
    params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]piper run[/] {args.script}: {type(model).__name__}, {params:,} parameters, "
                  f"batch {batch_size}, {steps} steps", highlight=False)
    return _train(args, model, module, batch_size, steps, optimizer, count, unit, console, recipe_kw)


def _problem_with_limits(args) -> str | None:
    """What is wrong with --max-restarts, --timeout, --startup-timeout or --clip-grad-norm, or None."""
    import math

    if (getattr(args, "max_restarts", 0) or 0) < 0:
        return f"--max-restarts {args.max_restarts} is not a number of restarts (0 or more)"
    for flag, name in (("--timeout", "timeout"), ("--startup-timeout", "startup_timeout"),
                       ("--clip-grad-norm", "clip_grad_norm"), ("--peak-flops", "peak_flops")):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"{flag} {value} is not a positive number (e.g. {flag} {'1.0' if 'clip' in flag else '60'})"
    return None


def _train(args, model, module, batch_size: int, steps: int, optimizer, count: int, unit: str, console,
           recipe_kw: dict) -> int:
    """The run: `piper.job.recovery.train`, with the data deterministic per step, so --resume and
    --max-restarts replay the batches an uninterrupted run trains on. Steps are the job's own numbers.
    With `--data` each step's batch is empty: the workers read it (`job.step()`), and a checkpoint
    keeps where they were."""
    import ray

    from . import run_recipe as recipe
    from .job.recovery import StepData, train
    from .job.train import StepReport

    quiet = Console(quiet=True)           # the repeated-batch warning was printed once already
    worker_read = recipe_kw["data"] is not None
    data = StepData(lambda: itertools.repeat(()) if worker_read else training_data(module, batch_size, quiet)[0])
    observers = []                        # --eval-every and --tensorboard, told of each step
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = getattr(args, "address", None)
    # Ray stays up across restarts: a job that started Ray would shut it down on close. Without
    # --address the cluster is this run's own ("local"): never one another run left recorded.
    owns_ray = not ray.is_initialized()
    if owns_ray:
        if not address:               # the local cluster goes with this process, even killed with -9
            from .runtime.launch.cluster_reaper import watch_local_cluster

            watch_local_cluster()
        ray.init(address=address or "local", include_dashboard=False, logging_level="ERROR", log_to_driver=True)
    started = []

    def start_job():
        options = dict(strategy=args.script, mesh=args.mesh, optimizer=optimizer, overrides=args.overrides or None,
                       address=address, device=getattr(args, "device", "auto"),
                       timeout=getattr(args, "timeout", None) or 300.0,
                       startup_timeout=getattr(args, "startup_timeout", None) or 600.0,
                       precision=getattr(args, "precision", None) or "fp32",
                       clip_grad_norm=getattr(args, "clip_grad_norm", None),
                       nonfinite="skip" if getattr(args, "skip_nonfinite", False) else "stop",
                       progress=lambda m: console.print(f"  {m}"), **recipe_kw)
        if started:                       # a restart: a live progress bar is showing, so no spinner
            job = compile(model, data(0) or None, **options)
        else:
            with console.status("capturing the model, checking the plans, starting the workers on Ray "
                                "(a minute on a busy machine)..."):
                job = compile(model, data(0) or None, **options)
        if not started:
            _measure_mfu(job, args, report, console)
        started.append(job)
        if observers:
            observers[0].job = job
        else:
            observers.append(recipe.Observer(job, args, console, getattr(args, "lr", 1e-3)))
        nodes = {}
        for rank, w in job.placement().items():
            nodes.setdefault(w["node"][:8], []).append(str(rank))
        console.print(f"mesh {job.mesh}: {job.mesh.world_size} workers ready ({job.device}; "
                      + "; ".join(f"node {n}: ranks {', '.join(r)}" for n, r in nodes.items()) + ")",
                      highlight=False)
        return job

    # A resumed run's --metrics lines go on after the earlier run's: one file holds the whole training.
    report = StepReport(steps, tokens_per_batch=count, unit=unit, console=console,
                        metrics=getattr(args, "metrics", None), append=bool(getattr(args, "resume", False)))

    def on_step(step, loss, seconds, metrics=None):
        report.step(step, loss, seconds)
        observers[0](step + 1, loss, seconds, count / seconds, unit, metrics)

    def on_restart(r):
        report.restarts += 1
        # `failed_at` of a step is the steps done before it: the step itself is one more.
        what = {"save": f"while saving the checkpoint of step {r.failed_at}",
                "finish": "while writing the outputs"}.get(r.during, f"at step {r.failed_at + 1}")
        since = f"the checkpoint of step {r.resumed_from}" if r.resumed_from else "the start"
        console.print(f"[yellow]restart {r.error.code}[/]: {r.error.diagnostics[0].message}")
        console.print(f"  training again {r.seconds:.1f} s after the failure, from {since} "
                      f"(failed {what}), on node(s) {', '.join(n[:8] for n in r.nodes)}", highlight=False)

    def finish(job):
        # --save first: whatever happens to the trace, the trained weights are kept.
        if getattr(args, "save", None):
            save_outputs(job, args.save, console)
        if getattr(args, "trace", None):
            console.print(f"trace of the last steps: {job.trace(args.trace)} (open it in ui.perfetto.dev)")

    directory = getattr(args, "checkpoint_dir", None)
    checkpoints = _checkpoints(args, directory, console) if directory else None
    resume = bool(getattr(args, "resume", False))
    try:
        with report:
            if resume and checkpoints is not None and not _has_checkpoints(directory):
                console.print(f"no checkpoint in {directory} yet: starting from the first step")
            # Workers that read their own data step on without a call per step (`job.train`).
            losses, restarts = train(start_job, data, steps, max_restarts=getattr(args, "max_restarts", 0) or 0,
                                     checkpoints=checkpoints, resume=resume, on_step=on_step,
                                     on_restart=on_restart, finish=finish, worker_read=worker_read,
                                     eval_every=args.eval_every, on_eval=lambda s: observers[0].evaluate(s))
    except KeyboardInterrupt:
        _interrupted(args, report, steps, bool(started), console)
        return 130
    finally:
        for observer in observers:
            observer.close()
        if owns_ray:
            ray.shutdown()
    start = steps - len(losses)          # the step the run went on from (a resumed checkpoint's)
    if not losses:
        console.print(f"the checkpoint is at step {start}: nothing left of {steps} steps")
        return 0
    span = f"steps {start + 1}-{steps}" if start else f"{steps} steps"
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {span}", highlight=False)
    if restarts:
        # Full precision: a recovered run ends exactly where an uninterrupted one does.
        console.print(f"restarted {len(restarts)} time(s); final loss {losses[-1]!r}", highlight=False)
    return 0


def _checkpoints(args, directory: str, console):
    """`--checkpoint-dir DIR --checkpoint-every N`: DIR/step-N, each save, load and skip said."""
    from .job.recovery import Checkpoints

    return Checkpoints(
        directory, getattr(args, "checkpoint_every", None) or 0,
        on_save=lambda path, s: console.print(f"saved checkpoint {path} ({s:.1f} s)", highlight=False),
        on_load=lambda step, path: console.print(f"loaded checkpoint {path} (step {step}): training goes "
                                                 "on from there", highlight=False),
        on_skip=lambda path, why: console.print(f"[yellow]warning[/]: skipping checkpoint {path}: {why}; "
                                                "trying the one before it", highlight=False),
        on_save_failed=lambda path, err, lost: console.print(
            f"[yellow]warning[/]: {err.diagnostics[0].message} ({path}); training goes on and the next "
            f"checkpoint tries again; until one is written, {lost}", highlight=False))


def _measure_mfu(job, args, report, console) -> None:
    """Give the progress report what MFU needs (`piper.job.mfu`): the model's FLOPs per token from the
    captured graph, and the devices' peak (`--peak-flops`, a known accelerator, or a GEMM measured here)."""
    from .job.mfu import flops_per_item, peak_flops

    per_item = flops_per_item(job.program)
    if per_item <= 0:
        return
    peak, source = peak_flops(job.device, getattr(args, "peak_flops", None))
    report.flops_per_item, report.peak_flops = per_item, peak * job.mesh.world_size
    console.print(f"MFU against {peak:.3g} FLOP/s per device ({source}), {per_item:.3g} FLOPs per "
                  f"{'token' if report.unit == 'tok' else 'sample'} (forward and backward)", highlight=False)


def _interrupted(args, report, steps: int, started: bool, console) -> None:
    """Ctrl-C: what the run trained, what is kept (the newest checkpoint) and how to go on from it."""
    done = report.done
    console.print(f"\ninterrupted (Ctrl-C) " + (f"after step {done} of {steps}" if done else
                                                 "before the first step" if started else
                                                 "while starting the workers"), highlight=False)
    directory = getattr(args, "checkpoint_dir", None)
    found = checkpoint.checkpoints(directory) if directory and os.path.isdir(directory) else []
    if found:
        step, path = found[-1]
        lost = f"; steps {step + 1}-{done} are in no checkpoint" if done and done > step else ""
        console.print(f"the last checkpoint is {path} (step {step}){lost}. Go on from it with the same command "
                      f"and --resume (it reads --checkpoint-dir {directory})", highlight=False)
    elif done:
        console.print(f"nothing was saved: steps 1-{done} are lost. Keep them next time with --checkpoint-dir "
                      "DIR --checkpoint-every N, then --resume", highlight=False)


def _has_checkpoints(directory) -> bool:
    return bool(checkpoint.checkpoints(directory))


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
