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
import os
import time
from collections.abc import Mapping

import torch

from . import checkpoint
from . import experts
from .batch_check import check_step_inputs, input_names
from .capture import BATCH, BUFFER, Program, capture
from .checkpoint import describe_strategy
from .compiler import Compiled
from .diagnostics import PiperError, error
from .directives import Shard, Split
from .mesh import Mesh
from .experts import expert_spec, expert_state, slots_lanes
from .loss_scaling import loss_scaling
from .options import TrainingOptions, check_clip, compute_dtype
from .planning import _no_cycle_collection, compile_directives
from .runtime.executor import RegionSpec, WorkerSpec
from .runtime.graphs import pack
from .runtime.flat import UnitLayout, flatten, layout_unit, unflatten
from .strategy import as_strategy
from .tied import state_keys, tie_ids, tied_params, units_used


def plan(strategy, *, mesh=None, program: Program, overrides: dict | None = None) -> Compiled:
    """Build and compile a strategy against a captured (or abstract) program."""
    with _no_cycle_collection():
        mesh, directives = build_strategy(strategy, mesh, overrides)
        return compile_directives(program, mesh, directives)


def split_counts(mesh: Mesh, directives) -> tuple[int, int]:
    """(microbatches, batch shards) the directives cut the global batch into."""
    microbatches = next((d.count for d in directives if isinstance(d, Split) and d.what == "MB"), 1)
    shards = 1
    for d in directives:
        if isinstance(d, Shard) and "batch" in d.what:
            shards *= mesh.size(d.over)
    return microbatches, shards


def build_strategy(strategy, mesh, overrides=None):
    strat = as_strategy(strategy)
    if overrides:
        strat = strat.bind(**overrides)
    mesh = Mesh.of(mesh) if mesh is not None else None
    if mesh is None:
        mesh = getattr(strat, "mesh", None) or Mesh(())
    return strat.build(mesh)


def _microbatch_inputs(example_inputs, mesh: Mesh, directives):
    """Cut the global example batch to one microbatch: export fixes shapes."""
    microbatches, shards = split_counts(mesh, directives)
    sizes = {int(x.shape[0]) for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise error("bad-inputs", "every example input needs the same batch size in dimension 0",
                    hint="pass (inputs, targets) with one row per example")
    batch = sizes.pop()
    if batch % (microbatches * shards):
        raise error("indivisible-batch", f"the global batch of {batch} does not divide into {microbatches} "
                    f"microbatch(es) x {shards} data-parallel shard(s)",
                    hint=f"use a batch size that is a multiple of {microbatches * shards}")
    size = batch // (microbatches * shards)
    return tuple(x[:size] for x in example_inputs), microbatches, shards, batch


DEVICES = ("auto", "cpu", "cuda")


def compile(model: torch.nn.Module, example_inputs, strategy=None, mesh=None, optimizer=None, *,
            address: str | None = None, device: str = "auto", timeout: float = 300.0,
            overrides: dict | None = None, overlap: bool = True, worker_env: dict | None = None,
            startup_timeout: float = 600.0, progress=None, precision: str = "fp32",
            clip_grad_norm: float | None = None) -> "Job":
    """Capture `model`, apply `strategy` on `mesh`, verify, and start one worker per device.

    `strategy` is a `@piper.strategy` function, a path to a `.pps` script, or
    None (one device, no parallelism). `optimizer` is a callable taking a
    list of tensors (default: AdamW with lr 1e-3); it must be elementwise
    (AdamW, Adam, SGD with momentum...), since each device steps its own
    shard. `timeout` bounds every collective and every step, in seconds.
    `overlap=False` runs the items of an overlapped slot (`[F(...), B(...)]`)
    one after the other instead of at once (CPU; CUDA always runs them in turn).
    `worker_env` sets environment variables in the worker processes before
    they start (Ray's runtime_env), e.g. allocator settings.
    `address` joins an existing Ray cluster ("auto", "ray://head:10001" or
    "head:6379"); workers are placed by the mesh (`piper.cluster`), and
    `job.placement()` says where each rank went. Starting the workers has its
    own limit, `startup_timeout` seconds, and reports each stage to
    `progress(message)` when given. A lost worker makes `step` raise
    `worker-died` naming its rank, node and pid within seconds; a stalled one
    is named as `worker-timeout` after `timeout`.
    `precision="bf16"` (or "fp16") computes in 16 bits with float32 master
    weights, optimizer state and gradient reductions; "fp16" also scales the
    loss dynamically (`piper.FP16(...)` sets it); "fp32" (the default)
    computes in the model's own dtype. `clip_grad_norm=1.0` clips the
    gradients by their global norm over the whole model before each update,
    as torch.nn.utils.clip_grad_norm_ on one device.
    """
    training = TrainingOptions(compute_dtype(precision), check_clip(clip_grad_norm), loss_scaling(precision))
    if device not in DEVICES:
        raise error("bad-device", f"device={device!r} is not one of {', '.join(map(repr, DEVICES))}",
                    hint="device='cuda' runs one worker per GPU (NCCL), 'cpu' one process per device (Gloo); "
                         "'auto' picks CUDA when the cluster has a GPU for every device")
    from .optim_check import check_optimizer

    check_optimizer(optimizer)    # before capture: a wrong optimizer is a one-line fix
    mesh, directives = build_strategy(strategy, mesh, overrides)
    # A dict of example inputs calls forward with keywords (`input_ids=..., labels=...`).
    names = tuple(example_inputs) if isinstance(example_inputs, Mapping) else ()
    example_inputs = tuple(example_inputs.values()) if names else tuple(example_inputs)
    mb_inputs, microbatches, shards, batch = _microbatch_inputs(example_inputs, mesh, directives)
    program = capture(training.capture_model(model), tuple(map(training.cast, mb_inputs)), names)
    training.master_specs(program, model, mb_inputs)
    compiled = compile_directives(program, mesh, directives)
    job = Job(model, program, compiled, optimizer or functools.partial(torch.optim.AdamW, lr=1e-3),
              batch=batch, microbatches=microbatches, shards=shards, address=address, device=device,
              timeout=timeout, overlap=overlap, worker_env=worker_env, startup_timeout=startup_timeout,
              progress=progress, training=training)
    job.strategy = describe_strategy(strategy, overrides)     # checkpoint metadata
    return job


class Job:
    """A compiled strategy running on Ray actors, one per device."""

    def __init__(self, model, program: Program, compiled: Compiled, optimizer, *, batch: int, microbatches: int,
                 shards: int, address, device, timeout, overlap: bool = True, worker_env: dict | None = None,
                 startup_timeout: float = 600.0, progress=None, training: "TrainingOptions | None" = None):
        self.program = program
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
        self._progress = progress or (lambda message: None)
        self.actors = []
        self.where: dict[int, dict] = {}     # rank -> pid, node, ip, device (`placement()`)
        self._owns_ray = False
        self._broken = False       # a call to the workers failed: close kills them (`runtime/pool.py`)
        self._pool_key = None
        self._closed = False
        self.steps = 0                                    # optimizer steps taken (checkpoints keep it)
        self.strategy = None                              # its name, for checkpoint metadata
        self.state_keys, self.aliases = checkpoint.model_keys(model, program)   # a checkpoint's `model.*`
        ir = compiled.ir
        # Under `shard experts`, expert weights live outside the flat units: each device holds its rows.
        self._expert_weights = experts.expert_params(program) if ir.sharded("experts") else {}
        ties, copies = tie_ids(ir), tied_params(ir)
        self.layouts: dict[int, UnitLayout] = {
            r.index: layout_unit(r.index, [p for p in r.owned if p not in self._expert_weights], program.params,
                                 ir.devices_of(r.index), ties,
                                 second_copies={p for p, owners in copies.items() if owners[0] != r.index})
            for r in ir.regions if r.owned}
        self._buffers = {k: v.detach().cpu().clone() for k, v in model.named_buffers()}
        self._buffers.update(program.constants)     # tensors forward makes from data (not in state_dict)
        self._state_keys = state_keys(model)
        try:
            self._start(model, optimizer, address, device)
        except BaseException:
            self._broken = True
            self.close()
            raise

    # -- start-up ----------------------------------------------------------------------------
    def _start(self, model, optimizer, address, device) -> None:
        import ray

        from .runtime import pool

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster needs no token
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=True)
            self._owns_ray = True
        world = self.mesh.world_size
        gpus = ray.cluster_resources().get("GPU", 0)
        if device == "auto":
            device = "cuda" if gpus >= world else "cpu"
        elif device == "cuda" and gpus < world:
            # Waiting `timeout` for a placement group that can never fit tells the user nothing.
            raise error("no-resources", f"device='cuda' needs a GPU for each of the {world} devices, and the Ray "
                        f"cluster has {gpus:g}", hint="shrink the mesh, add GPUs to the cluster, or run on CPU "
                        "(device='cpu', Gloo)")
        self.device = device
        from .cluster import node_capacity, plan_placement
        from .runtime.health import Watch

        started = time.monotonic()
        placement = plan_placement(self.mesh.axes, node_capacity(ray.nodes(), device), device)
        self._progress(f"placing {world} workers ({placement.strategy} over the cluster's nodes)")
        if os.environ.get("PIPER_FAULT"):      # a test's injected fault (runtime.faults) reaches the workers
            self.worker_env.setdefault("PIPER_FAULT", os.environ["PIPER_FAULT"])
        self._pool_key = pool.key(placement, device, self.worker_env)
        kept = pool.take(self._pool_key)       # PIPER_KEEP_WORKERS: a closed job's workers of this shape
        if kept is not None:
            self._pg, self.actors = kept
        else:
            self._pg, self.actors = self._new_workers(placement, device, world)
        self._watch = Watch(self.actors, self.mesh)
        self.where = dict(enumerate(self._get([a.where.remote() for a in self.actors], "start",
                                              self.startup_timeout)))
        self._watch.where = self.where
        self._progress(f"{world} workers started on {len({w['node'] for w in self.where.values()})} node(s) "
                       f"({time.monotonic() - started:.1f} s); joining torch.distributed")
        self.rendezvous = self._get([self.actors[0].rendezvous_address.remote()], "start", self.startup_timeout)[0]
        self.pids = self._get([a.init.remote(self.rendezvous, self.timeout) for a in self.actors], "join",
                              self.startup_timeout)
        params = dict(model.named_parameters())
        slots = self._multi_slots()
        refs = [a.setup.remote(*self._spec(rank, params, optimizer, slots.get(rank, ())))
                for rank, a in enumerate(self.actors)]
        self._get(refs, "set up", self.startup_timeout)
        self._progress(f"workers ready ({time.monotonic() - started:.1f} s)")

    def _new_workers(self, placement, device, world):
        """A placement group for the mesh and one actor per rank in its bundle."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .runtime.worker import Worker

        pg = placement_group([dict(b) for b in placement.bundles], strategy=placement.strategy)
        self._pg = pg            # removed by `close` if what follows fails
        if not pg.wait(timeout_seconds=self.startup_timeout):
            raise error("no-resources", f"the cluster cannot host {world} workers ({placement.strategy} of "
                        f"{len(placement.bundles)} bundles of {placement.bundles[0]})",
                        hint="shrink the mesh or add nodes/GPUs to the Ray cluster")
        actor = ray.remote(concurrency_groups={"health": 1})(Worker)    # `Worker.status` answers mid-step
        return pg, [
            actor.options(**placement.resources(device),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              pg, placement_group_bundle_index=placement.bundle_of[r]),
                          **({"runtime_env": {"env_vars": {k: str(v) for k, v in self.worker_env.items()}}}
                             if self.worker_env else {}))
            .remote(r, world, device)
            for r in range(world)]

    def _multi_slots(self) -> dict[int, tuple]:
        """Per rank, the `order` slots holding several computes (tuples of keys)."""
        from .interop import compute_slots

        return {rank: tuple(slot for slot in slots if len(slot) > 1)
                for rank, slots in compute_slots(self.compiled).items()}

    def _spec(self, rank: int, params, optimizer, slots=()):
        ir, program = self.compiled.ir, self.program
        mine = [r.index for r in ir.regions if rank in ir.devices_of(r.index)]
        units_of = units_used(ir)
        regions = {r: RegionSpec(r, pack(program.regions[r].graph), program.regions[r].inputs, program.regions[r].outputs,
                                 program.regions[r].loss, units_of[r]) for r in mine}
        units = {u: self.layouts[u] for u in mine if u in self.layouts}
        init = {}
        for u, layout in units.items():
            index = layout.group.index(rank)
            flats = []
            for bucket in layout.buckets:
                flat = flatten(bucket, params)
                if self.compiled.zero == 3:
                    lo, hi = bucket.bounds(index)
                    flat = flat[lo:hi].clone()    # a ZeRO-3 device never holds the full unit
                flats.append(flat)
            init[u] = flats
        needed = {i.ref for r in mine for i in program.regions[r].inputs if i.kind == BUFFER}
        values = {v.id: (v.producer, v.index, v.spec.shape, v.spec.dtype, v.differentiable) for v in program.values}
        groups = sorted({a.group for plan in self.compiled.plans.values() for a in plan if a.group})
        spec = WorkerSpec(rank, self.mesh.world_size, self.compiled.plans[rank], regions, values, units,
                          self.compiled.zero, optimizer, 1.0 / (self.microbatches * self.shards),
                          {k: self._buffers[k] for k in needed}, groups, slots, self.concurrent)
        if self._expert_weights:
            spec.experts, init["experts"] = expert_spec(program, ir, rank, params, slots_lanes(self))
        self.training.configure(spec, ir, program)
        return spec, init

    # -- running -----------------------------------------------------------------------------
    def _get(self, refs, what: str, limit: float | None = None):
        """ray.get with a deadline; a dead, stalled or failing worker closes the job with an error
        naming it (`runtime.health`)."""
        ranks = list(range(len(refs))) if len(refs) == len(self.actors) else [0] * len(refs)
        try:
            return self._watch.wait(refs, what, self.timeout if limit is None else limit, ranks)
        except BaseException as exc:
            self._broken = True     # its workers may be mid-collective: never kept for another job
            if isinstance(exc, PiperError):
                self.close()
            raise

    def placement(self) -> dict[int, dict]:
        """Where every rank runs: `{rank: {"node": id, "ip": ..., "device": "cpu" | "cuda:N", "pid": ...,
        "coords": {"dp": 0, "pp": 1}}}` (`cuda:N` is the GPU's physical index on its node)."""
        return {rank: {**w, "coords": self.mesh.coords(rank)} for rank, w in self.where.items()}

    def _check_open(self) -> None:
        if self._closed:
            raise error("job-closed", "this job is closed", hint="compile a new job")

    def step(self, *batch, **named) -> float:
        """One optimizer step on the global batch; returns its mean loss.

        A job compiled with a dict of example inputs takes the batch by the same keywords."""
        self._check_open()
        if named:
            batch = _by_name(batch, named, self.program.input_names)
        check_step_inputs(batch, self.program.batch, self.batch_size, self.input_names)
        ir = self.compiled.ir
        per = self.batch_size // (self.microbatches * self.shards)
        axes = ir.batch_axes()
        refs = []
        for rank, actor in enumerate(self.actors):
            coords = self.mesh.coords(rank)
            shard = 0
            for a in axes:
                shard = shard * self.mesh.size(a) + coords[a]
            wanted = {i.ref for r in ir.regions if rank in ir.devices_of(r.index)
                      for i in self.program.regions[r.index].inputs if i.kind == BATCH}
            payload = {}
            for i in wanted:
                x = self.training.cast(batch[i].detach().cpu())
                start = shard * per * self.microbatches
                payload[i] = [x[start + m * per:start + (m + 1) * per].clone() for m in range(self.microbatches)]
            refs.append(actor.step.remote(payload))
        losses = [loss for result in self._get(refs, "step") for loss in result]
        self.steps += 1
        return float(sum(losses) / len(losses))

    def save(self, path) -> str:
        """Write a checkpoint directory (torch.distributed.checkpoint format) at `path`: every
        worker writes its own shards; parameters and optimizer state per parameter under
        model.state_dict() names, the step count, strategy and mesh. See `piper.checkpoint`."""
        return checkpoint.save(self, path)

    def load(self, path) -> dict:
        """Load a checkpoint saved by any job of the same model, whatever its strategy and mesh:
        parameters, optimizer state and step count, resharded. Returns its `piper` metadata."""
        return checkpoint.load(self, path)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded parameters (and buffers), keyed as model.state_dict(), on CPU."""
        self._check_open()
        shards = self._get([a.shards.remote() for a in self.actors], "state_dict")
        out: dict[str, torch.Tensor] = {}
        for u, layout in self.layouts.items():
            for b, bucket in enumerate(layout.buckets):
                pieces = [shards[rank][u][b] for rank in layout.group]
                out.update(unflatten(bucket, torch.cat(pieces)))
        if self._expert_weights:
            out.update(expert_state(self.compiled.ir, self.program, self._expert_weights, shards))
        out.update({k: v.clone() for k, v in self._buffers.items()})
        # model.state_dict()'s keys: a tied weight under each name, no non-persistent buffers.
        return {k: out[src] for k, src in self._state_keys.items() if src in out}

    def memory(self) -> dict[int, dict[str, int]]:
        """Per rank: bytes of parameters, gradients and optimizer state held between
        steps, `activations_peak`, the most bytes saved for backward at once in the last step, and
        `step_peak`, the most bytes of parameters, gradients, optimizer state and saved activations
        alive at once in the last step (sampled after every action: gathered parameters, gradient
        buffers and reduce-scatters in flight count; temporaries inside an action do not)."""
        self._check_open()
        return dict(enumerate(self._get([a.memory.remote() for a in self.actors], "memory")))

    def timings(self, cpu: bool = False) -> dict[int, dict[str, float]]:
        """Per rank: seconds each compute action took in the last step (`0F3`: 0.012, ...).

        An overlapped slot run in lanes also has an entry for the whole slot
        (`0F7&3BI3&3BW3`). `cpu=True` gives the worker thread's CPU seconds
        instead of wall-clock ones (CPU devices): the cost of each action on a
        core of its own, which `simulate(..., cores=N)` shares out when devices
        outnumber cores; its `step` entry is the whole worker process's CPU
        seconds in the step, every thread included."""
        self._check_open()
        return dict(enumerate(self._get([a.timings.remote(cpu) for a in self.actors], "timings")))

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (with `clip_grad_norm=`)."""
        self._check_open()
        return self._get([self.actors[0].__ray_call__.remote(_last_grad_norm)], "grad_norm")[0]

    def trace(self, path: str, steps: int | None = None) -> str:
        """Write the last steps (up to `piper.runtime.executor.TRACE_STEPS`; `steps` to keep fewer) as a
        Chrome/Perfetto trace: one process per device, a track per lane and one for communication,
        flow arrows from each send to its receive (`piper/trace.py`). Returns `path`."""
        self._check_open()
        from .trace import job_trace

        return job_trace(self, path, steps)

    def show(self) -> str:
        return self.compiled.show()

    def close(self) -> None:
        """Stop the workers (and the Ray cluster, if this job started it)."""
        if self._closed:
            return
        self._closed = True
        try:
            import ray

            from .runtime import pool

            pg = getattr(self, "_pg", None)
            if self._broken or self._owns_ray or not pool.give(self._pool_key, pg, self.actors):
                for a in self.actors:
                    ray.kill(a)
                if pg is not None:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(pg)
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


def _by_name(batch: tuple, named: dict, names: tuple[str, ...]) -> tuple:
    """The batch in capture's order from keyword inputs."""
    if batch or set(named) != set(names):
        expected = ", ".join(names) if names else "positional inputs"
        raise error("bad-inputs", f"step got {', '.join(named)} by keyword; this job takes {expected}",
                    hint="pass the batch the way example_inputs was passed (a dict for keywords)")
    return tuple(named[n] for n in names)


def _last_grad_norm(worker):
    clip = worker.executor.clip
    return clip.norm if clip is not None else None

