"""Suite 13, `checkpoint`: Piper's `job.save` / `job.load` vs FSDP2 + torch.distributed.checkpoint.

Same GPT, ZeRO-3 over dp (Piper's `zero3`, one flat unit per region) against
FSDP2 (`fully_shard` per region, then the root), AdamW with its state after
one step, on 2 (and 4) devices. Both write the same kind of checkpoint: DCP's
FileSystemWriter, model.state_dict() names, AdamW moments per parameter. The
torch side is what its documentation prescribes: `get_state_dict` then
`dcp.save`; `get_state_dict`, `dcp.load`, `set_state_dict`. Times are wall
clock from the driver's call to every worker having finished (what a
training loop waits), medians of alternated repeats; bytes per device are
the sizes of each rank's `__R_*.distcp` files.

A second table prices the safety of `job.save` in the same run, on the same
job: the atomic, checksummed save (a staging directory beside the path, each
data file's CRC-32, `piper.json`, one rename) against the save as it was
(the old files removed, the workers writing in place, no checksums), and
the load's checking (`verify_checkpoint`: every byte's CRC-32 on the driver,
and every non-tensor item read as data) against the whole load.

    python -m benchmarks --suite checkpoint [--quick]
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import statistics
import tempfile
import time
import traceback

import torch

import piper

from ..baselines.torch_group import set_up_group
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, mib, ms, short_error
from ..harness.workloads import GPTWorkload, gpt_batches, make_gpt, n_params, zero_strategy


def workload(quick: bool) -> tuple[GPTWorkload, int]:
    if quick:
        return GPTWorkload(n_layer=2, n_embd=32, n_head=2, block_size=16, batch=8), 2
    return GPTWorkload(n_layer=4, n_embd=256, n_head=4, block_size=64, batch=16), 4


def _fsdp_save(worker, path: str) -> None:
    """On a torch worker: FSDP2's documented checkpoint save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(worker.model, worker.optimizer)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=path)


def _fsdp_load(worker, path: str) -> None:
    """On a torch worker: FSDP2's documented checkpoint load (in place, resharded by DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = get_state_dict(worker.model, worker.optimizer)
    state = {"model": model, "optim": optim}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(worker.model, worker.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _barrier(worker) -> None:
    import torch.distributed as dist

    dist.barrier()


def bytes_per_rank(path: str) -> dict[int, int]:
    """Bytes of the data files each rank wrote (DCP names them __R_N.distcp)."""
    out: dict[int, int] = {}
    for name in os.listdir(path):
        m = re.match(r"__(\d+)_\d+\.distcp\Z", name)
        if m:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + os.path.getsize(os.path.join(path, name))
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _set_up(ctx, n: int, kw: dict, batch, timeout: float) -> tuple[dict, dict]:
    """Both systems on `n` devices, each a step in (AdamW's state exists from the first step):
    ({"piper": job, "torch": group}, {system: error or None})."""
    group, torch_error = set_up_group(ctx, None, n, timeout, "fsdp2", model_kw=kw)
    job, piper_error = None, None
    try:
        strategy, _, _ = zero_strategy("zero3", dp=n)
        job = piper.compile(make_gpt(kw)[0], batch, strategy=strategy, mesh={"dp": n},
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), timeout=timeout,
                            device=ctx.device)
        job.step(*batch)
    except Exception as exc:
        piper_error = f"failed: {short_error(exc)}"
        ctx.log(traceback.format_exc())
    if group is not None:
        try:
            group.step(*batch)
        except Exception as exc:
            torch_error = f"failed: {short_error(exc)}"
            ctx.log(traceback.format_exc())
    return {"piper": job, "torch": group}, {"piper": piper_error, "torch": torch_error}


def _save_and_load(ctx, systems: dict, errors: dict, paths: dict, repeats: int, timeout: float) -> dict:
    """Save and load times per system, the two alternated; a failure is noted in `errors`."""
    import ray

    job, group = systems["piper"], systems["torch"]

    def on_all(fn):
        ray.get([a.__ray_call__.remote(fn, paths["torch"]) for a in group.actors], timeout=timeout)

    def save_and_load(system):
        shutil.rmtree(paths[system], ignore_errors=True)
        if system == "piper":
            return _timed(lambda: job.save(paths["piper"])), _timed(lambda: job.load(paths["piper"]))
        ray.get([a.__ray_call__.remote(_barrier) for a in group.actors], timeout=timeout)
        return _timed(lambda: on_all(_fsdp_save)), _timed(lambda: on_all(_fsdp_load))

    times = {"piper": {"save": [], "load": []}, "torch": {"save": [], "load": []}}
    for _ in range(repeats):
        for system in ("piper", "torch"):
            if errors[system]:
                continue
            try:
                save, load = save_and_load(system)
            except Exception as exc:
                errors[system] = f"failed: {short_error(exc)}"
                ctx.log(traceback.format_exc())
                continue
            times[system]["save"].append(save)
            times[system]["load"].append(load)
    return times


def _save_in_place(job, path: str) -> None:
    """`job.save` as it was before saves were atomic: the old checkpoint's files removed, then
    every worker writes into `path` itself, no checksums."""
    from piper.job import checkpoint

    if os.path.isdir(path):
        for name in os.listdir(path):
            if re.fullmatch(r"\.metadata|__\d+_\d+\.distcp|piper\.json", name):
                os.remove(os.path.join(path, name))
    checkpoint.write(job, path, checksums=False)


def _safety_costs(ctx, job, root: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per repeat of: the save in place, the atomic checksummed save, `verify_checkpoint`
    and `job.load` (which verifies first), the two saves alternated, each over an existing checkpoint."""
    from piper.job.checkpoint import verify_checkpoint

    plain, safe = os.path.join(root, "in-place"), os.path.join(root, "atomic")
    _save_in_place(job, plain)
    job.save(safe)
    times: dict[str, list[float]] = {"in_place": [], "atomic": [], "verify": [], "load": []}
    for _ in range(repeats):
        times["in_place"].append(_timed(lambda: _save_in_place(job, plain)))
        times["atomic"].append(_timed(lambda: job.save(safe)))
        times["verify"].append(_timed(lambda: verify_checkpoint(safe)))
        times["load"].append(_timed(lambda: job.load(safe)))
    return times


def _report_safety(table: Table, result: SuiteResult, n: int, times: dict | None, error: str | None) -> None:
    if error or not times:
        table.add(n, error or "not measured", None, None, None, None, None)
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    table.add(n, ms(med["in_place"]), ms(med["atomic"]), f"{med['atomic'] / med['in_place']:.2f}x",
              ms(med["verify"]), ms(med["load"]), f"{med['verify'] / med['load']:.0%}")
    for key, value in med.items():
        result.metrics[f"piper.dp{n}.safety.{key}_ms"] = ms(value)


def _report(table: Table, result: SuiteResult, n: int, paths: dict, times: dict, errors: dict) -> None:
    for system, label in (("piper", f"Piper zero3 (dp={n})"), ("torch", f"FSDP2 + DCP (dp={n})")):
        if errors[system]:
            table.add(n, label, errors[system], None, None, None, None)
            continue
        per_rank = bytes_per_rank(paths[system])
        save, load = (statistics.median(times[system][k]) for k in ("save", "load"))
        spread = f"{mib(min(per_rank.values())):.3f}-{mib(max(per_rank.values())):.3f}"
        table.add(n, label, ms(save), ms(load), spread, mib(sum(per_rank.values())), len(per_rank))
        key = f"{system}.dp{n}"
        result.metrics[f"{key}.save_ms"] = ms(save)
        result.metrics[f"{key}.load_ms"] = ms(load)
        result.metrics[f"{key}.max_bytes_per_device"] = float(max(per_rank.values()))
        result.metrics[f"{key}.total_bytes"] = float(sum(per_rank.values()))


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    wl, regions = workload(quick)
    devices = (2,) if quick else (2, 4)
    repeats = 2 if quick else 5
    timeout = 180.0
    kw = wl.model_kw(regions)
    batch = gpt_batches(wl, 1)[0]
    model, _ = make_gpt(kw)
    state_bytes = n_params(model) * model.wte.weight.element_size() * 3     # parameters + two AdamW moments
    result = SuiteResult("checkpoint", 13, "Checkpoint save and load vs FSDP2 + DCP", ctx.command("checkpoint"))
    table = Table(f"Save and load of parameters + AdamW state ({mib(state_bytes):.2f} MiB in all), median of "
                  f"{repeats} alternated repeats; {wl.describe(regions)}; ZeRO-3 / FSDP2 over dp",
                  ["devices", "system", "save ms", "load ms", "MiB per device (min-max)", "MiB written in all",
                   "files"])
    safety = Table(f"What an atomic, checksummed job.save and a verified job.load cost (Piper zero3, same job, "
                   f"same run, median of {3 * repeats} alternated repeats, over an existing checkpoint)",
                   ["devices", "save in place ms", "atomic + CRC-32 save ms", "ratio", "verify ms",
                    "load ms (verify included)", "verify / load"])
    root = tempfile.mkdtemp(prefix="piper-bench-ckpt-")
    try:
        with ray_cluster():
            for n in devices:
                unhosted = ctx.cannot_host(n)
                if unhosted:
                    table.add(n, "both", unhosted, None, None, None, None)
                    continue
                ctx.log(f"checkpoint: Piper zero3 vs FSDP2 + DCP on {n} devices")
                systems, errors = _set_up(ctx, n, kw, batch, timeout)
                paths = {"piper": os.path.join(root, f"piper-{n}"), "torch": os.path.join(root, f"torch-{n}")}
                try:
                    times = _save_and_load(ctx, systems, errors, paths, repeats, timeout)
                    _report(table, result, n, paths, times, errors)
                    costs, why = None, errors["piper"]
                    if not why:
                        try:
                            costs = _safety_costs(ctx, systems["piper"], os.path.join(root, f"safety-{n}"),
                                                  3 * repeats)
                        except Exception as exc:
                            why = f"failed: {short_error(exc)}"
                            ctx.log(traceback.format_exc())
                    _report_safety(safety, result, n, costs, why)
                finally:
                    for closeable in systems.values():
                        if closeable is not None:
                            closeable.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table.notes += [
        "Measured on a loaded, shared machine (other work ran at the same time): compare the two rows of one "
        "run, not times across runs.",
        "Piper: job.save / job.load (piper/job/checkpoint.py); each worker describes the part of every parameter "
        "its flat ZeRO shard covers as a few contiguous boxes and DCP writes them as they lie, so nothing is "
        "gathered or copied first. Its load also checks names, shapes and optimizer state on the driver first "
        "(one more round trip to the workers).",
        "FSDP2: get_state_dict + dcp.save; get_state_dict + dcp.load + set_state_dict "
        "(torch.distributed.checkpoint.state_dict), on the same Gloo process group.",
        "Bytes above the parameters + moments come from each file's per-tensor torch.save headers and the "
        "AdamW step counts (one per parameter on both sides).",
    ]
    result.tables.append(table)
    safety.notes += [
        "Save in place: what job.save did before (the old files removed first, so a save cut short left no "
        "checkpoint). Atomic: written into a sibling directory, each worker's data files' CRC-32 computed "
        "after writing (read back from the page cache), .metadata's on the driver, piper.json written and "
        "flushed, then one renameat2(RENAME_EXCHANGE) and the old directory removed.",
        "verify: verify_checkpoint (every file's CRC-32 on the driver, files in parallel, every non-tensor item "
        "read with weights_only=True), which job.load runs before any worker reads.",
    ]
    result.tables.append(safety)
    return result
