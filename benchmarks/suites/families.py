"""Suite 9, `families`: model families that are not the example GPT (benchmarks/harness/families.py).

For each family (the nn.MultiheadAttention GPT, an MLP-Mixer, and whatever
`families.register` adds, such as a Hugging Face Llama or a MoE model):

  (a) region compute against eager PyTorch on one device: the whole model as
      one region, captured by `piper.frontend.capture`, shipped and rebuilt as the
      runtime does (`runtime.launch.packed_graphs.pack/unpack`), run with the runtime's
      saved-tensor hook and its parameters as views of one flat buffer whose
      gradients are views of a flat gradient buffer; eager runs the module
      with gradients accumulating likewise. One thread, CPU time of each
      forward and backward, eager and Piper alternated; target within 3%;
  (b) pipeline schedules against torch.distributed.pipelining on 2 and 4
      devices (one region per stage, two per device for interleaved and V
      schedules), alternated step by step, with the paired ratios' middle half;
  (c) the cost model: `simulate` of the 1F1B, GPipe and interleaved jobs' plans
      with the per-action costs their workers recorded and the runtime's own
      costs (`piper.compiler.runtime_costs`) measured on the 1F1B job, against the
      slowest worker's measured `run_step` (target within 10%); the part alone:
      `python -m benchmarks.suites.families --cost-model [--quick] [FAMILY ...]`;
  (d) `piper check` start-up from the command line: a script alone, and 64
      stages x 512 microbatches x dp 8 with ZeRO-3 (`--regions PP=64`).

    python -m benchmarks --suite families [--quick]
"""
from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

import piper

from ..baselines.torch_group import set_up_group
from ..harness.families import FAMILIES
from ..harness.machine import ray_cluster
from ..harness.measured_steps import CORES, Recorder, predict, run_steps
from ..harness.results import SuiteResult, Table, compile_or_failure, short_error
from ..harness.timing import head_to_head
from ..harness.workloads import PIPELINE_SCHEDULES, REPO, schedule_strategy

MICROBATCHES = 8
TARGET_REGION = 0.03
TARGET_COST = 0.10


# -- (a) region compute vs eager ---------------------------------------------------------------------

class _RegionRun:
    """One region graph run the runtime's way (see the module docstring, (a))."""

    def __init__(self, model, batch):
        from piper.frontend.capture import BATCH, BUFFER, PARAM, capture
        from piper.runtime.launch.packed_graphs import pack, unpack

        program = capture(model, batch)
        if len(program.regions) != 1:
            raise ValueError(f"expected one region, captured {len(program.regions)}")
        region = program.regions[0]
        self.graph = unpack(pack(region.graph), torch.device("cpu"))
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        names = [i.ref for i in region.inputs if i.kind == PARAM]
        flat = torch.cat([params[n].detach().reshape(-1) for n in names])
        self.flat_grad = torch.zeros_like(flat)
        views, offset = {}, 0
        for n in names:
            shape, numel = params[n].shape, params[n].numel()
            view = flat[offset:offset + numel].view(shape).requires_grad_()
            view.grad = self.flat_grad[offset:offset + numel].view(shape)
            views[n], offset = view, offset + numel
        self.args = [views[i.ref] if i.kind == PARAM else buffers[i.ref] if i.kind == BUFFER else batch[i.ref]
                     for i in region.inputs]
        assert all(i.kind in (PARAM, BUFFER, BATCH) for i in region.inputs)

    def forward(self):
        from piper.compiler.saved import SavedBytes

        with torch.enable_grad(), SavedBytes():
            return self.graph(*self.args)[-1]


def region_vs_eager(family, cfg: dict, reps: int) -> dict:
    """Median CPU ms of forward and backward, eager and Piper, alternated (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = family.make(cfg, regions=1)
        batch = family.batches(cfg, 1)[0]
        run = _RegionRun(model, batch)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)        # accumulate, as the runtime's flat gradient buffer does
        systems = {"eager": lambda: model(*batch), "piper": run.forward}
        cpu = {name: {"F": [], "B": []} for name in systems}
        losses = {}
        for i in range(reps + 2):                # 2 warm-up rounds
            for name, forward in systems.items():
                t0 = time.process_time()
                loss = forward()
                t1 = time.process_time()
                loss.backward()
                t2 = time.process_time()
                losses[name] = float(loss.detach())
                if i >= 2:
                    cpu[name]["F"].append(t1 - t0)
                    cpu[name]["B"].append(t2 - t1)
        out = {f"{name}_{p}_ms": statistics.median(v) * 1e3 for name, d in cpu.items() for p, v in d.items()}
        out["loss_gap"] = abs(losses["eager"] - losses["piper"])
        return out
    finally:
        torch.set_num_threads(threads)


# -- (c) the cost model --------------------------------------------------------------------------------

COST_SCHEDULES = ("1f1b", "gpipe", "interleaved")     # the runtime's overheads measured on the first


def cost_model_point(job, batches, *, warmup: int, steps: int, reference=None) -> dict:
    """Predicted vs measured step of `job` (see the suite's cost table notes):

    - `cpu`: per-action CPU costs on the machine's shared cores, as suite 8 (the runtime's own work
      only as background CPU competing for the cores);
    - `cpu_runtime`: the same plus the runtime's own costs (`piper.compiler.runtime_costs.RuntimeModel`: its
      CPU time per action and per step, the devices' start skews, the latency of a message);
    - `cpu_runtime_free`: that on the cores other processes left the job (the machine's cores less
      `external_cores`, at least 1);
    - `wall_runtime`: per-action wall-clock costs plus the runtime's own wall-clock costs.

    `reference`: (wall, cpu) `RuntimeModel`s measured on another job (another schedule) to use instead
    of this job's own; the models used come back as `models`."""
    rec = Recorder(job)
    errors = run_steps({"piper": rec}, batches, warmup=warmup, steps=steps)
    if errors:
        raise errors["piper"]
    data = rec.data
    wall_model, cpu_model = reference or (data.runtime(), data.runtime(cpu=True))
    cpu_costs, other = data.costs(cpu=True), data.external_cores() or 0.0
    out = {"measured_ms": data.step * 1e3, "run_step_ms": data.worker * 1e3, "models": (wall_model, cpu_model),
           "external_cores": other, "stretch": data.stretch()}
    sims = {"cpu": predict(job, cpu_costs, cores=CORES, background=data.background()),
            "cpu_runtime": predict(job, cpu_costs, cores=CORES, background=data.other_threads(), runtime=cpu_model),
            "cpu_runtime_free": predict(job, cpu_costs, cores=max(1.0, CORES - other),
                                        background=data.other_threads(), runtime=cpu_model),
            "wall_runtime": predict(job, data.costs(), runtime=wall_model)}
    for name, sim in sims.items():
        out[f"{name}_ms"] = sim.step_time * 1e3
        out[f"{name}_error"] = sim.step_time / data.worker - 1
    return out


def describe_models(wall, cpu) -> str:
    """One line on the runtime models measured on 1F1B (wall / CPU)."""
    ops = sorted(set(wall.per_op) | set(cpu.per_op))
    return ("the runtime's own costs measured on 1F1B (wall / CPU), µs per action: "
            + ", ".join(f"{op} {wall.per_action(op) * 1e6:.0f} / {cpu.per_action(op) * 1e6:.0f}" for op in ops)
            + f"; per step: start {wall.start * 1e6:.0f} / {cpu.start * 1e6:.0f}, end {wall.end * 1e6:.0f} / "
            f"{cpu.end * 1e6:.0f}; devices' start after the first: "
            + ", ".join(f"{cpu.skew[r] * 1e6:.0f}" for r in sorted(cpu.skew))
            + f"; a message's arrival once both sides were ready (mean): {cpu.latency * 1e6:.0f}.")


def cost_table(families, *, quick: bool, devices: int = 2, log=print, metrics: dict | None = None,
               device: str = "cpu") -> Table:
    """(c) for each family: `cost_model_point` of 1F1B, GPipe and interleaved jobs on `devices`, the
    runtime's own time measured on the 1F1B job and carried to the others. Needs a Ray cluster."""
    metrics = {} if metrics is None else metrics
    warmup, steps = (2, 6) if quick else (2, 8)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    costs = Table(f"Cost model: predicted vs measured step on {devices} devices (median of {steps} steps after "
                  f"{warmup} warm-up); the runtime's own time measured on the 1F1B job; target within 10%",
                  ["family", "schedule", "worker run_step ms", "CPU costs, shared cores", "error",
                   "+ runtime", "error", "+ runtime, cores left", "error", "wall costs + runtime", "error",
                   "other load (cores)", "compute wall/CPU"])
    for family in families:
        cfg = family.quick if quick else family.full
        batches = family.batches(cfg, 4)
        batches = [batches[i % len(batches)] for i in range(warmup + steps)]
        reference = None
        for kind in COST_SCHEDULES:
            log(f"families: {family.name} cost model ({kind}, {devices} devices)")
            try:
                strategy, _, _ = schedule_strategy(kind, pp=devices, microbatches=MICROBATCHES)
                regions = devices * PIPELINE_SCHEDULES[kind][1]
                with piper.compile(family.make(cfg, regions=regions), batches[0], strategy=strategy,
                                   mesh={"pp": devices}, optimizer=optimizer, timeout=120.0, device=device) as job:
                    c = cost_model_point(job, batches, warmup=warmup, steps=steps, reference=reference)
            except Exception as exc:
                costs.add(family.name, kind, f"failed: {short_error(exc)}", *[None] * 10)
                log(traceback.format_exc())
                continue
            reference = reference or c["models"]
            costs.add(family.name, kind, c["run_step_ms"],
                      *[cell for name in ("cpu", "cpu_runtime", "cpu_runtime_free", "wall_runtime")
                        for cell in (c[f"{name}_ms"], f"{c[f'{name}_error']:+.1%}")],
                      c["external_cores"], c["stretch"])
            for name in ("cpu", "cpu_runtime", "cpu_runtime_free", "wall_runtime"):
                metrics[f"{family.name}.cost_model.{kind}.{name}_error"] = c[f"{name}_error"]
            metrics[f"{family.name}.cost_model.{kind}.external_cores"] = c["external_cores"]
            if kind == "1f1b":
                metrics[f"{family.name}.cost_model.error"] = c["cpu_runtime_error"]
                costs.notes.append(f"{family.name}: " + describe_models(*c["models"]))
    costs.notes += [
        "error = predicted / the slowest worker's run_step - 1. 'CPU costs, shared cores': simulate with each "
        "action's CPU seconds (job.timings(cpu=True)) on the machine's cores (as suite 8), the runtime's own work "
        "counted only as background CPU. '+ runtime': plus the runtime's own costs as piper.compiler.runtime_costs."
        "RuntimeModel measures them: its CPU time per action of each op outside the computes and per step "
        "(job.overheads(cpu=True)) on the compute next to it, each device's start after the first's "
        "(job.traced()) on a leading action, and the mean time a message took to arrive once both sides were "
        "ready as the cost of each receive. ', cores left': the same on the cores other processes left the job "
        "(the machine's cores less 'other load', at least 1). 'wall costs + runtime': each action's wall seconds "
        "(job.timings()) and the runtime's wall time outside computes and blocking waits (job.overheads()). "
        "The 1F1B row uses its own runtime model; GPipe and interleaved use the one measured on 1F1B (a "
        "cross-check: per-op costs carried to another plan).",
        "other load: cores other processes kept busy during the timed steps (the machine's busy CPU less the "
        "job's workers and driver; Ray's daemons count here); compute wall/CPU: the actions' wall over CPU "
        "seconds, above 1 where a device waited for a core.",
    ]
    return costs


# -- (d) piper check start-up ----------------------------------------------------------------------

BIG_SCRIPT = "mesh dp=8, pp=64\nuse one_f_one_b(microbatches=512) on pp\nuse zero3() on dp\n"


def check_startup(args: list[str], reps: int) -> dict:
    """Median wall and CPU (user + sys) seconds of `python -m piper.cli check ARGS`, each run in a
    fresh process (its own rusage from wait4; not its ru_maxrss, which Linux carries over from the
    forked copy of this process across exec)."""
    walls, cpus = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "piper.cli", "check", *args], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        walls.append(time.perf_counter() - t0)
        cpus.append(usage.ru_utime + usage.ru_stime)
        if proc.returncode != 0:
            raise RuntimeError(f"piper check exited {proc.returncode}: {err.strip()[-300:]}")
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


# -- the suite -----------------------------------------------------------------------------------------

def _region_table(ctx, families, quick: bool, result) -> Table:
    """(a): each family's region forward and backward against eager."""
    reps = 5 if quick else 15
    region = Table(f"Region forward/backward vs eager, one device, one thread (median CPU ms of {reps}, "
                   "alternated); ratio eager/Piper (> 1: Piper faster), target within 3%",
                   ["family", "model", "eager F", "Piper F", "F ratio", "eager B", "Piper B", "B ratio",
                    "|Δloss|"])
    for family in families:
        cfg = family.quick if quick else family.full
        ctx.log(f"families: {family.name} region vs eager")
        try:
            r = region_vs_eager(family, cfg, reps)
        except Exception as exc:
            region.add(family.name, family.describe(cfg), f"failed: {short_error(exc)}", *[None] * 6)
            ctx.log(traceback.format_exc())
            continue
        f_ratio, b_ratio = r["eager_F_ms"] / r["piper_F_ms"], r["eager_B_ms"] / r["piper_B_ms"]
        region.add(family.name, family.describe(cfg), r["eager_F_ms"], r["piper_F_ms"], f"{f_ratio:.3f}x",
                   r["eager_B_ms"], r["piper_B_ms"], f"{b_ratio:.3f}x", f"{r['loss_gap']:.1e}")
        result.metrics[f"{family.name}.region.F_ratio"] = f_ratio
        result.metrics[f"{family.name}.region.B_ratio"] = b_ratio
    region.notes.append("Piper: the model captured as one region (piper.frontend.capture), packed and rebuilt as "
                        "workers do, run under the runtime's saved-tensor hook with flat-buffer parameter "
                        "views and gradients accumulating into a flat buffer; eager: the module itself, "
                        "gradients accumulating into preallocated .grad.")
    return region


def _pipeline_tables(ctx, families, quick: bool, result) -> tuple[Table, Table]:
    """(b) and (c): every schedule against torch's on each family, then the cost model."""
    devices = (2,) if quick else (2, 4)
    kinds = ("gpipe", "1f1b") if quick else tuple(PIPELINE_SCHEDULES)
    warmup, steps = (1, 2) if quick else (2, 8)
    timeout = 120.0
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    pipes = Table(f"Pipeline schedules vs torch (median of {steps} steps after {warmup} warm-up, A/B alternated), "
                  f"{MICROBATCHES} microbatches; ratio torch/Piper (> 1: Piper faster)",
                  ["family", "devices", "torch schedule", "Piper strategy", "torch ms", "Piper ms",
                   "ratio torch/Piper", "paired ratios, middle half", "spread torch", "spread Piper",
                   "max |Δloss|"])
    with ray_cluster():
        for family in families:
            cfg = family.quick if quick else family.full
            batches = family.batches(cfg, warmup + steps + 4)
            for p in devices:
                group = None
                for kind in kinds:
                    torch_name, per_rank = PIPELINE_SCHEDULES[kind]
                    regions = p * per_rank
                    ctx.log(f"families: {family.name} {torch_name} vs Piper on {p} devices")
                    group, torch_error = set_up_group(ctx, group, p, timeout, "pipeline", schedule=torch_name,
                                                      model=f"family:{family.name}",
                                                      model_kw={"cfg": cfg, "regions": regions},
                                                      microbatches=MICROBATCHES)
                    strategy, source, _ = schedule_strategy(kind, pp=p, microbatches=MICROBATCHES)
                    job, piper_error = compile_or_failure(ctx, lambda: piper.compile(
                        family.make(cfg, regions=regions), batches[0], strategy=strategy, mesh={"pp": p},
                        optimizer=optimizer, timeout=timeout, device=ctx.device))
                    race = head_to_head(group, job, batches, warmup=warmup, steps=steps, torch_error=torch_error,
                                        piper_error=piper_error)
                    group = race.group
                    pipes.add(family.name, p, torch_name.removeprefix("Schedule"), source, *race.cells)
                    for name, value in race.metrics():
                        result.metrics[f"{family.name}.{kind}.pp{p}.{name}"] = value
                if group is not None:
                    group.close()
        costs = cost_table(families, quick=quick, devices=devices[0], log=ctx.log, metrics=result.metrics,
                           device=ctx.device)
    pipes.notes.append("torch: PipelineStage per stage module (families.Stage: the model's own region code and "
                       "submodules), loss_fn the family's loss; Piper: the same model captured with its "
                       "piper.frontend.annotate regions, the stdlib schedule named in the row.")
    return pipes, costs


def _check_table(ctx, result) -> Table:
    """(d): `piper check` from the command line."""
    reps_check = 3
    check = Table(f"`piper check` from the command line, a fresh process each (median of {reps_check})",
                  ["case", "wall s", "CPU s (user + sys)"])
    with tempfile.TemporaryDirectory() as tmp:
        big = os.path.join(tmp, "pp64_mb512_dp8.pps")
        with open(big, "w", encoding="utf-8") as f:
            f.write(BIG_SCRIPT)
        for key, name, args in (
                ("script", "examples/gpt_zero3_1f1b.pps alone", ["examples/gpt_zero3_1f1b.pps"]),
                ("regions", "... --regions PP=2", ["examples/gpt_zero3_1f1b.pps", "--regions", "PP=2"]),
                ("pp64_mb512_dp8", "dp=8 pp=64, 1F1B 512 mb, zero3, --regions PP=64", [big, "--regions", "PP=64"])):
            ctx.log(f"families: piper check {name}")
            try:
                r = check_startup(args, reps_check)
            except Exception as exc:
                check.add(name, f"failed: {short_error(exc)}", None)
                continue
            check.add(name, r["wall_s"], r["cpu_s"])
            result.metrics[f"check.{key}.cpu_s"] = r["cpu_s"]
    check.notes.append("targets: under 0.3 s for a script alone, under 1 s for the 64 x 512 x dp 8 case; "
                       "CPU time is the steadier measure on a shared machine.")
    return check


def run(ctx) -> SuiteResult:
    result = SuiteResult("families", 9, "Model families beyond the example GPT: region compute, pipelines, "
                         "cost model, piper check start-up", ctx.command("families"))
    families = list(FAMILIES.values())
    result.tables.append(_region_table(ctx, families, ctx.quick, result))
    result.tables += _pipeline_tables(ctx, families, ctx.quick, result)
    result.tables.append(_check_table(ctx, result))
    return result


if __name__ == "__main__":
    # The cost-model part alone: python -m benchmarks.suites.families --cost-model [--quick] [FAMILY ...]
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.families")
    parser.add_argument("--cost-model", action="store_true", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("families", nargs="*", default=sorted(FAMILIES))
    args = parser.parse_args()
    with ray_cluster():
        table = cost_table([FAMILIES[n] for n in args.families], quick=args.quick,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"**{table.title}**\n\n| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns))
    for row in table.rows:
        print("| " + " | ".join(row) + " |")
    print("\n" + "\n".join(f"- {n}" for n in table.notes))
