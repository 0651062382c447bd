"""Suite 4, `batch-composition`: how much bigger a microbatch fits in the same
per-device memory budget when ZeRO is composed with a pipeline.

The Piper paper's claim: composing ZeRO with pipeline parallelism fits 3-8x
bigger microbatches. On a dp=2 x pp=2 mesh with 1F1B (4 microbatches), for
pp x dp, pp x zero2 and pp x zero3, real runs find the largest microbatch
(in sequences) for which

    max over ranks of (params + grads + optimizer + activations_peak) <= B

with every term taken from `job.memory()` after one step: the first three are
the bytes held between steps, `activations_peak` the most bytes saved for
backward at once during the step (the runtime counts them with
saved_tensors_hooks). The budget B is enforced by this byte accounting, not
by an out-of-memory failure: the devices are CPU processes with plenty of RAM.

The model is wide with a short context (parameter state dominates at small
batch), so sharding the state is what frees room for activations. Each block
is its own region inside its stage (`layer_regions`): a region is ZeRO's unit,
so ZeRO-3 gathers one block at a time, as FSDP wraps each layer.

    python -m benchmarks --suite batch-composition
"""
from __future__ import annotations

import dataclasses
import functools
import math
import traceback

import torch

import piper
from piper.dsl import load_strategy

from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, mib, short_error
from ..harness.workloads import GPTWorkload, gpt_batches, make_gpt, n_params

MESH = {"dp": 2, "pp": 2}
MICROBATCHES = 4
LEVELS = ("dp", "zero2", "zero3")
QUICK_LEVELS = ("dp", "zero3")
STAGE_ZERO3 = "zero3_stages"  # ZeRO-3 on the model annotated with one region per stage
HEADROOM = 1.10          # B = HEADROOM x the model state pp x dp keeps on its fullest device
CAP = 512                # stop doubling here (sequences per microbatch)


def workload(quick: bool) -> GPTWorkload:
    """The model; `batch` is unused (each probe sets its own)."""
    if quick:
        return GPTWorkload(n_layer=4, n_embd=64, n_head=4, block_size=8, batch=8)
    return GPTWorkload(n_layer=8, n_embd=256, n_head=8, block_size=8, batch=8)


def script(level: str) -> str:
    return (f"mesh dp={MESH['dp']}, pp={MESH['pp']}\n"
            f"use one_f_one_b(microbatches={MICROBATCHES}) on pp\n"
            f"use {level}() on dp\n")


class Probe:
    """Real runs of one strategy: compile for microbatch size `b`, take two steps, read job.memory()
    and the in-step high-water mark (its `step_peak`)."""

    def __init__(self, ctx, wl: GPTWorkload, level: str, optimizer, *, layered: bool = True):
        self.ctx, self.wl, self.level, self.optimizer = ctx, wl, level, optimizer
        self.kw = dict(wl.model_kw(MESH["pp"]), layer_regions=layered)
        self.layered = layered
        self.runs: dict[int, dict[int, dict[str, int]]] = {}     # b -> rank -> job.memory()

    def measure(self, b: int) -> dict[int, dict[str, int]]:
        if b not in self.runs:
            global_batch = b * MICROBATCHES * MESH["dp"]
            wl = dataclasses.replace(self.wl, batch=global_batch)
            batch = gpt_batches(wl, 1)[0]
            self.ctx.log(f"batch-composition: pp x {self.level}{'' if self.layered else ' (stage regions)'}, "
                         f"microbatch {b} (global batch {global_batch})")
            with piper.compile(make_gpt(self.kw)[0], batch, strategy=load_strategy(script(self.level)),
                               optimizer=self.optimizer, timeout=180) as job:
                job.step(*batch)      # the first step creates the optimizer state; measure the second
                job.step(*batch)
                memory = job.memory()
                self.runs[b] = memory
        return self.runs[b]

    @staticmethod
    def state(m: dict[str, int]) -> int:
        return m["params"] + m["grads"] + m["optimizer"]

    @staticmethod
    def value(m: dict[str, int], metric: str) -> int:
        return m["step_peak"] if metric == "in_step" else Probe.state(m) + m["activations_peak"]

    def total(self, b: int, metric: str = "memory") -> int:
        return max(self.value(m, metric) for m in self.runs[b].values())

    def predict(self, budget: float, metric: str = "memory") -> int | None:
        """The largest b the runs allow if saved activations grow linearly in b (from the largest run)."""
        if not self.runs:
            return None
        b = max(self.runs)
        best = None
        for m in self.runs[b].values():
            per = m["activations_peak"] / b
            fixed = self.value(m, metric) - m["activations_peak"]
            fit = math.floor((budget - fixed) / per) if per > 0 else CAP
            best = fit if best is None else min(best, fit)
        return max(0, best)


def largest(probe: Probe, budget: float, metric: str = "memory") -> tuple[int, list[tuple[int, bool]]]:
    """The largest microbatch that fits, by real runs: start at 1; then try what the runs so far
    predict (activations grow linearly in b), else double (no failure yet) or bisect."""
    lo, hi = 0, None          # lo: largest size known to fit (0: none); hi: smallest known not to fit
    tried: list[tuple[int, bool]] = []
    guess = 1
    while True:
        probe.measure(guess)
        ok = probe.total(guess, metric) <= budget
        tried.append((guess, ok))
        if ok:
            lo = max(lo, guess)
        else:
            hi = guess if hi is None else min(hi, guess)
        if (hi is not None and hi - lo <= 1) or lo >= CAP:
            return lo, tried
        done = {b for b, _ in tried}
        p = probe.predict(budget, metric)
        within = lambda x: x > lo and (hi is None or x < hi) and x not in done  # noqa: E731
        if p is not None and within(min(p, CAP)):
            guess = min(p, CAP)
        elif p is not None and within(lo + 1) and p <= lo:
            guess = lo + 1                      # the prediction fit: check the next size fails
        elif hi is None:
            guess = min(lo * 2, CAP)
        else:
            guess = (lo + hi) // 2


def budget_for(headroom: float, state: int) -> int:
    """`headroom` x `state` bytes, rounded up to a multiple of 64 KiB."""
    return math.ceil(headroom * state / 2**16) * 2**16


LARGEST_NOTES = [
    f"B = {HEADROOM:.2f} x the model state (params + grads + AdamW moments) pp x dp keeps on its fullest "
    "device, rounded up to 64 KiB: a device whose memory plain data parallelism fills to ~90% with "
    "model state, leaving room for a small microbatch.",
    "The budget is enforced by the runtime's byte accounting (job.memory(): storages held between steps, "
    "plus activations_peak, the most bytes autograd saved for backward at once during the step, counted by "
    "the runtime with saved_tensors_hooks), not by an out-of-memory failure: the devices are CPU "
    "processes on a machine with plenty of RAM.",
    "Each size is a real run (compile + two steps; the second is measured). The search starts at 1, "
    "then tries the size the runs so far predict (saved activations grow linearly with the microbatch), "
    "then the next size up to show it fails; without a usable prediction it doubles, then bisects. "
    "'total at largest + 1' is the failing run.",
    "The fullest device is pipeline stage 0: 1F1B keeps p = 2 microbatches in flight there (1 on stage 1).",
]


@dataclasses.dataclass
class Search:
    """Every strategy's searches: its probe, the largest microbatch within the budget on `job.memory()`'s
    total (`found`) and on the in-step high-water mark (`found_in`), each with its runs, and failures."""

    probes: dict[str, Probe] = dataclasses.field(default_factory=dict)
    found: dict[str, tuple[int, list]] = dataclasses.field(default_factory=dict)
    found_in: dict[str, tuple[int, list]] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    budget: int | None = None       # set from pp x dp's own state by its first run


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    wl = workload(quick)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    model, _ = make_gpt(wl.model_kw(MESH["pp"]))
    psi = n_params(model)
    result = SuiteResult("batch-composition", 4, "Bigger microbatches by composing ZeRO with a pipeline",
                         ctx.command("batch-composition"))
    desc = (f"GPT n_layer={wl.n_layer} n_embd={wl.n_embd} n_head={wl.n_head} T={wl.block_size}, "
            f"{MESH['pp']} stages, each block its own region, Ψ = {psi:,} parameters, fp32, AdamW")
    with ray_cluster():
        search = _search(ctx, wl, optimizer, quick)
    if search.budget is None:
        result.notes.append(f"pp x dp failed, so no budget could be set: {search.errors.get('dp')}")
        return result
    table, sizes = _largest_table(search, desc, result)
    budget = search.budget
    result.metrics["budget_bytes"] = budget
    if sizes.get("dp") and "zero3" in sizes:
        line = f"zero3 / dp largest microbatch: {sizes['zero3'] / sizes['dp']:.1f}x (target >= 3x)"
        if "zero2" in sizes:
            line += f"; zero2 / dp: {sizes['zero2'] / sizes['dp']:.1f}x"
        result.notes.append(line + f"; budget B = {mib(budget):.1f} MiB per device.")
    result.tables.append(table)
    result.tables.append(_sensitivity(search.probes, sizes, budget))
    result.tables.append(_in_step_table(search.probes, search.found_in, search.errors, budget, result))
    return result


def _search(ctx, wl: GPTWorkload, optimizer, quick: bool) -> Search:
    """Each level's largest microbatches (pp x dp first: its state sets the budget), and, at full size,
    ZeRO-3 with one region per stage on the in-step high-water mark."""
    search = Search()
    for level in (QUICK_LEVELS if quick else LEVELS):
        probe = search.probes[level] = Probe(ctx, wl, level, optimizer)
        try:
            if search.budget is None:
                # The budget comes from pp x dp's own state: HEADROOM of it.
                first = probe.measure(1)
                search.budget = budget_for(HEADROOM, max(Probe.state(m) for m in first.values()))
            search.found[level] = largest(probe, search.budget)
            search.found_in[level] = largest(probe, search.budget, "in_step")
        except Exception as exc:
            search.errors[level] = f"failed: {short_error(exc)}"
            ctx.log(traceback.format_exc())
            if search.budget is None:
                return search
    if not quick:
        # The same ZeRO-3 with one region per stage: the unit it gathers is the whole stage.
        probe = search.probes[STAGE_ZERO3] = Probe(ctx, wl, "zero3", optimizer, layered=False)
        try:
            search.found_in[STAGE_ZERO3] = largest(probe, search.budget, "in_step")
        except Exception as exc:
            search.errors[STAGE_ZERO3] = f"failed: {short_error(exc)}"
            ctx.log(traceback.format_exc())
    return search


def _largest_table(search: Search, desc: str, result: SuiteResult) -> tuple[Table, dict[str, int]]:
    """The largest microbatch of each layered strategy within the budget on `job.memory()`'s total,
    and those sizes by level."""
    budget = search.budget
    table = Table(f"Largest microbatch within a per-device budget B = {mib(budget):.1f} MiB "
                  f"({budget:,} bytes); dp=2 x pp=2, 1F1B with {MICROBATCHES} microbatches; {desc}",
                  ["strategy", "largest microbatch (seq)", "vs pp x dp", "state MiB (p+g+opt)",
                   "activations MiB at largest", "total MiB at largest", "total MiB at largest + 1",
                   "runs (size: fits?)"])
    sizes: dict[str, int] = {}
    for level in [lv for lv in search.probes if search.probes[lv].layered]:
        name = f"pp x {level}"
        if level not in search.found:
            table.add(name, search.errors.get(level, "not run"), *[None] * 6)
            continue
        b, tried = search.found[level]
        probe = search.probes[level]
        sizes[level] = b
        ratio = b / sizes["dp"] if sizes.get("dp") else None
        at = probe.runs.get(b)
        worst = max(at, key=lambda r: Probe.state(at[r]) + at[r]["activations_peak"]) if at else None
        over = probe.total(b + 1) if b + 1 in probe.runs else None
        table.add(name, b, None if ratio is None else f"{ratio:.1f}x",
                  mib(Probe.state(at[worst])) if at else None,
                  mib(at[worst]["activations_peak"]) if at else None,
                  mib(probe.total(b)) if at else None, mib(over),
                  ", ".join(f"{s}: {'yes' if ok else 'no'}" for s, ok in tried))
        result.metrics[f"{level}.largest_microbatch"] = b
        if ratio is not None:
            result.metrics[f"{level}.ratio_vs_dp"] = ratio
        result.metrics[f"{level}.state_bytes"] = Probe.state(at[worst]) if at else 0
    table.notes += LARGEST_NOTES
    return table, sizes


def _sensitivity(probes: dict[str, Probe], sizes: dict[str, int], budget: int) -> Table:
    """What other budgets would give, from the measured state and activation slope (no new runs)."""
    table = Table("Sensitivity to the budget (derived from the runs above: measured state + measured "
                  "activation bytes per sequence, linear; not separate runs)",
                  ["B / (pp x dp state)", "B MiB", *[f"pp x {lv}" for lv in LEVELS], "zero3 / dp"])
    dp = probes.get("dp")
    if dp is None or not dp.runs:
        return table
    state = max(Probe.state(m) for m in dp.runs[min(dp.runs)].values())
    for h in (1.05, HEADROOM, 1.25, 1.5, 2.0):
        b_budget = budget_for(h, state)
        fits = {lv: probes[lv].predict(b_budget) if lv in probes and probes[lv].runs else None for lv in LEVELS}
        ratio = fits["zero3"] / fits["dp"] if fits.get("zero3") is not None and fits.get("dp") else None
        table.add(f"{h:.2f}" + (" (used)" if h == HEADROOM else ""), mib(b_budget),
                  *[fits[lv] for lv in LEVELS], None if ratio is None else f"{ratio:.1f}x")
    table.notes.append("The ratio is a property of the budget as much as of the strategies: the tighter "
                       "pp x dp is squeezed, the larger the ratio; with generous budgets activations dominate "
                       "and the ratio falls toward 1.")
    return table


def _in_step_table(probes: dict[str, Probe], found_in: dict[str, tuple[int, list]], errors: dict[str, str],
                   budget: int, result: SuiteResult) -> Table:
    table = Table(f"The same search with B = {mib(budget):.1f} MiB enforced on the in-step high-water mark: the "
                  "most bytes of parameter, gradient and optimizer buffers plus saved activations alive at once "
                  "during the step (job.memory()'s step_peak, sampled by the runtime after every plan action)",
                  ["strategy", "largest microbatch (seq)", "vs pp x dp", "in-step peak MiB at largest",
                   "job.memory() total MiB at the same size", "runs (size: fits?)"])
    sizes = {}
    for level, probe in probes.items():
        name = "pp x zero3, one region per stage" if level == STAGE_ZERO3 else f"pp x {level}"
        if level not in found_in:
            table.add(name, errors.get(level, "not run"), *[None] * 4)
            continue
        b, tried = found_in[level]
        sizes[level] = b
        ratio = b / sizes["dp"] if sizes.get("dp") else None
        table.add(name, b, None if ratio is None else f"{ratio:.1f}x",
                  mib(probe.total(b, "in_step")) if b in probe.runs else None,
                  mib(probe.total(b)) if b in probe.runs else None,
                  ", ".join(f"{s}: {'yes' if ok else 'no'}" for s, ok in tried))
        result.metrics[f"{level}.in_step.largest_microbatch"] = b
        if ratio is not None:
            result.metrics[f"{level}.in_step.ratio_vs_dp"] = ratio
    table.notes += [
        "job.memory() reports what a device holds between steps. Within a step a device also holds the "
        "gathered parameters of the regions in use (ZeRO-3: from one compute before a region's compute to "
        "after it), and full gradient buffers: replicated ones (dp) all step; under ZeRO-2/3 one per region "
        "from a run of backwards into it until that run's reduce-scatter has finished, which overlaps at most "
        "the next compute, and not one that reads the region (buffers in flight count).",
        "pp x zero3, one region per stage: the same model annotated with one region per stage, so ZeRO-3's unit "
        "is the whole stage: its gathered parameters stay alive across the 1F1B steady state, beside a full "
        "gradient buffer during each backward, so within the step it saves far less than with a region per "
        "block. The unit must be smaller than the stage for ZeRO-3 to save most of its memory within the step "
        "(FSDP wraps each layer for the same reason).",
    ]
    if sizes.get("dp"):
        label = {STAGE_ZERO3: "zero3 with one region per stage"}
        result.notes.append("In-step: " + "; ".join(
            f"{label.get(level, level)} / dp {b / sizes['dp']:.1f}x" for level, b in sizes.items() if level != "dp")
            + " (largest microbatch with the budget enforced on the in-step high-water mark)")
    return table
