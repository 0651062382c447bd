"""`piper tune`: search strategies for a model, a number of devices and a memory budget.

    piper tune --model examples/gpt.py:small_gpt --devices 4 --memory 8MiB [--batch-size 16]
               [--verify 2] [-o best.pps] [--format text|json] [--no-calibrate | --recalibrate]

The search covers mesh factorisations (dp x pp), the stdlib pipeline
schedules the model's regions allow (a schedule with one region per device
needs p PP regions, a V or interleaved one v*p), microbatch counts, the
data-parallel strategies (dp, ZeRO-1/2/3), and `recompute PP=*` for the
candidates that do not fit without it (recomputing only adds compute, so it
never beats the same candidate that fits without). On a MoE model each dp > 1
candidate is tried again with its experts divided over dp (`use
expert_parallel() on dp`, planned on the captured graphs, its all-to-alls priced
by the routed rows' bytes: `tune_parallel`); with `--tensor-parallel PLAN`, tp
sizes too (dp x pp x tp meshes), each again with `PLAN(sequence=true)` where
the plan takes it (sequence parallelism). A flag value tune cannot use is an
error; a size a plan cannot divide is skipped, and tune says why (`skipped` in
`--format json`). Each candidate is compiled (so
only strategies that compile and verify are kept), its peak memory per
device is predicted (`piper.compiler.memory_model`), and its step time simulated
(`piper.compiler.simulate`) with costs measured on this machine:

- each region's forward and backward at one microbatch size (the best of a
  few runs, in CPU seconds on one thread, as `job.timings(cpu=True)` reports a
  worker's), scaled linearly to other microbatch sizes,
  as are its saved activations; a split backward's halves cost 0.6 of the
  whole each (a split backward costs 1.2x on CPU); a recomputed region's B
  (or BI) also costs its forward (`piper.compiler.step_costs`);
- the optimizer's update per call and per parameter element (AdamW's step on one flat
  parameter, timed at two sizes: a ZeRO shard's small update costs mostly its call);
- communication by its bytes over a measured loopback TCP throughput (what
  Gloo moves between processes on one machine);
- devices that outnumber the CPU cores share them (`simulate(cores=...)`);
- the runtime's own costs, measured by a short run of two candidates on as
  many devices (`piper.cli_tune.calibrate`, `piper.compiler.tune_calibration`): its work per
  action and per step, each device's start skew, the message latency, each
  collective call's cost beyond its bytes, Gloo's threads, the driver's part of
  a step, the computes' CPU time in the workers (a ratio of the profile's and
  a cost per call), and the cores other processes took meanwhile;
  the first run's measured step over its prediction scales every prediction,
  and the second's error says how far they can be trusted.
  Without it (`--no-calibrate`) a step on the CPU runtime runs 3-4x longer
  than predicted, and every candidate on more devices than cores predicts
  about the same (their computes add up to the same CPU seconds).

The measurements are cached (`$PIPER_CACHE`, default ~/.cache/piper: `piper.cache_dir`; versioned
JSON, `piper.compiler.tune_cache`) by
model file, factory and microbatch size (the calibration by model, batch and
device count), so a second search skips them. The few best candidates are
re-predicted with activations measured at their exact microbatch size before
the ranking is final. Predictions closer than the calibrated model's error
on this machine (`Search.tolerance`) are one group (`groups`): tune says
they are indistinguishable rather than ranking them.
"""
from __future__ import annotations

import functools
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field, replace

from .tune_parallel import EXPERT_CODES, check_tensor_flag, tensor_lines, tensor_plan, with_all_to_alls

SCHEDULES_ONE = ("one_f_one_b", "gpipe", "zero_bubble")          # p regions on p devices
SCHEDULES_TWO = ("zbv", "dualpipev")                             # 2p regions, a V
SCHEDULES_VIRTUAL = ("interleaved_1f1b", "interleaved_zero_bubble")   # v*p regions, v >= 2
DATA = ("dp", "zero1", "zero2", "zero3")
SPLIT_HALF = 0.6           # BI and BW each cost this much of a whole backward (CPU: 1.2x in all)


@dataclass(frozen=True)
class Candidate:
    dp: int
    pp: int
    schedule: str | None
    microbatches: int
    virtual: int | None = None
    data: str | None = None
    recompute: bool = False        # `recompute PP=*`: every PP region keeps only its inputs
    tp: int = 1                    # tensor parallelism's size (with `tensor`, its plan: a strategy used on tp)
    tensor: str | None = None
    sequence: bool = False         # the plan with `sequence=true`: sequence parallelism
    experts: bool = False          # `use expert_parallel() on dp`: the MoE layers' experts divided over dp

    def microbatch(self, batch: int) -> int:
        """Sequences per microbatch of a global `batch`."""
        return batch // (self.dp * self.microbatches)

    def script(self) -> str:
        axes = [f"{a}={n}" for a, n in (("dp", self.dp), ("pp", self.pp), ("tp", self.tp)) if n > 1]
        lines = [f"mesh {', '.join(axes)}"] if axes else []
        if self.schedule:
            extra = f", virtual={self.virtual}" if self.virtual else ""
            lines.append(f"use {self.schedule}(microbatches={self.microbatches}{extra}) on pp")
        if self.data:
            lines.append(f"use {self.data}() on dp")
        if self.experts:
            lines.append("use expert_parallel() on dp")
        if not self.schedule and self.microbatches > 1:
            lines.append(f"split MB into {self.microbatches}")
        if self.recompute:
            lines.append("recompute PP=*")
        if self.tp > 1:
            lines = tensor_lines(self.tensor, lines, sequence=self.sequence)
        return "\n".join(lines) + "\n"

    def label(self) -> str:
        parts = [f"dp={self.dp} pp={self.pp}" + (f" tp={self.tp}" if self.tp > 1 else "")
                 + (" sp" if self.sequence else "")]
        if self.schedule:
            parts.append(f"{self.schedule}" + (f" v={self.virtual}" if self.virtual else ""))
        parts.append(f"m={self.microbatches}")
        if self.data:
            parts.append(self.data)
        if self.experts:
            parts.append("ep")
        if self.recompute:
            parts.append("recompute")
        return " · ".join(parts)


@dataclass
class Result:
    candidate: Candidate
    step_s: float
    peak_bytes: int
    bubble: float
    memory: dict = field(default_factory=dict)     # the peak's parts on the fullest device
    exact: bool = False                            # activations measured at this microbatch size

    def as_dict(self) -> dict:
        c = self.candidate
        return {"script": c.script(), "step_s": self.step_s, "peak_bytes": self.peak_bytes,
                "label": c.label(), "mesh": {"dp": c.dp, "pp": c.pp, "tp": c.tp}, "schedule": c.schedule,
                "microbatches": c.microbatches, "virtual": c.virtual, "data_parallel": c.data,
                "recompute": c.recompute, "sequence_parallel": c.sequence, "expert_parallel": c.experts,
                "bubble": self.bubble, "memory": self.memory,
                "exact_activations": self.exact}


# ---- measuring this machine ---------------------------------------------------------------------


def _cached(key: dict, make, *, again: bool = False, types=(), log=None):
    """The value stored on disk under `key` (and this machine and torch: `tune_cache.cached`, JSON
    holding only the dataclasses in `types`), else (or with `again`) `make()`, stored there."""
    from .tune_cache import cached

    return cached(key, make, again=again, types=types, log=log)


@dataclass
class Profile:
    """What one microbatch size costs: a graph-less copy of the program, and per region its
    forward and backward seconds and the bytes its forward saves."""

    microbatch: int
    program: object
    forward: dict[int, float]
    backward: dict[int, float]
    saved: dict    # region -> memory_model.RegionBytes
    moe: dict = field(default_factory=dict)    # region -> its MoE layers' routed bytes (`tune_parallel.moe_bytes`)


def _graphless(program):
    from ..frontend.capture import Program

    regions = tuple(replace(r, graph=None) for r in program.regions)
    tensor = program.tensor
    if tensor is not None:          # the cache holds tuples, not sets
        tensor = replace(tensor, summed=tuple(sorted(tensor.summed)))
    return Program(regions, program.values, program.params, program.buffers, program.batch, tensor=tensor)


def profile_types() -> tuple:
    """The dataclasses a cached `Profile` holds."""
    from ..frontend.captured import Program, Region, RegionInput, TensorSpec, Value
    from ..frontend.tensor_parallel import TensorLayout
    from .memory_model import RegionBytes

    return (Profile, Program, Region, RegionInput, TensorSpec, Value, RegionBytes, TensorLayout)


def profile(model_spec: str, microbatch: int, *, repeats: int = 7, log=None, tp: int = 1,
            tensor: str | None = None, sequence: bool = False) -> Profile:
    """Capture the model at `microbatch` sequences and time each region (cached on disk): the least
    CPU seconds of `repeats` runs, which other processes' load inflates least (on a loaded 2-core
    machine three runs left a size's profile up to 1.7x its neighbours'). With `tp > 1`, divided
    over tp by the strategy `tensor` (one device's shards and collectives' shapes; `sequence`: with
    `sequence=true`)."""
    path, _, factory = model_spec.rpartition(":")
    key = {"model": os.path.abspath(path), "mtime": os.path.getmtime(path) if os.path.exists(path) else 0,
           "factory": factory, "microbatch": microbatch, "repeats": repeats, "clock": "thread", "moe": "bytes"}
    if tp > 1:
        key.update(tp=tp, tensor=tensor, sequence=sequence)

    def make():
        import torch

        from ..frontend.capture import capture
        from .memory_model import run_regions
        from ..frontend.models import example_batch, load_model
        from .tune_parallel import moe_bytes

        model, module = load_model(model_spec)
        inputs = example_batch(module, microbatch)
        program = capture(model, inputs, tensor=tensor_plan(tp, tensor, sequence=sequence))
        times: dict[tuple, list] = {}
        saved = {}
        with torch.random.fork_rng(devices=[]):
            for _ in range(repeats):
                saved = run_regions(program, backward=True,
                                    timer=lambda r, p, s: times.setdefault((r, p), []).append(s))
        fwd = {r: min(v) for (r, p), v in times.items() if p == "F"}
        bwd = {r: min(v) for (r, p), v in times.items() if p == "B"}
        return Profile(microbatch, _graphless(program), fwd, bwd, saved, moe_bytes(program))

    return _cached(key, make, types=profile_types(), log=log)


def _loopback_bytes_per_s(size: int = 16 << 20) -> float:
    """Bytes per second through a loopback TCP connection (Gloo's path between local processes)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    payload = b"\0" * size
    received = [0]

    def sink():
        conn, _ = server.accept()
        with conn:
            while received[0] < size:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                received[0] += len(chunk)

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    with socket.create_connection(server.getsockname()) as client:
        start = time.perf_counter()
        client.sendall(payload)
        thread.join(timeout=30)
        elapsed = time.perf_counter() - start
    server.close()
    return size / max(elapsed, 1e-6)


def _update_seconds(optimizer=None, elements: int = 1 << 20, tensors: int = 9) -> tuple[float, float, float]:
    """(seconds per call, per further tensor, per element) of the optimizer's step, from the best
    of a few steps on one element, on `tensors` one-element parameters and on `elements`: a small
    shard's update (ZeRO's, over many devices) costs mostly its call, and a unit with a bucket
    per parameter pays each parameter's share of the call (torch's for-loop AdamW: 18 us a step
    and 19 us per parameter, measured)."""
    import torch

    optimizer = optimizer or functools.partial(torch.optim.AdamW, lr=1e-3)

    def best(sizes) -> float:
        ps = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        opt = optimizer(ps)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        out = float("inf")
        for _ in range(5):
            start = time.thread_time()
            opt.step()
            out = min(out, time.thread_time() - start)
        return out

    call = best([1])
    per_tensor = max(0.0, best([1] * tensors) - call) / (tensors - 1)
    return call, per_tensor, max(0.0, best([elements]) - call) / elements


def machine(log=None) -> dict:
    """Measured (cached): loopback throughput and the optimizer's update cost per call and element."""
    def make():
        call, per_tensor, per_element = _update_seconds()
        return {"bandwidth": _loopback_bytes_per_s(), "update": per_element, "update_call": call,
                "update_tensor": per_tensor, "cores": os.cpu_count() or 1}

    return _cached({"what": "machine", "update": "per call, tensor and element"}, make, log=log)


# ---- the search ----------------------------------------------------------------------------------


def pp_regions(program) -> int:
    return len({dict(r.tags).get("PP") for r in program.regions if "PP" in dict(r.tags)}) or 1


def candidates(devices: int, batch: int, regions: int, *, max_microbatches: int = 64,
               tensor: str | None = None, sequence: bool = False, experts: bool = False) -> list[Candidate]:
    """Every composition to try: meshes dp x pp (x tp, with a tensor-parallel plan `tensor`) = devices,
    schedules the regions allow, microbatches, dp/ZeRO; with `sequence`, each tp > 1 candidate
    again with sequence parallelism (`tensor` with `sequence=true`); with `experts` (a MoE model),
    each dp > 1 candidate again with its experts divided over dp (`use expert_parallel() on dp`).

        candidates(4, 16, 4, experts=True)   # ... dp=2 pp=2 · one_f_one_b · m=2 · zero1 · ep ...
    """
    out = []
    for tp in range(1, devices + 1) if tensor else (1,):
        if devices % tp:
            continue
        for c in _dp_pp(devices // tp, batch, regions, max_microbatches):
            c = replace(c, tp=tp, tensor=tensor if tp > 1 else None)
            for sp in (False, True) if sequence and tp > 1 else (False,):
                for ep in (False, True) if experts and c.dp > 1 else (False,):
                    out.append(replace(c, sequence=sp, experts=ep))
    return out


def _dp_pp(devices: int, batch: int, regions: int, max_microbatches: int) -> list[Candidate]:
    out = []
    for pp in range(1, devices + 1):
        if devices % pp:
            continue
        dp = devices // pp
        if batch % dp:
            continue
        per = batch // dp
        ms = sorted({m for m in range(1, min(per, max_microbatches) + 1) if per % m == 0
                     and (m & (m - 1) == 0 or m % pp == 0)})
        if pp == 1:
            schedules = [(None, None)]
        else:
            schedules = []
            if regions == pp:
                schedules += [(s, None) for s in SCHEDULES_ONE]
            if regions == 2 * pp:
                schedules += [(s, None) for s in SCHEDULES_TWO]
            if regions % pp == 0 and regions // pp >= 2:
                schedules += [(s, regions // pp) for s in SCHEDULES_VIRTUAL]
        datas = DATA if dp > 1 else (None,)
        for schedule, virtual in schedules:
            for m in ms:
                if schedule == "dualpipev" and m < 2 * pp:
                    continue
                for data in datas:
                    out.append(Candidate(dp, pp, schedule, m, virtual, data))
    return out


class Search:
    """The state of one search: the model's measured profiles, the machine, the budget."""

    def __init__(self, model_spec: str, devices: int, memory: int, batch: int, *, optimizer=None, log=None,
                 calibration=None, external: float | None = None, tensor: str | None = None):
        self.model_spec = model_spec
        self.devices = devices
        self.memory = memory
        self.batch = batch
        self.optimizer = optimizer
        self.log = log or (lambda msg: None)
        self.tensor = tensor          # a tensor-parallel plan (a strategy used on tp): tp sizes are searched too
        # A flag value it cannot use is an error before anything is measured; else why sequence
        # parallelism is not searched (None: it is, with the plan's `sequence=true`).
        self.no_sequence = check_tensor_flag(model_spec, tensor) if tensor else None
        self.machine = machine(self.log)
        self.reference = profile(model_spec, max(1, batch // max(devices, 1)), log=self.log)
        self.skipped: list[tuple[Candidate, str, str]] = []     # (candidate, why, what: "tp=4", ...)
        self._by_tp = {(1, False): self.reference}
        self._captured: dict[tuple, object] = {}     # (microbatch, tp, sequence) -> the program with its graphs
        self._cut_saved: dict[tuple, dict] = {}
        self.regions = pp_regions(self.reference.program)
        self.experts = bool(self.reference.moe)       # a MoE model: expert parallelism is searched
        # The runtime's costs on this machine (`tune_calibration.Calibration`, from `calibrate`); None
        # prices the computes, the update and the bytes alone. `external`: cores other processes
        # keep busy (default: as measured during the calibration's run).
        self.calibration = calibration
        self.external = external if external is not None else getattr(calibration, "external", 0.0)

    @property
    def tolerance(self) -> float:
        """Predictions closer than this (relative) cannot be told apart on this machine."""
        from .tune_calibration import UNCALIBRATED

        return self.calibration.tolerance if self.calibration is not None else UNCALIBRATED

    def with_calibration(self, calibration, external: float | None = None) -> "Search":
        """This search (its profiles, budget and machine) priced with `calibration`."""
        other = object.__new__(Search)
        other.__dict__.update(self.__dict__)
        other.skipped = []
        other.calibration = calibration
        other.external = external if external is not None else calibration.external
        return other

    def candidates(self) -> list[Candidate]:
        """The candidates this search tries (`candidates` for its devices, batch, regions and plans)."""
        return candidates(self.devices, self.batch, self.regions, tensor=self.tensor,
                          sequence=self.tensor is not None and self.no_sequence is None, experts=self.experts)

    def reference_for(self, tp: int, sequence: bool = False) -> Profile:
        """The profile at the reference microbatch size, divided over `tp` devices (measured once)."""
        from ..diagnostics import PiperError

        found = self._by_tp.get((tp, sequence))
        if found is None:
            self.log(f"measuring the model divided over tp={tp}" + (" with sequence parallelism" if sequence else ""))
            try:
                found = profile(self.model_spec, self.reference.microbatch, log=self.log, tp=tp, tensor=self.tensor,
                                sequence=sequence)
            except PiperError as err:      # the plan does not divide at this size: every such candidate skips
                found = err
            self._by_tp[(tp, sequence)] = found
        if isinstance(found, PiperError):
            raise found
        return found

    def exact_profile(self, c: Candidate) -> Profile | None:
        """`c`'s profile at its own microbatch size (None where that is the reference's)."""
        b = c.microbatch(self.batch)
        if b == self.reference.microbatch:
            return None
        return profile(self.model_spec, b, log=self.log, tp=c.tp, tensor=c.tensor, sequence=c.sequence)

    def graphs(self, microbatch: int, tp: int = 1, sequence: bool = False):
        """The program captured with its graphs at `microbatch` (divided over `tp`), kept in memory:
        a candidate with its experts divided is planned on it, as `shard experts` checks and cuts
        the MoE layers in the graphs (the cached profiles hold none)."""
        key = (microbatch, tp, sequence)
        if key not in self._captured:
            from ..frontend.capture import capture
            from ..frontend.models import example_batch, load_model

            self.log(f"capturing the model's graphs at {microbatch} sequence(s) per microbatch (expert parallelism)")
            model, module = load_model(self.model_spec)
            self._captured[key] = capture(model, example_batch(module, microbatch),
                                          tensor=tensor_plan(tp, self.tensor, sequence=sequence))
        return self._captured[key]

    def saved_as_pieces(self, compiled, program, microbatch: int, tp: int, sequence: bool) -> dict:
        """Region -> what its forward saves at `microbatch` where the plans run the regions cut at
        their collectives as `compiled` cuts them (`memory_model.region_bytes`; measured once)."""
        from .memory_model import region_bytes

        cut: dict[int, tuple[bool, bool]] = {}
        for n in compiled.ir.nodes:
            if n.value is not None and n.op in ("ALL_TO_ALL", "TP"):
                at_moe, at_tp = cut.get(n.region, (False, False))
                cut[n.region] = (at_moe or n.op == "ALL_TO_ALL", at_tp or n.op == "TP")
        key = (microbatch, tp, sequence, tuple(sorted(cut.items())))
        if key not in self._cut_saved:
            self._cut_saved[key] = region_bytes(program, None, cut)
        return self._cut_saved[key]

    def _scaled(self, b: int, exact: Profile | None = None, tp: int = 1, sequence: bool = False):
        ref = exact or self.reference_for(tp, sequence)
        k = b / ref.microbatch
        return ({r: t * k for r, t in ref.forward.items()}, {r: t * k for r, t in ref.backward.items()},
                {r: s.scaled(k) for r, s in ref.saved.items()})

    def evaluate(self, c: Candidate, exact: Profile | None = None) -> Result | None:
        from ..dsl import load_strategy
        from ..diagnostics import PiperError
        from ..frontend.interop import overlapped_slots
        from .planning import plan
        from .memory_model import predict_memory
        from .step_costs import comm_cost

        try:
            ref = exact or self.reference_for(c.tp, c.sequence)
        except PiperError as err:        # the plan cannot divide the model at this size
            self.skipped.append((c, err.diagnostics[0].message, f"tp={c.tp}" + (" sp" if c.sequence else "")))
            return None
        try:
            program = self.graphs(ref.microbatch, c.tp, c.sequence) if c.experts else ref.program
            compiled = plan(load_strategy(c.script(), file="<tune>"), program=program)
        except PiperError as err:
            expert = c.experts and err.code in EXPERT_CODES
            self.skipped.append((c, err.diagnostics[0].message, f"expert parallelism over dp={c.dp}" if expert
                                 else c.label()))
            return None
        b = c.microbatch(self.batch)
        fwd, bwd, saved = self._scaled(b, exact, c.tp, c.sequence)
        if c.experts:        # the MoE regions run as pieces cut at their all-to-alls: what those save
            k = b / ref.microbatch
            saved = {r: s.scaled(k) for r, s in
                     self.saved_as_pieces(compiled, program, ref.microbatch, c.tp, c.sequence).items()}
        memory = predict_memory(compiled, program, optimizer=self.optimizer, saved=saved,
                                ranks=compiled.plans.representatives())
        fullest = max(memory.values(), key=lambda m: m.peak)
        costs = self.compute_costs(compiled, program, c, fwd, bwd)
        bandwidth = self.machine["bandwidth"]
        comm = comm_cost(compiled, program, bandwidth=bandwidth, value_scale=b / ref.microbatch)
        if c.experts:
            comm = with_all_to_alls(comm, ref.moe, scale=b / ref.microbatch, bandwidth=bandwidth)
        step, bubble = self.step(compiled.plans.representatives(), costs, comm, overlapped_slots(compiled))
        return Result(c, step, fullest.peak, bubble, fullest.as_dict(), exact is not None)

    def compute_costs(self, compiled, program, c: Candidate, fwd: dict, bwd: dict) -> dict[str, float]:
        """Seconds per compute key of `compiled`: each region's forward and backward (`fwd`, `bwd`:
        region -> seconds at the candidate's microbatch size), a split backward's halves, the
        update of the shard each device owns (a call, a share of it per further bucket of its unit as
        `job_layouts` lays it out, and its elements), and recomputed regions' reruns."""
        from .flat_layout import job_layouts
        from .step_costs import recompute_costs

        costs = {}
        per_element, per_call = self.machine["update"], self.machine.get("update_call", 0.0)
        per_tensor = self.machine.get("update_tensor", per_call)
        owned = {r.index: sum(program.params[p].nbytes for p in r.owned) for r in compiled.ir.regions}
        buckets = {u: len(layout.buckets) for u, layout in job_layouts(compiled, program, self.optimizer).items()}
        # A later piece of a pass cut at its collectives costs nothing: the pass's cost falls on its
        # piece 0 (`simulate`).
        pieces = {n.key for n in compiled.ir.nodes if n.value is not None and n.is_compute}
        for n in compiled.ir.nodes:
            if n.key in pieces:
                continue
            if n.op == "F":
                costs[n.key] = fwd.get(n.region, 0.0)
            elif n.op == "B":
                costs[n.key] = bwd.get(n.region, 0.0)
            elif n.op in ("BI", "BW"):
                costs[n.key] = SPLIT_HALF * bwd.get(n.region, 0.0)
            elif n.op == "UPD":
                shard = owned.get(n.region, 0) / 4 / (c.dp if c.data in ("zero1", "zero2", "zero3") else 1)
                costs[n.key] = per_call + (buckets.get(n.region, 1) - 1) * per_tensor + shard * per_element
        costs = recompute_costs(compiled, costs, measured=())      # B/BI of `recompute` regions: + their F
        return {k: v for k, v in costs.items() if k not in pieces}

    def step(self, plans, costs: dict, comm, overlap=()) -> tuple[float, float]:
        """(predicted step seconds, bubble fraction) of `plans` (one replica per shard) with compute
        `costs` per key and `comm(node)` the seconds of each communication's bytes (`simulation`)."""
        sim, seconds = self.simulation(plans, costs, comm, overlap)
        return seconds, sim.bubble_fraction

    def simulation(self, plans, costs: dict, comm, overlap=()):
        """(the `Simulation` of `plans`, the step it predicts in seconds): see `step`.

        Without a calibration: the computes on the machine's cores, communication by its bytes.
        With one (`tune_calibration.Calibration`): the runtime's measured costs laid onto the plans
        (`RuntimeModel.apply`: its work per action and per step, each device's start skew), a
        receive costing the measured message latency, the computes scaled by what they measured in
        the calibration's workers over what the profile says plus their measured cost per call
        (`Calibration.compute`, `call`; `update` for the optimizer's), a collective costing its measured wall time per call beyond its bytes
        (`Calibration.collectives`), each device's other threads (Gloo's copies of its bytes,
        `comm_seconds`, its work per collective call, `calls_seconds`, and the rest measured) competing
        for the cores other processes leave, each data-parallel collective waiting `Calibration.wait`
        more (`with_wait`), and the driver's own part of a step added; all of it
        times what the calibration's run measured over what this predicts for it (`scale`).
        """
        from .simulate import simulate
        from .tune_calibration import call_latency, calls_seconds, comm_seconds, cores_left, is_update, with_wait

        cal = self.calibration
        if cal is None:
            sim = simulate(plans, costs=costs, comm_cost=comm, overlap=overlap, cores=self.machine["cores"],
                           devices=self.devices)
            return sim, sim.step_time
        costs = {k: v * cal.update if is_update(k) else v * cal.compute + cal.call for k, v in costs.items()}
        led, full = cal.runtime.apply(plans, costs, overlap)
        latency = with_wait(cal.runtime.comm_cost(call_latency(cal.collectives, comm)), cal.wait)
        sim = simulate(led, costs=full, comm_cost=latency,
                       overlap=overlap, cores=cores_left(cal.cores, self.external or 0.0), devices=self.devices,
                       background=cal.background + comm_seconds(plans, comm)
                       + calls_seconds(plans, cal.collectives, cal.runtime))
        return sim, (sim.step_time + cal.driver) * cal.scale

    def run(self, *, refine: int = 3) -> tuple[list[Result], list[Result]]:
        """(the results that fit, best first; every result) for every candidate."""
        from ..diagnostics import PiperError

        every = []
        # A recomputing candidate computes more than the same one without, so it can only win
        # where that one does not fit: it is tried for those that miss the budget (or come
        # within the refinement's margin of it, where exact activations may still push them out).
        recomputable = any("PP" in dict(r.tags) for r in self.reference.program.regions)
        for c in self.candidates():
            r = self.evaluate(c)
            if r is not None:
                every.append(r)
            if recomputable and (r is None or r.peak_bytes > self.memory / 1.25):
                again = self.evaluate(replace(c, recompute=True))
                if again is not None:
                    every.append(again)
        # Re-predict the best few that fit, or nearly, with activations measured at their own
        # microbatch size (each size measured once, then cached), until the best few are exact.
        for _ in range(len(every)):     # each round makes at least one result exact
            every.sort(key=lambda r: (r.step_s, r.peak_bytes))
            top = [i for i, r in enumerate(every) if r.peak_bytes <= self.memory * 1.25][:refine]
            top += [i for i, r in enumerate(every) if r.peak_bytes <= self.memory][:1]   # the best that fits
            todo = [i for i in top if not every[i].exact]
            if not todo:
                break
            for i in todo:
                r = every[i]
                b = self.batch // (r.candidate.dp * r.candidate.microbatches)
                if b == self.reference.microbatch:
                    r.exact = True
                    continue
                self.log(f"measuring the model at {b} sequence(s) per microbatch")
                try:
                    exact = self.evaluate(r.candidate, self.exact_profile(r.candidate))
                except PiperError as err:         # the plan cannot divide the model at this size
                    self.skipped.append((r.candidate, err.diagnostics[0].message, r.candidate.label()))
                    exact = None
                if exact is None:
                    del every[i]
                    break
                every[i] = exact
        every.sort(key=lambda r: (r.step_s, r.peak_bytes))
        fits = [r for r in every if r.peak_bytes <= self.memory]
        return fits, every


def groups(results: list[Result], tolerance: float) -> list[int]:
    """For `results` (fastest first), the number of the group each falls in (1, 2, ...): a result
    joins the group of the fastest before it while their predictions, each within ±`tolerance`,
    overlap (`step <= first * (1 + tolerance) / (1 - tolerance)`); their order within it is noise.

        steps 100, 105, 118, 200 ms at ±8%: groups 1, 1, 1, 2
    """
    out, first, number = [], None, 0
    ratio = (1 + tolerance) / max(1e-9, 1 - tolerance)
    for r in results:
        if first is None or r.step_s > first * ratio:
            first, number = r.step_s, number + 1
        out.append(number)
    return out


def group_notes(results: list[Result], numbers: list[int], tolerance: float, *, calibrated: bool = True) -> list[str]:
    """One line per group of several rows: which rows cannot be told apart, and within what."""
    why = "the model's error on this machine" if calibrated else "assumed: no calibration"
    lines = []
    for g in sorted(set(numbers)):
        rows = [i + 1 for i, n in enumerate(numbers) if n == g]
        if len(rows) > 1:
            lines.append(f"rows {rows[0]}-{rows[-1]} are indistinguishable within ±{tolerance:.0%} ({why}): "
                         "their order is not a ranking; choose among them by memory, or --verify them")
    return lines


# ---- the command ---------------------------------------------------------------------------------


def measure_steps(job, data, steps: int) -> tuple[float, int, float]:
    """`steps` steps of `job` on `data`: (median step seconds after the first, the largest step_peak,
    the median cores other processes kept busy during those steps)."""

    from .tune_calibration import LoadMeter

    times, loads = [], []
    for _ in range(steps):
        meter = LoadMeter()
        start = time.perf_counter()
        job.step(*data)
        times.append(time.perf_counter() - start)
        loads.append(meter.cores(less=sum(r.get("step", 0.0) for r in job.timings(cpu=True).values())))
    return (statistics.median(times[1:] or times), max(m["step_peak"] for m in job.memory().values()),
            statistics.median(loads[1:] or loads))


def at_load(search: Search, result: Result, external: float) -> float | None:
    """`result`'s step predicted again for `external` cores of other load (what `--verify` measured
    while it ran), its activations at its own microbatch size; None without a calibration."""
    if search.calibration is None:
        return None
    c = result.candidate
    exact = search.exact_profile(c)
    again = search.with_calibration(search.calibration, external=external).evaluate(c, exact)
    return again.step_s if again is not None else None
