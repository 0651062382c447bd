"""`job.save(path)` / `job.load(path)`: checkpoints in torch.distributed.checkpoint (DCP)
format that any strategy on any mesh can load.

    job.save("ckpt/step-100")      # every worker writes its own shards, at once
    job.load("ckpt/step-100")      # into a job of any strategy and mesh: resharded on read

A checkpoint is a DCP directory (`.metadata` plus one `__RANK_N.distcp` file per
writing worker) holding

    model.<name>                   every parameter and persistent buffer, model.state_dict() names and shapes
    optim.state.<name>.<key>       the optimizer's state per parameter (AdamW: exp_avg, exp_avg_sq, step)
    piper.<key>                    step, strategy, mesh, world_size, zero, microbatches, format
                                   (and data_position, the global batches read, for a job with data=)

so it does not depend on the strategy that wrote it: regions, pipeline stages,
flat ZeRO units and expert rows under `shard experts` are the job's business,
not the file's (see
`piper.runtime.checkpoint` for how a flat shard is described). DCP's own
`format_utils.dcp_to_torch_save(dir, file)` turns it into one `torch.save`
file: `torch.load(file)["model"]` loads into the plain model.
"""
from __future__ import annotations

import os
import re
import shutil

from ..frontend import loss_scaling
from ..diagnostics import error

FORMAT = 1


def describe_strategy(strategy, overrides=None) -> str:
    """A readable name for the strategy a job was compiled with (kept as metadata only)."""
    if strategy is None:
        text = "none (one device)"
    elif isinstance(strategy, (str, os.PathLike)):
        text = os.fspath(strategy)                  # a script's path, or its text
    elif callable(getattr(strategy, "fn", None)):   # @piper.strategy
        fn = strategy.fn
        text = f"{fn.__module__}.{fn.__qualname__}"
        if getattr(strategy, "params", None):
            text += "(" + ", ".join(f"{k}={v!r}" for k, v in dict(strategy.params).items()) + ")"
    elif hasattr(strategy, "file"):                 # a loaded .pps script
        text = f"script {strategy.file}"
        if getattr(strategy, "overrides", None):
            text += " with " + ", ".join(f"{k}={v!r}" for k, v in strategy.overrides.items())
    else:
        text = repr(strategy)
    if overrides:
        text += " with " + ", ".join(f"{k}={v}" for k, v in overrides.items())
    return text


def model_keys(model, program) -> tuple[frozenset, dict[str, str]]:
    """(the model's state_dict names, {alias: name} for tied parameters).

    Capture keeps one name per tensor (`wte.weight` for a head tied to the embedding);
    `model.state_dict()` has both, so a checkpoint holds both too (the alias's chunks
    are written twice), for the converted file to load into the plain model strictly."""
    state = model.state_dict(keep_vars=True)
    owner = {id(t): name for name, t in state.items() if name in program.params}
    aliases = {name: owner[id(t)] for name, t in state.items()
               if name not in program.params and id(t) in owner}
    return frozenset(state), aliases


def _persistent_buffers(job) -> list[str]:
    return [k for k in job._buffers if k in job.state_keys]


def save(job, path) -> str:
    """Write `job`'s parameters, persistent buffers, optimizer state and step count to the
    DCP directory `path` (created; an earlier checkpoint there is replaced). Returns the
    absolute path."""
    job._check_open()
    path = os.path.abspath(os.fspath(path))
    _clear_old_save(path)
    meta = {"format": FORMAT, "step": job.steps, "strategy": job.strategy, "mesh": dict(job.mesh.axes),
            "world_size": job.mesh.world_size, "zero": job.compiled.zero, "microbatches": job.microbatches}
    if job.data is not None:                # data=: the global batches read, so a resumed run reads on
        meta["data_position"] = job.data_position
    scaler = loss_scaling.checkpoint_state(job)
    if scaler is not None:                  # fp16: a resumed run goes on at the same loss scale
        meta["loss_scale"] = scaler
    # The buffers are the job's constants, held by the driver: rank 0 writes them with the metadata.
    first = {"model": {k: job._buffers[k] for k in _persistent_buffers(job)}, "piper": meta}
    # A parameter tied across pipeline stages has an identical copy on each: the first unit's is written.
    copies: dict = {}
    for u in sorted(job.layouts):
        for bucket in job.layouts[u].buckets:
            if getattr(bucket, "tied", None) is not None:
                for e in bucket.entries:
                    copies.setdefault(e.name, []).append(u)
    skip = {(u, name) for name, units in copies.items() for u in units[1:]}
    refs = [a.save_checkpoint.remote(path, first if rank == 0 else {}, job.aliases, skip)
            for rank, a in enumerate(job.actors)]
    job.saved_bytes = dict(enumerate(job._get(refs, "save")))
    return path


def _clear_old_save(path: str) -> None:
    """Remove the files of an earlier checkpoint at `path`: a save by more workers would
    leave data files the new `.metadata` does not name. Other files are left alone."""
    if not os.path.isdir(path):
        return
    for name in os.listdir(path):
        if name == ".metadata" or re.fullmatch(r"__\d+_\d+\.distcp", name):
            os.remove(os.path.join(path, name))


def read_metadata(path):
    """The DCP metadata of checkpoint `path`, or a `not-a-checkpoint` error saying why not."""
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.abspath(os.fspath(path))
    fix = ("pass the directory job.save(path) wrote (it holds a `.metadata` file); `piper run "
           "--checkpoint-dir DIR` writes them as DIR/step-N")
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise error("not-a-checkpoint", f"{path} {what}, so it is not a checkpoint directory", hint=fix)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise error("not-a-checkpoint", f"{path} has no `.metadata` file: it is not a finished checkpoint "
                    "(an interrupted save leaves none)", hint=fix)
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise error("not-a-checkpoint", f"cannot read the checkpoint metadata in {path}: "
                    f"{type(exc).__name__}: {exc}", hint=fix) from None


def read_info(path) -> dict:
    """The `piper.*` metadata of checkpoint `path` (step, strategy, mesh...), read on this process.

    A DCP checkpoint another program wrote with torch's own layout (`get_state_dict`:
    `model.<name>`, `optim.state.<name>.<key>`, as FSDP2 training saves) loads too: its
    step is the optimizer's step count, and its strategy is unknown."""
    md = read_metadata(path)
    keys = md.state_dict_metadata
    if "piper.step" in keys:
        info = _read_nested(path, md, [k for k in keys if k.startswith("piper.")], lambda fqn: None)["piper"]
        found = info.get("format", FORMAT)
        if found > FORMAT:
            raise error("not-a-checkpoint", f"{os.fspath(path)} is in checkpoint format {found}, newer than "
                        f"this Piper's {FORMAT}", hint="load it with the Piper that wrote it, or upgrade Piper")
        return info
    if not any(k.startswith("model.") for k in keys):
        raise error("not-a-checkpoint", f"{os.fspath(path)} is a DCP checkpoint, but holds no model "
                    "(no `model.*` keys)", hint="pass a directory job.save(path) wrote, or one saved from "
                    "torch's get_state_dict as {'model': ..., 'optim': ...}")
    step = 0
    counts = sorted(k for k in keys if k.startswith("optim.state.") and k.endswith(".step"))
    if counts:
        import torch

        state = _read_nested(path, md, counts[:1], lambda fqn: torch.zeros(keys[fqn].size))
        for part in _place(md, counts[0]):
            state = state[part]
        step = int(state)
    return {"format": None, "step": step, "strategy": "unknown (not written by Piper)", "mesh": None}


def _place(md, fqn: str) -> tuple:
    """Where flattened key `fqn` sits in the nested dict that was saved (DCP's save planner
    keeps these mappings in the metadata)."""
    return (md.planner_data or {}).get(fqn, tuple(fqn.split(".")))


def _read_nested(path, md, fqns, make) -> dict:
    """The checkpoint's entries `fqns`, read on this process into a nested dict of their own
    shape, each first made by `make(fqn)`."""
    state: dict = {}
    for fqn in fqns:
        node = state
        place = _place(md, fqn)
        for part in place[:-1]:
            node = node.setdefault(part, {})
        node[place[-1]] = make(fqn)
    _read_here(state, path)
    return state


def _read_here(state: dict, path) -> None:
    """DCP's load in this process alone (the driver), in place into `state`."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():      # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=os.path.abspath(os.fspath(path)), no_dist=True)


def _check_model(job, md, path: str, info: dict) -> None:
    """Same names and shapes as this job's model, or a `checkpoint-mismatch` error."""
    shapes = {k: tuple(v.shape) for k, v in job.program.params.items()}
    shapes.update({k: tuple(job._buffers[k].shape) for k in _persistent_buffers(job)})
    saved = {k[len("model."):]: v for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and k[len("model."):] not in job.aliases}
    missing = sorted(shapes.keys() - saved.keys())
    unexpected = sorted(saved.keys() - shapes.keys())
    wrong = sorted(k for k in shapes.keys() & saved.keys()
                   if tuple(getattr(saved[k], "size", ())) != shapes[k])
    if not (missing or unexpected or wrong):
        return

    def few(names):
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    notes = []
    if missing:
        notes.append(f"missing from the checkpoint ({len(missing)}): {few(missing)}")
    if unexpected:
        notes.append(f"in the checkpoint but not in this model ({len(unexpected)}): {few(unexpected)}")
    if wrong:
        notes.append(f"different shapes ({len(wrong)}): " + ", ".join(
            f"{k} saved {tuple(saved[k].size)}, here {shapes[k]}" for k in wrong[:5]))
    raise error("checkpoint-mismatch", f"{path} holds another model's parameters than this job's "
                f"({len(missing)} missing, {len(unexpected)} unexpected, {len(wrong)} of another shape)",
                notes=tuple(notes) + (f"it was saved at step {info.get('step')} by strategy "
                                      f"{info.get('strategy')} on mesh {info.get('mesh')}",),
                hint="load a checkpoint of this model (same class and configuration); the strategy and mesh "
                     "may differ. To use some of its weights, convert it with dcp_to_torch_save and load "
                     "them into the model with load_state_dict(strict=False) before compiling")


def _check_optimizer(job, md, path: str, layouts: list[dict]) -> None:
    """The optimizer state this job's optimizer keeps, per parameter, is what was saved."""
    saved: dict[str, set] = {}
    for k in md.state_dict_metadata:
        if k.startswith("optim.state."):
            rest = k[len("optim.state."):]
            name, _, key = rest.rpartition(".")
            saved.setdefault(name, set()).add(key)
    want: dict[str, set] = {}
    for layout in layouts:
        for name, keys in layout.items():
            want.setdefault(name, set()).update(keys)
    bad = sorted(n for n in want if want[n] != saved.get(n, set()))
    if bad:
        name = bad[0]
        raise error("checkpoint-mismatch", f"{path} holds optimizer state {sorted(saved.get(name, ()))} for "
                    f"`{name}`, and this job's optimizer keeps {sorted(want[name])}",
                    notes=(f"{len(bad)} parameter(s) differ",),
                    hint="compile the job with the optimizer the checkpoint was saved with (e.g. AdamW for "
                         "exp_avg/exp_avg_sq); its learning rate and other settings may differ")


def load(job, path) -> dict:
    """Read checkpoint `path` into the running `job`, whatever strategy and mesh wrote it:
    parameters, persistent buffers, optimizer state and the step count. Returns its metadata."""
    job._check_open()
    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path)
    info = read_info(path)
    _check_model(job, md, path, info)
    with_state = any(k.startswith("optim.state.") for k in md.state_dict_metadata)
    layouts = job._get([a.optimizer_layout.remote(with_state) for a in job.actors], "load")
    _check_optimizer(job, md, path, layouts)
    buffers = _persistent_buffers(job)
    job._get([a.load_checkpoint.remote(path, with_state, buffers) for a in job.actors], "load")
    if buffers:                     # the driver's copy, which new workers would start from
        _read_here({"model": {k: job._buffers[k] for k in buffers}}, path)
    loss_scaling.restore(job, info.get("loss_scale"))
    job.steps = int(info["step"])
    if "data_position" in info:
        job.data_position = int(info["data_position"])
    return info


STEP_DIR = re.compile(r"step-(\d+)\Z")


def checkpoints(directory) -> list[tuple[int, str]]:
    """(step, path) of every finished checkpoint `piper run` wrote in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = STEP_DIR.match(name)
        full = os.path.join(directory, name)
        if m and os.path.exists(os.path.join(full, ".metadata")):
            out.append((int(m.group(1)), full))
    return sorted(out)


def save_step(job, directory, keep: int = 2) -> str:
    """Save `job` as `directory/step-N` (N = job.steps), then delete all but the last `keep`.

    The checkpoint is written under a temporary name and renamed once every worker has
    written, so a save cut short never looks like a checkpoint."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"step-{job.steps}")
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    save(job, partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    for _, old in checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# -- `piper run --checkpoint-dir DIR --checkpoint-every N --resume` ----------------------------

def check_run_flags(args) -> str | None:
    """What is wrong with `piper run`'s checkpoint flags together, or None."""
    every, directory = getattr(args, "checkpoint_every", None), getattr(args, "checkpoint_dir", None)
    resuming = getattr(args, "resume", False)
    if every is not None and every < 1:
        return f"--checkpoint-every {every} is not a positive number of steps (write e.g. --checkpoint-every 100)"
    if (every or resuming) and not directory:
        flag = "--checkpoint-every" if every else "--resume"
        return f"{flag} needs --checkpoint-dir DIR, where checkpoints are written and read"
    if directory and not every and not resuming:
        return ("--checkpoint-dir without --checkpoint-every saves nothing (add --checkpoint-every N, "
                "or --resume to start from DIR's last checkpoint)")
    return None


def resume(job, directory, batches, console=None) -> int:
    """Load the last checkpoint in `directory` into `job` and skip the batches it has
    trained on (the data stream is the same whatever stopped the run). Returns its step;
    0, with nothing loaded, when `directory` has none yet."""
    found = checkpoints(directory)
    if not found:
        if console is not None:
            console.print(f"no checkpoint in {directory} yet: starting at step 0")
        return 0
    step, path = found[-1]
    info = load(job, path)
    if console is not None:
        console.print(f"resumed from {path} (step {step}, saved by {info.get('strategy')} on mesh "
                      f"{info.get('mesh')})")
    for _ in range(job.steps):
        next(batches)
    return job.steps


class Every:
    """A job whose `step` saves a checkpoint into `directory` every `every` steps (the last two kept)."""

    def __init__(self, job, directory, every: int):
        self.job, self.directory, self.every = job, directory, every

    def step(self, *batch) -> float:
        loss = self.job.step(*batch)
        if self.job.steps % self.every == 0:
            save_step(self.job, self.directory)
        return loss

    def __getattr__(self, name):          # everything else is the job's
        return getattr(self.job, name)
