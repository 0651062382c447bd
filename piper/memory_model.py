"""Predict each device's peak memory in a step from the compiled plans, before anything runs.

The prediction replays each device's plan the way the executor spends memory
(`piper/runtime/executor.py`), with sizes instead of tensors:

- parameters: each unit's flat buffer (padded to its group), or under ZeRO-3
  its shard plus the full buffer while gathered (from its ALL_GATHER_<pass>
  until the compute that releases it);
- gradients: the flat gradient buffer (kept across steps without ZeRO-2/3;
  under ZeRO-2/3 allocated by the first backward into the unit, handed to a
  reduce-scatter, which is in flight until the next compute or the next use
  of the unit, and the persistent gradient shard);
- optimizer state: its elements per parameter element (AdamW: 2) times the
  shard the device steps;
- saved activations: each region's bytes saved for backward per microbatch
  (`activation_bytes`, one forward per region on this machine's CPU with
  the microbatch's shapes), added by F and freed by B or BW.

The peak is sampled after every action, as `job.memory()[rank]["step_peak"]`
is, in a steady-state step (optimizer state and gradient shards exist). The
items of an overlapped slot run at once in lanes (CPU): the prediction takes
the worst case, both items' gradient buffers attached and the forward's
activations saved before the backward frees its own. The measured peak then
depends on which lane finishes first (DualPipeV with ZeRO-2 on the test GPT:
0-9% below the prediction, varying between replicas of one stage).
Point-to-point buffers and temporaries inside an action are not counted
(neither are they in `step_peak`); `p2p_bytes` gives the largest message a
device receives, for a margin.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .capture import BATCH, BUFFER, PARAM, Program
from .runtime.flat import layout_unit
from .runtime.saved import SavedBytes


@dataclass(frozen=True)
class MemoryPrediction:
    """One device's predicted peak in a step, and what it is made of at that instant."""

    peak: int
    at: str                        # the action after which the peak is reached
    params: int
    grads: int
    optimizer: int
    gathered: int                  # of `params`: ZeRO-3 units gathered at the peak
    activations: int
    in_flight: int                 # of `grads`: buffers handed to reduce-scatters still running
    between_steps: dict = field(default_factory=dict)   # params / grads / optimizer held between steps

    def as_dict(self) -> dict:
        return {"peak": self.peak, "at": self.at, "params": self.params, "grads": self.grads,
                "optimizer": self.optimizer, "gathered": self.gathered, "activations": self.activations,
                "in_flight": self.in_flight, "between_steps": dict(self.between_steps)}


def _zeros(spec, requires_grad=False):
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        return torch.zeros(spec.shape, dtype=spec.dtype, requires_grad=requires_grad)
    return torch.zeros(spec.shape, dtype=spec.dtype)


def run_regions(program: Program, *, backward: bool = False, timer=None):
    """Run every region of `program` once on CPU with zero-filled microbatch inputs.

    Returns per region the bytes autograd saved in its forward (parameters not
    counted, as the executor counts them) and, with `timer`, calls
    `timer(region, pass, seconds)` for the forward and (with `backward`) the backward,
    in this thread's CPU seconds on one intra-op thread, as a worker runs them
    (`job.timings(cpu=True)`): wall time would also hold whatever else the cores ran.
    """
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_regions(program, backward, timer, time.thread_time)
    finally:
        torch.set_num_threads(threads)


def _run_regions(program, backward, timer, clock):
    values = {v.id: v for v in program.values}
    params = {n: _zeros(s, True) for n, s in program.params.items()}
    buffers = {n: _zeros(s) for n, s in program.buffers.items()}
    batch = [_zeros(s) for s in program.batch]
    exclude = {p.untyped_storage()._cdata for p in params.values()}
    out_of: dict[int, torch.Tensor] = {}
    saved: dict[int, int] = {}
    ran = []
    for region in sorted(program.regions, key=lambda r: r.index):
        args = []
        for i in region.inputs:
            if i.kind == PARAM:
                args.append(params[i.ref])
            elif i.kind == BUFFER:
                args.append(buffers[i.ref])
            elif i.kind == BATCH:
                args.append(batch[i.ref])
            else:
                t = out_of[i.ref].detach()
                if values[i.ref].differentiable:
                    t.requires_grad_()
                args.append(t)
        start = clock()
        with torch.enable_grad(), SavedBytes(exclude) as counted:
            outs = region.graph(*args)
        if timer is not None:
            timer(region.index, "F", clock() - start)
        saved[region.index] = counted.size
        for v, o in zip(region.outputs, outs):
            out_of[v] = o
        ran.append((region, outs))
    if backward:
        for region, outs in reversed(ran):
            tensors = [o for o in outs if torch.is_tensor(o) and o.requires_grad]
            if not tensors:
                continue
            grads = [torch.ones_like(t) for t in tensors]
            start = clock()
            torch.autograd.backward(tensors, grads)
            if timer is not None:
                timer(region.index, "B", clock() - start)
    return saved


def activation_bytes(program: Program) -> dict[int, int]:
    """Region -> bytes its forward saves for backward, per microbatch (parameters excluded)."""
    if any(r.graph is None for r in program.regions):        # an abstract chain: no graphs to run
        return {r.index: 0 for r in program.regions}
    with torch.random.fork_rng(devices=[]):
        return run_regions(program)


@functools.lru_cache(maxsize=32)
def _states_per_element(optimizer) -> float:
    probe = torch.nn.Parameter(torch.zeros(16))
    opt = optimizer([probe])
    probe.grad = torch.ones(16)
    opt.step()
    elements = sum(v.numel() for state in opt.state.values() for v in state.values()
                   if torch.is_tensor(v) and v.dim() > 0)
    return elements / 16


def optimizer_states(optimizer=None) -> float:
    """State elements per parameter element the optimizer keeps (AdamW: 2, SGD: 0, momentum SGD: 1)."""
    if optimizer is None:
        optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    try:
        return _states_per_element(optimizer)
    except TypeError:                                  # unhashable callable: no cache
        return _states_per_element.__wrapped__(optimizer)


class _Unit:
    """The sizes one unit holds on a device, changed as the executor's `Unit` would be."""

    __slots__ = ("full", "shard", "zero", "gathered", "flat", "grad_shard", "in_flight", "opt")

    def __init__(self, layout, zero: int, states: float):
        self.full = sum(b.padded * _esize(b.dtype) for b in layout.buckets)
        self.shard = sum(b.shard_size * _esize(b.dtype) for b in layout.buckets)
        self.zero = zero
        self.gathered = False
        self.flat = zero <= 1              # replicated gradients stay allocated
        self.grad_shard = zero >= 2        # steady state: the shard of the last step's sums exists
        self.in_flight: list[int] = []     # bytes per reduce-scatter in flight
        self.opt = int(states * (self.full if zero == 0 else self.shard))

    def params(self) -> int:
        if self.zero == 3:
            return self.shard + (self.full if self.gathered else 0)
        return self.full

    def grads(self) -> int:
        return (self.full if self.flat else 0) + (self.shard if self.grad_shard else 0) + sum(self.in_flight)

    def held(self) -> int:
        return self.params() + self.grads() + self.opt


def _esize(dtype) -> int:
    if isinstance(dtype, str):           # an abstract chain's specs name their dtype
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return torch.empty((), dtype=dtype).element_size()


def unit_layouts(compiled, program: Program) -> dict:
    ir = compiled.ir
    return {r.index: layout_unit(r.index, r.owned, program.params, ir.devices_of(r.index))
            for r in ir.regions if r.owned}


def predict_memory(compiled, program: Program, *, optimizer=None, saved: dict[int, int] | None = None,
                   ranks=None, lanes: bool = True) -> dict[int, MemoryPrediction]:
    """Per rank, the predicted peak bytes of a step and its parts (see the module's docstring).

    `saved` (region -> bytes saved per microbatch) defaults to `activation_bytes(program)`;
    `ranks` defaults to every device (devices of one group share one replay). `lanes`: overlapped
    slots run in lanes, regrouped as the executor does on CPU (`piper.runtime.slots.spans`);
    False for a job compiled with `overlap=False` (or on CUDA, where the items run in turn)."""
    lanes_on = lanes
    from .interop import compute_slots
    from .runtime.slots import spans, whole_backwards

    saved = activation_bytes(program) if saved is None else saved
    states = optimizer_states(optimizer)
    layouts = unit_layouts(compiled, program)
    ir = compiled.ir
    units_of = {r.index: tuple(sorted({program.owner(p) for p in r.params})) for r in ir.regions}
    producer = {v.id: v.producer for v in program.values}
    feeds = {r.index: {producer[i.ref] for i in r.inputs if i.kind == "value"} for r in program.regions}
    world = compiled.ir.mesh.world_size
    ranks = list(range(world)) if ranks is None else list(ranks)
    slots = None
    out: dict[int, MemoryPrediction] = {}
    by_group: dict[tuple, MemoryPrediction] = {}
    for rank in ranks:
        group = tuple(r.index for r in ir.regions if rank in ir.devices_of(r.index))
        if group in by_group:
            out[rank] = by_group[group]
            continue
        if slots is None:
            slots = compute_slots(compiled)
        plan = compiled.plans[rank]
        multi = tuple(s for s in slots.get(rank, ()) if len(s) > 1)
        whole, skip = whole_backwards(plan, multi)
        lanes = spans(plan, multi, {r: set(units_of[r]) for r in group}, {r: feeds[r] for r in group}) \
            if lanes_on else {}
        units = {u: _Unit(layouts[u], compiled.zero, states) for u in group if u in layouts}
        out[rank] = by_group[group] = _replay(plan, units, units_of, saved, whole, skip, lanes)
    return out


def _replay(plan, units: dict, units_of: dict, saved: dict, whole, skip, lanes=None) -> MemoryPrediction:
    between = {"params": sum(u.params() for u in units.values()),
               "grads": sum(u.grads() for u in units.values()),
               "optimizer": sum(u.opt for u in units.values())}
    lanes = lanes or {}
    activations = 0
    pending: dict[str, tuple] = {}        # reduce-scatter key -> (unit, bytes in flight, extra shard)
    reducing: dict[str, list] = {}        # reduce-scatter key -> [computes since, unit]
    best = None

    def finish(key):
        u, size, extra = pending.pop(key)
        units[u].in_flight.remove(size)
        if extra:
            units[u].grad_shard = True

    def sample(key):
        nonlocal best
        held = activations + sum(u.held() for u in units.values())
        if best is None or held > best[0]:
            best = (held, key, sum(u.params() for u in units.values()), sum(u.grads() for u in units.values()),
                    sum(u.opt for u in units.values()),
                    sum(u.full for u in units.values() if u.zero == 3 and u.gathered), activations,
                    sum(sum(u.in_flight) for u in units.values()))

    def attach(region):
        for u in units_of[region]:
            if u in units and units[u].zero >= 2:
                units[u].flat = True

    def settle(reads):
        for key in list(reducing):
            computes, u = reducing[key]
            if computes >= 1 or u in reads:
                del reducing[key]
                if key in pending:
                    finish(key)
            else:
                reducing[key][0] = computes + 1

    def run(a):
        nonlocal activations
        node = a.node
        op = node.op
        for key in a.waits:
            if key in pending:
                reducing.pop(key, None)
                finish(key)
        if node.value and node.is_compute:
            pass                  # a later piece of a pass cut at its all-to-alls: its piece 0 counts the pass
        elif op == "F":
            activations += saved.get(node.region, 0)
        elif op == "B" or (op == "BI" and a.key in whole):
            attach(node.region)
            activations -= saved.get(node.region, 0)
        elif op == "BW" and a.key not in skip:
            attach(node.region)
            activations -= saved.get(node.region, 0)
        elif op == "ALL_GATHER" and node.phase and node.region in units:
            units[node.region].gathered = True
        elif op == "REDUCE_SCATTER" and node.region in units:
            unit = units[node.region]
            direct = not unit.in_flight and unit.grad_shard
            size = unit.full + (0 if direct else unit.shard)
            unit.flat = False
            unit.in_flight.append(size)
            pending[a.key] = (node.region, size, not direct)
            reducing[a.key] = [0, node.region]
        sample(a.key)
        for u in a.release:
            if u in units:
                units[u].gathered = False

    i = 0
    while i < len(plan):
        span = lanes.get(i)
        if span is None:
            if reducing and plan[i].node.is_compute:
                settle(set(units_of[plan[i].node.region]))
            run(plan[i])
            i += 1
            continue
        if reducing:      # the executor settles once, for everything the slot's lanes read
            settle({u for lane in span.lanes for a in lane if a.node.is_compute for u in units_of[a.node.region]})
        for a in span.before:
            run(a)
        # The lanes run at once: a backward's gradient buffers are attached as it starts, and a
        # forward (the shorter item) saves its activations before the backward frees its own.
        for lane in span.lanes:
            for a in lane:
                if a.node.op in ("B", "BW") or (a.node.op == "BI" and a.key in whole):
                    attach(a.node.region)
        ordered = sorted(span.lanes, key=lambda lane: not any(a.node.op == "F" for a in lane))
        for a in (*(a for lane in ordered for a in lane), *span.after):
            run(a)
        i = span.stop
    held, key, params, grads, opt, gathered, acts, flight = best or (0, "", 0, 0, 0, 0, 0, 0)
    return MemoryPrediction(held, key, params, grads, opt, gathered, acts, flight, between)


def p2p_bytes(compiled, program: Program, rank: int) -> int:
    """The largest single message `rank` receives in a step (not part of the peak; a margin)."""
    values = {v.id: v for v in program.values}
    by_value = {(v.producer, v.index): v for v in program.values}
    biggest = 0
    for a in compiled.plans[rank]:
        n = a.node
        if n.op == "RECV":
            producer = n.peer if n.phase == "F" else n.region
            v = by_value.get((producer, n.value))
            if v is not None:
                biggest = max(biggest, values[v.id].spec.nbytes)
    return biggest


_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
          "T": 1000**4, "TB": 1000**4, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """`8MiB`, `2GiB`, `1.5GB`, `123456` -> bytes; ValueError otherwise."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write bytes, or e.g. 8MiB, 2GiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
