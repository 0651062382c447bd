"""`piper.compile`: model + strategy -> a running job on a Ray cluster.

    job = piper.compile(model, example_inputs=(x, y), strategy=zero3_pp2,
                        mesh={"dp": 2, "pp": 2},
                        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    loss = job.step(x, y)        # one optimizer step on the global batch
    state = job.state_dict()     # full parameters, model.state_dict() keys, on CPU
    job.close()
"""
from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import torch

from . import checkpoint
from ..ir import experts
from ..frontend.batch_check import input_names
from ..frontend.capture import Program, capture
from .checkpoint import describe_strategy
from ..compiler.plans import Compiled
from ..diagnostics import error
from .inspection import JobInspection
from .many_steps import JobTrain
from .progress import reporter
from .startup import JobStartup
from .state import JobState
from .steps import JobSteps
from .worker_specs import WorkerSpecs
from ..frontend.loss_scaling import loss_scaling
from ..frontend import param_groups
from ..frontend.lr_schedules import check_schedule
from ..frontend.microbatches import microbatch_inputs
from ..frontend.model_checks import check_loss_gradient, check_parameters
from ..frontend.options import TrainingOptions, check_clip, check_nonfinite, compute_dtype
from ..compiler.planning import build_strategy, compile_directives, plan  # noqa: F401 (piper.job.plan)
from ..compiler.flat_layout import UnitLayout, job_layouts
from ..ir.tied import state_keys

DEVICES = ("auto", "cpu", "cuda")


def _data_options(model, data, batch_size, shuffle, seed):
    """`data=`'s options, checked (None without data=)."""
    from ..data import DataOptions, check_dataset, for_model

    if data is None:
        return None
    data = for_model(data, model)          # a token file checked against the model's vocabulary
    check_dataset(data, batch_size, model.forward)
    return DataOptions(data, batch_size, bool(shuffle), int(seed))


def compile(model: torch.nn.Module, example_inputs=None, strategy=None, mesh=None, optimizer=None, *,
            address: str | None = None, device: str = "auto", timeout: float = 300.0,
            overrides: dict | None = None, overlap: bool = True, worker_env: dict | None = None,
            startup_timeout: float = 600.0, progress=None, precision: str = "fp32",
            clip_grad_norm: float | None = None, nonfinite: str = "stop", lr_schedule=None, data=None,
            batch_size: int | None = None, shuffle: bool = False, seed: int = 0, val_data=None) -> "Job":
    """Capture `model`, apply `strategy` on `mesh`, verify, and start one worker per device.

    `strategy` is a `@piper.strategy` function, a path to a `.pps` script, or
    None (one device, no parallelism). `optimizer` is a callable taking a
    list of tensors (default: AdamW with lr 1e-3); it must be elementwise
    (AdamW, Adam, SGD with momentum...), since each device steps its own
    shard. It may also be a function of the named parameters returning
    torch-style parameter groups (or an optimizer built on them), e.g.
    `piper.param_groups(torch.optim.AdamW, lr=3e-4, weight_decay=0.1,
    no_decay=("**.bias", "**.ln_*.weight"))`: each group's options apply to
    exactly its parameters under every strategy (`frontend.param_groups`).
    `lr_schedule(step)` multiplies every group's base learning rate before
    optimizer step `step` (torch's LambdaLR), e.g. `piper.warmup_cosine(100,
    2000)`; checkpoints keep the step, so a resumed run continues it.
    `data=DATASET, batch_size=B` (a Dataset of tuples of forward's arguments,
    e.g. `piper.data.TokenFile`): `job.step()` with no arguments trains on the
    next global batch, which each worker reads its own part of (`piper.data`;
    `shuffle=True, seed=S`: a seeded permutation per epoch); example_inputs
    may then be None. `val_data=` is read the same way by `job.evaluate()`.
    Checkpoints keep the position in `data`. `timeout` bounds every collective and every step, in seconds.
    `overlap=False` runs the items of an overlapped slot (`[F(...), B(...)]`)
    one after the other instead of at once (CPU; CUDA always runs them in turn).
    `worker_env` sets environment variables in the worker processes before
    they start (Ray's runtime_env), e.g. allocator settings; a test's
    `PIPER_FAULT` in it goes to the workers with their set-up instead.
    `address` joins an existing Ray cluster ("auto", "ray://head:10001" or
    "head:6379"); workers are placed by the mesh (`piper.runtime.launch.placement`), and
    `job.placement()` says where each rank went. Starting the workers has its
    own limit, `startup_timeout` seconds. Each stage of the start (capture,
    planning, Ray, placement, torch.distributed, set-up) is reported as a line
    on stderr; `progress=False` (or `PIPER_PROGRESS=0` in the environment)
    turns that off, and a callable `progress(message)` receives the messages
    instead (`piper.job.progress`). A lost worker makes `step` raise
    `worker-died` naming its rank, node and pid within seconds; a stalled one
    is named as `worker-timeout` after `timeout`.
    `precision="bf16"` (or "fp16") computes in 16 bits with float32 master
    weights, optimizer state and gradient reductions; "fp16" also scales the
    loss dynamically (`piper.FP16(...)` sets it); "fp32" (the default)
    computes in the model's own dtype. `clip_grad_norm=1.0` clips the
    gradients by their global norm over the whole model before each update,
    as torch.nn.utils.clip_grad_norm_ on one device.
    A step whose loss is inf or NaN raises `non-finite` naming it (`nonfinite="stop"`, the
    default); `nonfinite="skip"` skips the update of every step whose gradients hold an inf or a
    NaN, on every device (fp16's loss scaler does so anyway), and `job.step` returns its loss.
    Before any worker starts, the model is checked (`piper.frontend.model_checks`: a loss
    without a gradient, parameters on the meta device) and so is memory: the memory model's
    prediction of what the workers hold against what the machine or Ray's nodes have.
    """
    training = TrainingOptions(compute_dtype(precision), check_clip(clip_grad_norm), loss_scaling(precision),
                               check_nonfinite(nonfinite))
    if device not in DEVICES:
        raise error("bad-device", f"device={device!r} is not one of {', '.join(map(repr, DEVICES))}",
                    hint="device='cuda' runs one worker per GPU (NCCL), 'cpu' one process per device (Gloo); "
                         "'auto' picks CUDA when the cluster has a GPU for every device")
    from ..frontend.optim_check import check_optimizer

    progress = reporter(progress)
    grouped = param_groups.resolve(optimizer, model)      # parameter groups, or None for a flat optimizer
    check_optimizer(grouped.cls if grouped else optimizer)    # before capture: a wrong optimizer is a one-line fix
    check_schedule(lr_schedule)
    data_options = _data_options(model, data, batch_size, shuffle, seed)
    if example_inputs is None:
        if data_options is None:
            raise error("bad-inputs", "piper.compile needs example_inputs (a global batch) or data= with batch_size=",
                        hint="pass example_inputs=(x, y), or data=DATASET, batch_size=B")
        example_inputs = data_options.example()
    mesh, directives = build_strategy(strategy, mesh, overrides)
    # A dict of example inputs calls forward with keywords (`input_ids=..., labels=...`).
    names = tuple(example_inputs) if isinstance(example_inputs, Mapping) else ()
    example_inputs = tuple(example_inputs.values()) if names else tuple(example_inputs)
    mb_inputs, microbatches, shards, batch = microbatch_inputs(example_inputs, mesh, directives)
    if data_options is not None and batch != data_options.batch_size:
        raise error("bad-inputs", f"example_inputs hold a batch of {batch} and batch_size={data_options.batch_size}",
                    hint="leave example_inputs None with data=: global batch 0 of the data is the example")
    if val_data is not None:
        from ..data import check_dataset, for_model

        val_data = for_model(val_data, model)
        check_dataset(val_data, batch, model.forward, "val_data")
    check_parameters(model)
    started = time.monotonic()
    progress(f"capturing {type(model).__name__} (torch.export)")
    program = _captured(model, training, mb_inputs, names, directives, mesh)
    progress(f"planning {len(program.regions)} region(s) on mesh {mesh} ({time.monotonic() - started:.1f} s)")
    compiled = compile_directives(program, mesh, directives)
    if grouped is not None:
        optimizer = param_groups.for_program(grouped, model, program.params)
    job = Job(model, program, compiled, optimizer or functools.partial(torch.optim.AdamW, lr=1e-3),
              batch=batch, microbatches=microbatches, shards=shards, address=address, device=device,
              timeout=timeout, overlap=overlap, worker_env=worker_env, startup_timeout=startup_timeout,
              progress=progress, training=training, lr_schedule=lr_schedule, data=data_options,
              val_data=val_data)
    job.strategy = describe_strategy(strategy, overrides)     # checkpoint metadata
    return job


def _captured(model, training, mb_inputs, names, directives, mesh) -> Program:
    """The model captured at its microbatch shape in the compute dtype, divided as the strategy's
    tensor-parallel statements say, with its loss and master specs checked."""
    from ..frontend.tensor_parallel import plan_of

    program = capture(training.capture_model(model), tuple(map(training.cast, mb_inputs)), names,
                      plan_of(directives, mesh))
    check_loss_gradient(program)
    training.master_specs(program, model, mb_inputs)
    return program


# The parts share one job's state (actors, plans, layouts), so they are mixins reading `self`,
# each in the module of this package named for what it holds: startup (Ray, placement, set-up),
# worker_specs (what each worker is given), steps (`step` and waiting on the workers),
# state (checkpoints, `state_dict`), inspection (memory, timings, trace, plans).
class Job(JobStartup, WorkerSpecs, JobSteps, JobTrain, JobState, JobInspection):
    """A compiled strategy running on Ray actors, one per device."""

    def __init__(self, model, program: Program, compiled: Compiled, optimizer, *, batch: int, microbatches: int,
                 shards: int, address, device, timeout, overlap: bool = True, worker_env: dict | None = None,
                 startup_timeout: float = 600.0, progress=None, training: "TrainingOptions | None" = None,
                 lr_schedule=None, data=None, val_data=None):
        self.program = program
        self.data = data                                  # piper.data.DataOptions, or None
        self.val_data = val_data
        self.data_position = 0                            # global batches read from `data` (checkpoints keep it)
        self.sent_bytes = 0                               # bytes of batch data the last step sent to the workers
        self.lr_schedule = lr_schedule                    # step -> multiplier of the base learning rates
        self.training = training or TrainingOptions()
        self.input_names = program.input_names or input_names(model, len(program.batch))
        self.worker_env = dict(worker_env or {})
        self.concurrent = overlap
        self.compiled = compiled
        self.mesh = compiled.ir.mesh
        self.batch_size = batch
        self.microbatches = microbatches
        self.shards = shards
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._progress = reporter(progress)
        self.actors = []
        self.where: dict[int, dict] = {}     # rank -> pid, node, ip, device (`placement()`)
        self._owns_ray = False
        self._broken = False       # a call to the workers failed: close kills them (`runtime/launch/pool.py`)
        self._pool_key = None
        self._closed = False
        self.steps = 0                                    # optimizer steps taken (checkpoints keep it)
        self.strategy = None                              # its name, for checkpoint metadata
        self.state_keys, self.aliases = checkpoint.model_keys(model, program)   # a checkpoint's `model.*`
        ir = compiled.ir
        # Under `shard experts`, expert weights live outside the flat units: each device holds its rows.
        self._expert_weights = experts.expert_params(program) if ir.sharded("experts") else {}
        # Under tp a unit is shared by the devices of one tp index: this is index 0's layout
        # (`tensor_units.layout_of` gives each rank its own).
        self.layouts: dict[int, UnitLayout] = job_layouts(compiled, program, optimizer)
        self._buffers = {k: v.detach().cpu().clone() for k, v in model.named_buffers()}
        self._buffers.update(program.constants)     # tensors forward makes from data (not in state_dict)
        self._state_keys = state_keys(model)
        try:
            self._start(model, optimizer, address, device)
        except BaseException:
            self._broken = True
            self.close()
            raise

    def close(self) -> None:
        """Stop the workers (and the Ray cluster, if this job started it)."""
        if self._closed:
            return
        self._closed = True
        try:
            import ray

            from ..runtime.launch import pool

            pg = getattr(self, "_pg", None)
            if self._broken or self._owns_ray or not pool.give(self._pool_key, pg, self.actors):
                pool.stop(pg, self.actors)
            if self._owns_ray:
                ray.shutdown()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

