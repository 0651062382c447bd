"""Predict each device's peak memory in a step from the compiled plans, before anything runs.

The prediction replays each device's plan the way the executor spends memory
(`piper/runtime/execution/executor.py`), with sizes instead of tensors:

- parameters: each unit's flat buffer (padded to its group), or under ZeRO-3
  its shard plus the full buffer while gathered (from its ALL_GATHER_<pass>
  until the compute that releases it);
- gradients: the flat gradient buffers, counted from the first backward into
  the unit (the runtime attaches each bucket at its first gradient, so once
  that backward is done, every bucket it wrote); without ZeRO-2/3 let go at
  the unit's update, under ZeRO-2/3 handed to a reduce-scatter, which is in
  flight until the next compute or the next use of the unit, beside the
  gradient shard its first reduce-scatter in the step makes, until the update;
- optimizer state: its elements per parameter element (AdamW: 2) times the
  shard the device steps;
- saved activations: each region's bytes saved for backward per microbatch
  (`region_bytes`, one forward per region on this machine's CPU with
  the microbatch's shapes), added by F and freed by B or BW;
- `recompute` regions: F keeps only the bytes of its inputs; the first
  backward pass (B, or BI under a split backward) runs the forward again and
  adds what that saves beyond the inputs, until B or BW frees both;
- mixed precision (`precision="bf16"`/`"fp16"`, `piper/runtime/state/precision.py`):
  float32 masters, gradients and optimizer state as in full precision, plus
  a 16-bit copy of each unit's flat parameters (held throughout without
  ZeRO-3; under ZeRO-3 it is the gathered buffer, half the float32 one, and
  the float32 full buffer is never allocated); activations are measured with
  16-bit parameters and inputs;
- `shard experts over AXIS` (`piper/ir/experts.py`): expert weights leave the
  flat units; each device holds its `num_experts / size` rows of every expert
  weight, their AdamW state, and their gradients from the unit's first
  backward until its update. A MoE region's saved activations assume every
  device receives its share of the routed token copies (the routing decides),
  and, for a pass the runtime cuts into pieces at its collectives
  (`piper/runtime/moe/pieces.py`), what each piece saves on its own.

The peak is sampled after every action, as `job.memory()[rank]["step_peak"]`
is, in a steady-state step (optimizer state exists). The
items of an overlapped slot run at once in lanes (CPU), so what a step holds
at the slot depends on how the lanes' threads interleave, which changes from
step to step and run to run: `peak` is the worst interleaving (both items'
gradient buffers attached, the forward's activations saved before the
backward frees its own), `least` the kindest (the backward done before the
forward saves). A run's measured peak lies between them (DualPipeV with
ZeRO-2 on the example GPT: one step at `least`, another at `peak`, 8-11% apart);
`peak` is the number to budget with.
Point-to-point buffers and temporaries inside an action are not counted
(neither are they in `step_peak`); `p2p_bytes` gives the largest message a
device receives, for a margin.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from ..frontend.capture import BATCH, BUFFER, PARAM, Program
from .flat_layout import job_layouts
from .optimizer_bytes import unit_state_bytes
from .saved import SavedBytes
from ..ir.dag import node_key


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
    # The peak if every overlapped slot's lanes interleave as favourably as they can (a backward
    # lane done before a forward lane's activations are counted); `peak` is the worst
    # interleaving. Equal without lanes. Which one a run sees depends on its threads' timing.
    least: int | None = None

    def as_dict(self) -> dict:
        return {"peak": self.peak, "at": self.at, "params": self.params, "grads": self.grads,
                "optimizer": self.optimizer, "gathered": self.gathered, "activations": self.activations,
                "in_flight": self.in_flight, "between_steps": dict(self.between_steps),
                "least": self.peak if self.least is None else self.least}


@dataclass(frozen=True)
class RegionBytes:
    """What one region's forward holds for its backward, per microbatch (parameters not counted).

    `saved`: what autograd saves (F to B/BW). A `recompute` region keeps `inputs` (its input
    tensors' storages) from F, and its rerun in backward saves `rerun` beyond them."""

    saved: int
    inputs: int = 0
    rerun: int = 0

    @staticmethod
    def of(x) -> "RegionBytes":
        """A `RegionBytes`, or a plain byte count (inputs unknown: a rerun saves it all)."""
        return x if isinstance(x, RegionBytes) else RegionBytes(int(x), 0, int(x))

    def scaled(self, k: float) -> "RegionBytes":
        return RegionBytes(int(self.saved * k), int(self.inputs * k), int(self.rerun * k))


def compute_dtype(precision) -> torch.dtype | None:
    """`"bf16"`, `"fp16"`, `"fp32"`, a torch dtype or None -> the 16-bit compute dtype, or None."""
    if precision is None or isinstance(precision, torch.dtype):
        return precision
    from ..frontend.options import compute_dtype as parse

    return parse(precision)


def _zeros(spec, requires_grad=False, dtype=None):
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        return torch.zeros(spec.shape, dtype=dtype if dtype is not None and spec.dtype.is_floating_point
                           else spec.dtype, requires_grad=requires_grad)
    return torch.zeros(spec.shape, dtype=spec.dtype)


class _SavedAndInputs(SavedBytes):
    """`SavedBytes`, also counting apart the saved bytes that are the forward's own inputs
    (what a recomputed region keeps anyway, so its rerun does not count them again)."""

    __slots__ = ("inputs", "of_inputs")

    def __init__(self, exclude, inputs: set[int]):
        super().__init__(exclude)
        self.inputs = inputs
        self.of_inputs = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.inputs and key not in self._seen and key not in self.exclude:
            self.of_inputs += storage.nbytes()
        return super()._pack(t)


def run_regions(program: Program, *, backward: bool = False, timer=None, dtype=None,
                pieces=frozenset()) -> dict[int, RegionBytes]:
    """Run every region of `program` once on CPU with zero-filled microbatch inputs.

    Returns per region what its forward holds for backward (`RegionBytes`: parameters
    not counted, as the executor counts them) and, with `timer`, calls
    `timer(region, pass, seconds)` for the forward and (with `backward`) the backward,
    in this thread's CPU seconds on one intra-op thread, as a worker runs them
    (`job.timings(cpu=True)`): wall time would also hold whatever else the cores ran.
    `dtype` (16-bit): the parameters and floating-point inputs in it, as a worker computes
    under `precision=` (the program captured in that dtype, `piper.compile` does so).
    `pieces`: regions the runtime runs cut at their collectives: region -> (at its MoE layers,
    at its TP collectives), or a set of regions cut at their MoE layers; their saved bytes are
    the pieces' (`_pieces_saved`).
    """
    import time

    from ..tensor_context import alone

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tensor = getattr(program, "tensor", None)
    try:
        with alone(tensor.size if tensor is not None else 1):     # one device's shards, collectives' shapes only
            return _run_regions(program, backward, timer, time.thread_time, dtype, pieces)
    finally:
        torch.set_num_threads(threads)


def _storage_keys(tensors, exclude) -> dict[int, int]:
    """Storage `_cdata` -> bytes of the tensors' storages, those in `exclude` left out."""
    out = {}
    for t in tensors:
        if torch.is_tensor(t):
            storage = t.untyped_storage()
            if storage._cdata not in exclude:
                out[storage._cdata] = storage.nbytes()
    return out


def _pieces_saved(graph, args, exclude, experts: bool = True, tensor: bool = False, size: int = 1) -> RegionBytes:
    """What a region run as pieces cut at its collectives saves (`piper/runtime/moe/pieces.py`):
    each piece on its own, reading earlier pieces' and exchanges' outputs as leaves (recomputed,
    each piece keeps its own inputs and its rerun saves the rest: the sums over the pieces). The
    exchanges are local here: a MoE group of one (the rows stay, as new tensors), TP's stand-in
    group of `size` (`region_cut.local_exchange`: the collectives' shapes)."""
    from ..ir.moe_cut import DISPATCH
    from ..ir.region_cut import TP, Source, cut, local_exchange

    c = cut(graph, 1, experts=experts, tensor=tensor)
    values: dict = {}
    grads: set = set()           # exchange outputs that carry a gradient back

    def exchange(k):
        e = c.exchanges[k]
        rows = values[e.sources[0]]
        if rows.requires_grad and e.kind != "tp_max":
            grads.add(Source("exchange", k, 0))
        if e.op == TP:
            values[Source("exchange", k, 0)] = local_exchange(e.kind, rows.detach(), e.args, size)
            return
        values[Source("exchange", k, 0)] = rows.detach().clone()
        if e.kind == DISPATCH:
            counts = values[e.sources[1]]
            whole = counts.view(1, -1).sum(1)
            values.update({Source("exchange", k, 1): counts.clone(), Source("exchange", k, 2): whole,
                           Source("exchange", k, 3): whole.clone()})

    total = RegionBytes(0)
    for piece, gm in enumerate(c.pieces):
        inputs = []
        for source in c.inputs[piece]:
            if source.kind == "arg":
                inputs.append(args[source.index])
                continue
            if source.kind == "exchange" and source not in values:
                exchange(source.index)
            value = values[source]
            if torch.is_tensor(value) and (value.requires_grad or source in grads):
                value = value.detach().requires_grad_()
            inputs.append(value)
        kept = _storage_keys(inputs, exclude)      # what a recomputed piece keeps (`piece_forward`)
        with torch.enable_grad(), _SavedAndInputs(exclude, set(kept)) as counted:
            outs = gm(*inputs)
        total = RegionBytes(total.saved + counted.size, total.inputs + sum(kept.values()),
                            total.rerun + counted.size - counted.of_inputs)
        for j, out in enumerate(outs if isinstance(outs, (tuple, list)) else (outs,)):
            values[Source("piece", piece, j)] = out
    return total


def _on_cpu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with every device its nodes name pointed at the CPU, as a worker points them at its own
    (`runtime/launch/packed_graphs.unpack`): capture exports on the meta device, so a Hugging Face
    model's rotary positions and masks are `arange(..., device=meta)` and `inv_freq.to(meta)` in
    its graphs, which meet the CPU inputs here. `gm` itself when it names no device."""
    from torch.utils import _pytree as pytree

    def cpu(a):
        return torch.device("cpu") if isinstance(a, torch.device) else a

    if not any(isinstance(a, torch.device) for n in gm.graph.nodes for a in pytree.tree_leaves((n.args, n.kwargs))):
        return gm
    graph = torch.fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        copy = env[n] = graph.node_copy(n, env.__getitem__)
        copy.args, copy.kwargs = pytree.tree_map(cpu, (copy.args, copy.kwargs))
    return torch.fx.GraphModule(gm, graph)


def _run_regions(program, backward, timer, clock, dtype=None, pieces=frozenset()):
    values = {v.id: v for v in program.values}
    params = {n: _zeros(s, True, dtype) for n, s in program.params.items()}
    buffers = {n: _zeros(s) for n, s in program.buffers.items()}
    batch = [_zeros(s, dtype=dtype) for s in program.batch]
    exclude = {p.untyped_storage()._cdata for p in params.values()}
    tensor = getattr(program, "tensor", None)
    tp_size = tensor.size if tensor is not None else 1
    out_of: dict[int, torch.Tensor] = {}
    saved: dict[int, RegionBytes] = {}
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
        inputs = _storage_keys(args, exclude)        # what `recompute` keeps (runtime/autograd/recompute.py)
        graph = _on_cpu(region.graph)
        start = clock()
        with torch.enable_grad(), _SavedAndInputs(exclude, set(inputs)) as counted:
            outs = graph(*args)
        if timer is not None:
            timer(region.index, "F", clock() - start)
        if region.index in pieces:       # {region: (cut at its MoE layers, at its TP collectives)}, or a set: MoE
            experts, tensor = pieces[region.index] if isinstance(pieces, dict) else (True, False)
            saved[region.index] = _pieces_saved(graph, args, exclude, experts, tensor, tp_size)
        else:
            saved[region.index] = RegionBytes(counted.size, sum(inputs.values()), counted.size - counted.of_inputs)
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


def region_bytes(program: Program, precision=None, pieces=frozenset()) -> dict[int, RegionBytes]:
    """Region -> what its forward holds for backward per microbatch (`RegionBytes`, parameters excluded);
    `pieces`: the regions run cut at their collectives (as `run_regions` takes them)."""
    if any(r.graph is None for r in program.regions):        # an abstract chain: no graphs to run
        return {r.index: RegionBytes(0) for r in program.regions}
    with torch.random.fork_rng(devices=[]):
        return run_regions(program, dtype=compute_dtype(precision), pieces=pieces)


def activation_bytes(program: Program, precision=None) -> dict[int, int]:
    """Region -> bytes its forward saves for backward, per microbatch (parameters excluded)."""
    return {r: b.saved for r, b in region_bytes(program, precision).items()}


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
    from ..frontend.param_groups import Grouped
    from .optimizer_bytes import state_rate

    if optimizer is None:
        optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    if isinstance(optimizer, Grouped):       # its first group's (an expert row's optimizer)
        return state_rate(optimizer)
    try:
        return _states_per_element(optimizer)
    except TypeError:                                  # unhashable callable: no cache
        return _states_per_element.__wrapped__(optimizer)


class _Unit:
    """The sizes one unit holds on a device, changed as the executor's `Unit` would be.

    `low`: its 16-bit compute copy under `precision=` (0 in full precision); `experts`: the
    bytes of the expert rows it holds under `shard experts` (kept apart from its flat buffers)."""

    __slots__ = ("full", "shard", "zero", "gathered", "flat", "grad_shard", "in_flight", "opt", "low",
                 "experts", "expert_grads", "expert_opt")

    def __init__(self, layout, zero: int, states: float, low_size: int = 0, experts: int = 0,
                 opt: int | None = None):
        self.full = sum(b.padded * element_size(b.dtype) for b in layout.buckets) if layout else 0
        self.shard = sum(b.shard_size * element_size(b.dtype) for b in layout.buckets) if layout else 0
        self.low = sum(b.padded * low_size for b in layout.buckets) if layout and low_size else 0
        self.zero = zero
        self.gathered = False
        self.flat = False                  # a flat gradient buffer: from the unit's first backward
        self.grad_shard = False            # ZeRO-2/3: from the unit's first reduce-scatter to its update
        self.in_flight: list[int] = []     # bytes per reduce-scatter in flight
        # `opt`: the unit's optimizer-state bytes on this device (`optimizer_bytes.unit_state_bytes`)
        self.opt = int(states * (self.full if zero == 0 else self.shard)) if opt is None else opt
        self.experts = experts
        self.expert_grads = False          # from the unit's first backward to its update
        self.expert_opt = int(states * experts)

    def params(self) -> int:
        if self.zero == 3:                 # under precision= the gather fills the 16-bit buffer only
            return self.shard + ((self.low or self.full) if self.gathered else 0) + self.experts
        return self.full + self.low + self.experts

    def gathered_bytes(self) -> int:
        return (self.low or self.full) if self.zero == 3 and self.gathered else 0

    def grads(self) -> int:
        return ((self.full if self.flat else 0) + (self.shard if self.grad_shard else 0) + sum(self.in_flight)
                + (self.experts if self.expert_grads else 0))

    def optimizer(self) -> int:
        return self.opt + self.expert_opt

    def held(self) -> int:
        return self.params() + self.grads() + self.optimizer()


def torch_dtype(dtype):
    """A torch dtype (an abstract chain's specs name theirs: "torch.float32"); None stays None."""
    if isinstance(dtype, str):
        return getattr(torch, dtype.removeprefix("torch."))
    return dtype


def element_size(dtype) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def _expert_bytes(compiled, program: Program, rank: int) -> dict[int, int]:
    """Unit -> bytes of the expert rows `rank` holds (`shard experts`; {} without it)."""
    from ..ir import experts

    out: dict[int, int] = {}
    for unit, names in experts.holdings(program, compiled.ir, rank).items():
        for name, (lo, hi) in names.items():
            spec = program.params[name]
            rest = 1
            for d in spec.shape[1:]:
                rest *= d
            out[unit] = out.get(unit, 0) + (hi - lo) * rest * element_size(spec.dtype)
    return out


def predict_memory(compiled, program: Program, *, optimizer=None, saved: dict | None = None,
                   ranks=None, lanes: bool = True, precision=None) -> dict[int, MemoryPrediction]:
    """Per rank, the predicted peak bytes of a step and its parts (see the module's docstring).

    `saved` (region -> `RegionBytes`, or bytes saved per microbatch) defaults to
    `region_bytes(program, precision)`; `ranks` defaults to every device (devices of one group
    share one replay). `lanes`: overlapped slots run in lanes, regrouped as the executor does on
    CPU (`piper.compiler.slots.spans`); False for a job compiled with `overlap=False` (or on
    CUDA, where the items run in turn). `precision`: the job's `precision=` ("bf16", "fp16",
    "fp32" or a dtype). The strategy's `recompute` regions and `shard experts` come from the IR.

        predict_memory(job.compiled, job.program, precision="bf16")[0].peak
    """
    lanes_on = lanes
    from ..ir import experts
    from ..frontend.interop import compute_slots
    from .slots import spans, whole_backwards

    dtype = compute_dtype(precision)
    if saved is None:             # regions the plans run as pieces save as their pieces do
        cut: dict[int, tuple[bool, bool]] = {}
        for n in compiled.ir.nodes:
            if n.value is not None and n.op in ("ALL_TO_ALL", "TP"):
                at_moe, at_tp = cut.get(n.region, (False, False))
                cut[n.region] = (at_moe or n.op == "ALL_TO_ALL", at_tp or n.op == "TP")
        saved = region_bytes(program, dtype, cut)
    saved = {r: RegionBytes.of(b) for r, b in saved.items()}
    states = optimizer_states(optimizer) if sharded_experts(compiled) else 0.0    # expert rows' optimizer
    ir = compiled.ir
    sharded = experts.expert_params(program) if ir.sharded("experts") else {}
    layouts = job_layouts(compiled, program, optimizer)
    units_of = {r.index: tuple(sorted({program.owner(p) for p in r.params})) for r in ir.regions}
    producer = {v.id: v.producer for v in program.values}
    feeds = {r.index: {producer[i.ref] for i in r.inputs if i.kind == "value"} for r in program.regions}
    world = compiled.ir.mesh.world_size
    ranks = list(range(world)) if ranks is None else list(ranks)
    recompute = frozenset(ir.recompute)
    low_size = element_size(dtype) if dtype is not None else 0
    slots = None
    out: dict[int, MemoryPrediction] = {}
    by_group: dict[tuple, MemoryPrediction] = {}
    opt_cache: dict = {}
    for rank in ranks:
        group = tuple(r.index for r in ir.regions if rank in ir.devices_of(r.index))
        opt = {u: unit_state_bytes(layouts[u], compiled.zero, _member(layouts[u], rank), optimizer, opt_cache)
               for u in group if u in layouts}
        key = (group, tuple(opt.items()))     # members owning different whole parameters differ
        if key in by_group:           # expert rows divide evenly: every member holds as many
            out[rank] = by_group[key]
            continue
        if slots is None:
            slots = compute_slots(compiled)
        plan = compiled.plans[rank]
        multi = tuple(s for s in slots.get(rank, ()) if len(s) > 1)
        whole, skip = whole_backwards(plan, multi)
        lanes = spans(plan, multi, {r: set(units_of[r]) for r in group}, {r: feeds[r] for r in group}) \
            if lanes_on else {}
        rows = _expert_bytes(compiled, program, rank) if sharded else {}
        units = {u: _Unit(layouts.get(u), compiled.zero, states, low_size, rows.get(u, 0), opt.get(u))
                 for u in group if u in layouts or u in rows}
        worst = _replay(plan, units, units_of, saved, whole, skip, lanes, recompute)
        least = worst.peak
        if lanes:                       # the same step with each slot's lanes in their kindest order
            units = {u: _Unit(layouts.get(u), compiled.zero, states, low_size, rows.get(u, 0), opt.get(u))
                     for u in group if u in layouts or u in rows}
            least = _replay(plan, units, units_of, saved, whole, skip, lanes, recompute, worst=False).peak
        out[rank] = by_group[key] = replace(worst, least=least)
    return out


def sharded_experts(compiled) -> bool:
    return compiled.ir.sharded("experts")


def _member(layout, rank: int) -> int:
    """`rank`'s index in the unit's group (under tp the group is tp index 0's devices: the same
    index along the other axes)."""
    if rank in layout.group:
        return layout.group.index(rank)
    return 0


def predict_job(job, **options) -> dict[int, MemoryPrediction]:
    """`predict_memory` for a compiled `piper.Job`, with its precision and lanes (nothing runs)."""
    options.setdefault("precision", job.training.dtype)
    options.setdefault("lanes", job.concurrent and getattr(job, "device", "cpu") == "cpu")
    return predict_memory(job.compiled, job.program, **options)


_NOTHING = RegionBytes(0)


def _replay(plan, units: dict, units_of: dict, saved: dict, whole, skip, lanes=None,
            recompute=frozenset(), worst: bool = True) -> MemoryPrediction:
    """Replay one device's plan on `units` (changed in place). The items of an overlapped slot's
    lanes run at once: `worst` takes the interleaving that holds most (every backward's
    gradient buffers attached and every forward's activations saved before a backward frees
    its own); else the one that holds least (the backward lanes first, each attaching its
    buffers as it starts, then the forward lanes)."""
    between = {"params": sum(u.params() for u in units.values()),
               "grads": sum(u.grads() for u in units.values()),
               "optimizer": sum(u.optimizer() for u in units.values())}
    state = _Replay(units, units_of, saved, whole, skip, recompute)
    lanes = lanes or {}
    i = 0
    while i < len(plan):
        span = lanes.get(i)
        if span is None:
            if state.reducing and plan[i].node.is_compute:
                state.settle(set(units_of[plan[i].node.region]))
            state.run(plan[i])
            i += 1
            continue
        state.run_span(span, worst)
        i = span.stop
    held, key, params, grads, opt, gathered, acts, flight = state.best or (0, "", 0, 0, 0, 0, 0, 0)
    return MemoryPrediction(held, key, params, grads, opt, gathered, acts, flight, between)


class _Reductions:
    """ZeRO-2/3 gradient reduce-scatters in flight on one device as `_replay` walks its plan: the
    buffer each holds until its wait, or until the executor settles it (`settle`)."""

    def reduce_scatter(self, a):
        unit = self.units[a.node.region]
        direct = not unit.in_flight and unit.grad_shard
        size = unit.full + (0 if direct else unit.shard)
        unit.flat = False
        unit.in_flight.append(size)
        self.pending[a.key] = (a.node.region, size, not direct)
        self.reducing[a.key] = [0, a.node.region]

    def wait(self, a):
        for key in a.waits:
            if key in self.pending:
                self.reducing.pop(key, None)
                self.finish(key)

    def finish(self, key):
        u, size, extra = self.pending.pop(key)
        self.units[u].in_flight.remove(size)
        if extra:
            self.units[u].grad_shard = True

    def settle(self, reads):
        for key in list(self.reducing):
            computes, u = self.reducing[key]
            if computes >= 1 or u in reads:
                del self.reducing[key]
                if key in self.pending:
                    self.finish(key)
            else:
                self.reducing[key][0] = computes + 1


class _Replay(_Reductions):
    """What one device holds as `_replay` walks its plan, and the most it has held so far (`best`)."""

    def __init__(self, units: dict, units_of: dict, saved: dict, whole, skip, recompute):
        self.units, self.units_of, self.saved = units, units_of, saved
        self.whole, self.skip, self.recompute = whole, skip, recompute
        self.activations = 0
        self.pending: dict[str, tuple] = {}     # reduce-scatter key -> (unit, bytes in flight, extra shard)
        self.reducing: dict[str, list] = {}     # reduce-scatter key -> [computes since, unit]
        self.best = None

    def held_by(self, region) -> int:
        """What a region's forward leaves held until its backward frees it."""
        b = self.saved.get(region, _NOTHING)
        return b.inputs if region in self.recompute else b.saved

    def freed_by(self, region) -> int:
        b = self.saved.get(region, _NOTHING)
        return b.inputs + b.rerun if region in self.recompute else b.saved

    def sample(self, key):
        units = self.units.values()
        held = self.activations + sum(u.held() for u in units)
        if self.best is None or held > self.best[0]:
            self.best = (held, key, sum(u.params() for u in units), sum(u.grads() for u in units),
                         sum(u.optimizer() for u in units), sum(u.gathered_bytes() for u in units),
                         self.activations, sum(sum(u.in_flight) for u in units))

    def attach(self, region):
        """A backward that writes weight gradients: the flat buffers and expert rows' `.grad`."""
        for u in self.units_of[region]:
            if u in self.units:
                self.units[u].flat = True
                if self.units[u].experts:
                    self.units[u].expert_grads = True

    def rerun(self, a):
        """A recomputed region's first backward pass runs its forward again (the runtime samples then)."""
        if a.node.region in self.recompute:
            self.activations += self.saved.get(a.node.region, _NOTHING).rerun
            self.sample(a.key)

    def run(self, a):
        node = a.node
        op = node.op
        units = self.units
        self.wait(a)
        # a whole backward (B, or a BI its slot runs whole), keyed by its pass: its piece 0's key
        whole = op == "B" or (op == "BI" and node_key(op, node.region, node.mb) in self.whole)
        if node.value and node.is_compute:
            # a later piece of a pass cut at its collectives: its piece 0 counts the pass's
            # activations, but a backward's first piece (the last one) attaches the gradients
            if whole:
                self.attach(node.region)
        elif op == "F":
            self.activations += self.held_by(node.region)
        elif whole:
            self.rerun(a)
            self.attach(node.region)
            self.activations -= self.freed_by(node.region)
        elif op == "BI":
            self.rerun(a)
        elif op == "BW" and a.key not in self.skip:
            self.attach(node.region)
            self.activations -= self.freed_by(node.region)
        elif op == "UPD" and node.region in units:
            units[node.region].expert_grads = False     # the expert optimizer lets go of them
            if units[node.region].zero <= 1:
                units[node.region].flat = False         # `Unit.release_grads`
            units[node.region].grad_shard = False       # and ZeRO-2/3's shards of the sums
        elif op == "ALL_GATHER" and node.phase and node.region in units:
            units[node.region].gathered = True
        elif op == "REDUCE_SCATTER" and node.region in units:
            self.reduce_scatter(a)
        self.sample(a.key)
        for u in a.release:
            if u in units:
                units[u].gathered = False

    def run_span(self, span, worst: bool):
        """An overlapped slot: its lanes at once, in the interleaving `worst` asks for."""
        if self.reducing:      # the executor settles once, for everything the slot's lanes read
            self.settle({u for lane in span.lanes for a in lane if a.node.is_compute
                         for u in self.units_of[a.node.region]})
        for a in span.before:
            self.run(a)
        # The lanes run at once. At worst a backward's gradient buffers are attached as it starts,
        # and a forward (the shorter item) saves its activations before the backward frees its
        # own; at best the backward is done before the forward saves anything.
        if worst:
            for lane in span.lanes:
                for a in lane:
                    if a.node.op in ("B", "BW") or (a.node.op == "BI" and a.key in self.whole):
                        self.attach(a.node.region)
        ordered = sorted(span.lanes, key=lambda lane: any(a.node.op == "F" for a in lane) != worst)
        for a in (*(a for lane in ordered for a in lane), *span.after):
            self.run(a)


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
