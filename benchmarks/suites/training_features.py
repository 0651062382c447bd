"""Suite 14, `training-features`: mixed precision and activation recomputation.

(a) The example GPT under ZeRO-3 x 1F1B on dp=2 x pp=2, Piper alone: fp32 against
    `precision="bf16"`, and without and with `recompute PP=*`. Step time
    (median wall clock, and the busiest worker's CPU seconds per step, which
    a loaded machine disturbs less) and peak bytes per device (`job.memory()`:
    `step_peak`, parameters + gradients + optimizer state + saved activations
    at their in-step high-water mark, and `activations_peak`).
(b) The same features side by side with FSDP2 on dp=2, Piper `zero3`:
    `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` against
    `precision="bf16"`, and torch.utils.checkpoint around every block against
    `recompute PP=*`. Step times A/B alternated; ratio = torch / Piper.
(c), (d) The same two comparisons for a Hugging Face `LlamaForCausalLM` as the
    library wrote it (tiny config, no download; `benchmarks.harness.workloads.make_hf`,
    cut into stages and blocks by `piper.annotate_modules`); (d) fp32 and bf16
    only, FSDP2 with one unit per decoder block. Skipped, with the reason in the
    table, where `transformers` is not installed.
(e), (f) ZeRO-3 x 1F1B on dp=2 x pp=2 side by side with FSDP2 x torch pipelining
    on the same 4 processes (`benchmarks/baselines/composed.py`: each stage `fully_shard`
    over its dp group, `MixedPrecisionPolicy(bf16, reduce fp32)` for bf16,
    `checkpoint_wrapper` per block for recompute, `Schedule1F1B`), for the GPT
    and the Llama: step times A/B alternated, and peak bytes per device in one
    further step measured the same way on both sides (`probes.install_step_peak`:
    state held between steps plus the rise of the resident high-water mark).

On CPU, bf16 matmuls are not faster than fp32 ones (no AMX on most CPUs, and
casts cost extra), so the step-time column shows what 16 bits cost here, not
what they save on a GPU; the bytes are what carries over.

    python -m benchmarks --suite training-features [--quick]
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import statistics
import time
import traceback

import torch

import piper
from piper.dsl.script import load_strategy

from ..baselines.torch_group import set_up_group
from ..harness import probes
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, compile_or_failure, mib, ms, short_error
from ..harness.timing import Timings, alternate, head_to_head
from ..harness.workloads import GPTWorkload, HFWorkload, gpt_batches, make_gpt, make_hf

VARIANTS = (("fp32", "fp32", False), ("bf16", "bf16", False), ("fp32 + recompute", "fp32", True),
            ("bf16 + recompute", "bf16", True))


def workload(quick: bool) -> GPTWorkload:
    if quick:
        return GPTWorkload(n_layer=4, n_embd=64, n_head=2, block_size=32, batch=16)
    return GPTWorkload(n_layer=4, n_embd=128, n_head=4, block_size=64, batch=32)


def hf_workload(quick: bool) -> HFWorkload:
    if quick:
        return HFWorkload(family="llama", layers=4, hidden=64, heads=4, batch=16)
    return HFWorkload(family="llama", layers=4, hidden=128, heads=4, batch=32)


def _strategy(text: str, recompute: bool):
    return load_strategy(text + ("recompute PP=*\n" if recompute else ""))


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    wl = workload(quick)
    warmup, steps = (1, 3) if quick else (2, 8)
    batches = gpt_batches(wl, warmup + steps)
    result = SuiteResult("training-features", 14, "Mixed precision and recomputation", ctx.command("training-features"))
    gpt_model = functools.partial(make_gpt, wl.model_kw(2))
    hf = _hf_inputs(quick, warmup + steps)
    with ray_cluster():
        result.tables.append(_pipeline_table(ctx, result, "(a)", wl.describe(2), gpt_model, batches, warmup,
                                             steps, "pp"))
        result.tables.append(_fsdp_table(ctx, result, "(b)", wl.describe(2), gpt_model, batches, warmup, steps,
                                         "fsdp", {"model_kw": wl.model_kw(2)}))
        result.tables.append(_composed_table(ctx, result, "(e)", wl.describe(2), gpt_model, batches, warmup, steps,
                                             "composed", {"model_kw": wl.model_kw(2)}))
        if isinstance(hf, str):
            result.tables.append(_skipped("(c), (d), (f) Hugging Face Llama", hf))
        else:
            hwl, hf_batches = hf
            result.tables.append(_pipeline_table(ctx, result, "(c)", hwl.describe(2), lambda: make_hf(hwl, 2),
                                                 hf_batches, warmup, steps, "hf_pp"))
            result.tables.append(_fsdp_table(ctx, result, "(d)", hwl.describe(2), lambda: make_hf(hwl, 2),
                                             hf_batches, warmup, steps, "hf_fsdp",
                                             {"model": "hf", "model_kw": {**dataclasses.asdict(hwl), "stages": 2}},
                                             rows=FSDP_ROWS[:2]))
            result.tables.append(_composed_table(ctx, result, "(f)", hwl.describe(2), lambda: make_hf(hwl, 2),
                                                 hf_batches, warmup, steps, "hf_composed",
                                                 {"model": "hf", "model_kw": {**dataclasses.asdict(hwl), "stages": 2}}))
    return result


def _hf_inputs(quick: bool, count: int):
    """(workload, batches) for the Llama tables, or why they cannot run."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install -e '.[test]')"
    from examples.gpt import training_batches          # the stream make_hf returns

    hwl = hf_workload(quick)
    stream = training_batches(hwl.batch)
    return hwl, [next(stream) for _ in range(count)]


def _skipped(title: str, why: str) -> Table:
    table = Table(title, ["variant", "result"])
    table.add("all", f"skipped: {why}")
    return table


def _pipeline_table(ctx, result, tag, described, make_model, batches, warmup, steps, prefix) -> Table:
    microbatches = 4
    text = f"use one_f_one_b(microbatches={microbatches}) on pp\nuse zero3() on dp\n"
    table = Table(f"{tag} ZeRO-3 x 1F1B, dp=2 x pp=2, {microbatches} microbatches; {described}; "
                  f"median of {steps} steps after {warmup} warm-up; bytes: the largest over the 4 devices",
                  ["variant", "step ms", "busiest CPU ms/step", "step_peak MiB", "activations_peak MiB",
                   "step_peak vs fp32", "final loss"])
    model, _ = make_model()
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    base = None
    unhosted = ctx.cannot_host(4)
    for label, precision, recompute in VARIANTS:
        if unhosted:
            table.add(label, unhosted, *[None] * 5)
            continue
        ctx.log(f"training-features: {tag} ZeRO-3 x 1F1B, {label}")
        try:
            with piper.compile(model, batches[0], strategy=_strategy(text, recompute), mesh={"dp": 2, "pp": 2},
                               optimizer=optimizer, timeout=300, precision=precision, device=ctx.device) as job:
                times, cpu, losses = [], [], []
                for i, batch in enumerate(batches):
                    t0 = time.perf_counter()
                    losses.append(job.step(*batch))
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
                        cpu.append(max(t["step"] for t in job.timings(cpu=True).values()))
                memory = job.memory()
        except Exception as exc:
            ctx.log(traceback.format_exc())
            table.add(label, f"failed: {short_error(exc)}", *[None] * 5)
            continue
        step_ms, cpu_ms = ms(statistics.median(times)), ms(statistics.median(cpu))
        peak = max(m["step_peak"] for m in memory.values())
        acts = max(m["activations_peak"] for m in memory.values())
        base = peak if label == "fp32" else base
        table.add(label, step_ms, cpu_ms, mib(peak), mib(acts), f"{peak / base:.2f}x" if base else None,
                  losses[-1])
        key = label.replace(" + ", "_")
        result.metrics.update({f"{prefix}_{key}_step_ms": step_ms, f"{prefix}_{key}_cpu_ms": cpu_ms,
                               f"{prefix}_{key}_step_peak": float(peak),
                               f"{prefix}_{key}_activations_peak": float(acts)})
    table.notes.append("CPU ms/step: the busiest worker process's CPU seconds in a step (every thread), "
                       "from job.timings(cpu=True)['step'].")
    return table


FSDP_ROWS = (("fp32", "fp32", False, "fully_shard"),
             ("bf16", "bf16", False, "MixedPrecisionPolicy(bf16, reduce fp32)"),
             ("fp32 + recompute", "fp32", True, "checkpoint_wrapper per block"))


def _fsdp_table(ctx, result, tag, described, make_model, batches, warmup, steps, prefix, torch_kw,
                rows=FSDP_ROWS) -> Table:
    table = Table(f"{tag} Piper zero3 vs FSDP2 fully_shard, dp=2; {described}; median of {steps} steps after "
                  f"{warmup} warm-up, A/B alternated",
                  ["variant", "torch", "torch ms", "Piper ms", "ratio torch/Piper", "paired ratios, middle half",
                   "spread torch", "spread Piper", "max |Δloss|", "Piper step_peak MiB"])
    model, _ = make_model()
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    group = None
    unhosted = ctx.cannot_host(2)
    for label, precision, recompute, torch_label in rows:
        if unhosted:
            table.add(label, torch_label, unhosted, unhosted, *[None] * 6)
            continue
        ctx.log(f"training-features: {tag} zero3 vs FSDP2, {label}")
        group, torch_error = set_up_group(ctx, group, 2, 120.0, "fsdp2", precision=precision,
                                          checkpoint=recompute, **torch_kw)
        job, piper_error, peak = None, None, None
        try:
            job = piper.compile(model, batches[0], strategy=_strategy("use zero3() on dp\n", recompute),
                                mesh={"dp": 2}, optimizer=optimizer, timeout=120, precision=precision,
                                device=ctx.device)
        except Exception as exc:
            ctx.log(traceback.format_exc())
            piper_error = f"failed: {short_error(exc)}"
        if job is not None:
            step, calls = job.step, []

            def measured(x, y, step=step, job=job):
                nonlocal peak
                loss = step(x, y)
                calls.append(1)
                if len(calls) == len(batches):       # after the last step only: one step's median input
                    peak = max(m["step_peak"] for m in job.memory().values())
                return loss
            job.step = measured
        h2h = head_to_head(group, job, batches, warmup=warmup, steps=steps, torch_error=torch_error,
                           piper_error=piper_error)
        group = h2h.group
        table.add(label, torch_label, *h2h.cells, mib(peak))
        key = label.replace(" + ", "_")
        result.metrics.update({f"{prefix}_{key}_{name}": value for name, value in h2h.metrics()})
    if group is not None:
        group.close()
    table.notes.append("Piper's last step also reads job.memory() (one round trip to each worker); the median "
                       "step time leaves it out.")
    return table


COMPOSED_TORCH = {False: "fully_shard per block + stage", True: "+ checkpoint_wrapper per block"}
COMPOSED_NOTES = [
    "ratio > 1: Piper's step is faster; peak torch/Piper > 1: Piper's device holds fewer bytes at its peak.",
    "peak: the same probe on both sides (`benchmarks/harness/probes.py::install_step_peak`): the bytes of "
    "parameters, gradients and optimizer state a process holds between steps, plus how far its resident "
    "memory rose in one step (the kernel's VmHWM, reset just before, less the resident set after a "
    "collection and malloc_trim): saved activations, gathered parameters, communication buffers and "
    "autograd's temporaries alike. Piper step_peak: Piper's own accounting (job.memory(), sampled between "
    "actions, so without temporaries inside an op).",
    "torch: FSDP2 reshard_after_forward=False (torchtitan's default under pipelining: parameters stay "
    "gathered over a step's microbatches); Piper's zero3 gathers a region's parameters before a run of "
    "computes that use them and frees them after the run (stdlib/zero3.pps). Both reduce gradients in "
    "float32 under bf16.",
]


def _composed_table(ctx, result, tag, described, make_model, batches, warmup, steps, prefix, torch_kw) -> Table:
    """Piper ZeRO-3 x 1F1B against FSDP2 x Schedule1F1B on dp=2 x pp=2, every variant of VARIANTS."""
    microbatches = 4
    text = f"use one_f_one_b(microbatches={microbatches}) on pp\nuse zero3() on dp\n"
    table = Table(f"{tag} Piper ZeRO-3 x 1F1B vs FSDP2 x torch Schedule1F1B, dp=2 x pp=2, {microbatches} "
                  f"microbatches; {described}; median of {steps} steps after {warmup} warm-up, A/B alternated; "
                  "peak: one further step, the largest over the 4 devices",
                  ["variant", "torch", "torch ms", "Piper ms", "ratio torch/Piper", "paired ratios, middle half",
                   "max |Δloss|", "torch peak MiB", "Piper peak MiB", "peak torch/Piper",
                   "Piper step_peak MiB"])
    model, _ = make_model()
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    group = None
    unhosted = ctx.cannot_host(4)
    for label, precision, recompute in VARIANTS:
        torch_label = ("MixedPrecisionPolicy(bf16, reduce fp32), " if precision == "bf16" else "") + \
            COMPOSED_TORCH[recompute]
        if unhosted:
            table.add(label, torch_label, unhosted, unhosted, *[None] * 7)
            continue
        ctx.log(f"training-features: {tag} ZeRO-3 x 1F1B vs FSDP2 x pipelining, {label}")
        group, torch_error = set_up_group(ctx, group, 4, 180.0, "fsdp2_pipeline", schedule="Schedule1F1B",
                                          microbatches=microbatches, pp=2, precision=precision,
                                          checkpoint=recompute, **torch_kw)
        job, piper_error = compile_or_failure(ctx, lambda: piper.compile(
            model, batches[0], strategy=_strategy(text, recompute), mesh={"dp": 2, "pp": 2}, optimizer=optimizer,
            timeout=180, precision=precision, device=ctx.device))
        run = _composed_run(ctx, group, job, batches, warmup, steps)
        group, torch_error = run.torch_outcome(group, torch_error)
        piper_error = run.piper_outcome(piper_error)
        cells, metrics = run.row(torch_error, piper_error)
        table.add(label, torch_label, *cells)
        key = label.replace(" + ", "_")
        result.metrics.update({f"{prefix}_{key}_{name}": value for name, value in metrics.items()})
    if group is not None:
        group.close()
    table.notes += COMPOSED_NOTES
    return table


@dataclasses.dataclass
class _ComposedRun:
    """One variant of (e)/(f): the alternated steps, then one peak step on each side."""

    timings: Timings | None = None
    peaks: dict = dataclasses.field(default_factory=lambda: {"torch": None, "piper": None})
    own: int | None = None              # Piper's own step_peak accounting of one more step
    peak_error: str | None = None       # Piper's side failed after its timed steps

    def torch_outcome(self, group, torch_error):
        """(the group, torch's error): a group whose step or peak step failed is closed (None)."""
        if self.peaks["torch"] is not None and not isinstance(self.peaks["torch"], int):   # the peak step failed
            torch_error, self.peaks["torch"] = f"peak step failed: {short_error(self.peaks['torch'])}", None
            group.close()
            group = None
        if self.timings is not None and "torch" in self.timings.errors and group is not None:
            torch_error = f"step failed: {short_error(self.timings.errors['torch'])}"
            group.close()
            group = None
        return group, torch_error

    def piper_outcome(self, piper_error):
        """Piper's error: its compile's, else its peak step's, replaced by a timed step's."""
        piper_error = piper_error or self.peak_error
        if self.timings is not None and "piper" in self.timings.errors:
            piper_error = f"step failed: {short_error(self.timings.errors['piper'])}"
        return piper_error

    def row(self, torch_error, piper_error) -> tuple[list, dict[str, float]]:
        """The row's cells after its labels, and its metrics."""
        timings, peaks = self.timings, self.peaks
        t_ms = ms(timings.median("torch")) if timings is not None else None
        p_ms = ms(timings.median("piper")) if timings is not None else None
        paired = timings.paired_ratios("torch", "piper") if timings is not None else []
        q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else None
        gap = timings.max_loss_gap("torch", "piper") if timings is not None else None
        ratio = t_ms / p_ms if t_ms and p_ms else None
        peak_ratio = peaks["torch"] / peaks["piper"] if peaks["torch"] and peaks["piper"] else None
        cells = [t_ms if torch_error is None else torch_error, p_ms if piper_error is None else piper_error,
                 None if ratio is None else f"{ratio:.2f}x", None if q is None else f"{q[0]:.2f} – {q[2]:.2f}",
                 None if gap is None else f"{gap:.1e}", mib(peaks["torch"]), mib(peaks["piper"]),
                 None if peak_ratio is None else f"{peak_ratio:.2f}x", mib(self.own)]
        metrics = {name: float(value) for name, value in (
            ("torch_ms", t_ms), ("piper_ms", p_ms), ("ratio", ratio), ("torch_peak", peaks["torch"]),
            ("piper_peak", peaks["piper"]), ("peak_ratio", peak_ratio)) if value is not None}
        return cells, metrics


def _composed_run(ctx, group, job, batches, warmup, steps) -> _ComposedRun:
    """Alternate torch's and Piper's steps, then one peak step on each side (Piper's own accounting
    of one more); closes the job."""
    systems = {}
    if group is not None:
        systems["torch"] = group.step
    if job is not None:
        systems["piper"] = job.step
    run = _ComposedRun()
    try:
        run.timings = alternate(systems, batches[:warmup + steps], warmup=warmup, steps=steps)
        if "torch" in systems and "torch" not in run.timings.errors:
            run.peaks["torch"] = _torch_peak(group, batches[-1])
        if "piper" in systems and "piper" not in run.timings.errors:
            probes.in_workers(job, probes.install_step_peak)
            job.step(*batches[-1])
            run.peaks["piper"] = max(p for p in probes.in_workers(job, probes.read_step_peak) if p is not None)
            job.step(*batches[-1])                    # untracked: Piper's own accounting of the same step
            run.own = max(m["step_peak"] for m in job.memory().values())
    except Exception as exc:
        ctx.log(traceback.format_exc())
        run.peak_error = f"peak step failed: {short_error(exc)}"
    finally:
        if job is not None:
            job.close()
    return run


def _torch_peak(group, batch):
    """One step of the torch group with the peak probe in every process: the largest peak, or the error."""
    import ray

    try:
        ray.get([a.__ray_call__.remote(probes.install_step_peak_torch) for a in group.actors], timeout=group.timeout)
        group.step(*batch)
        return max(p for p in ray.get([a.__ray_call__.remote(probes.read_step_peak) for a in group.actors],
                                      timeout=group.timeout) if p is not None)
    except Exception as exc:
        return exc
