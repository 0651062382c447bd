"""Running a region cut at its all-to-alls (`piper.moe_cut`): its pieces and the
exchanges between them, each one action of the plan.

Under `shard experts` the plan holds, for one forward of a region with one MoE
layer (keys as `piper show` prints them):

    0F3  0ALL_TO_ALL_F3.0  0F3.1  0ALL_TO_ALL_F3.1  0F3.2          (route | dispatch | experts | combine | rest)

and its backward the mirror image, `0B3.2 0ALL_TO_ALL_B3.1 0B3.1
0ALL_TO_ALL_B3.0 0B3` (BI likewise; BW stays one action). Each piece is run
and differentiated on its own, like a pipeline stage: the values it reads
from earlier pieces and exchanges become leaves, and its backward hands
their gradients back to where they came from. An exchange action issues
its all-to-all asynchronously on the expert group of the calling lane and
returns; the piece after it waits for it (the plan's edge), so anything the
plan puts between them, such as the other lane's compute in an overlapped
slot, runs while the tokens travel.

A dispatch exchanges the per-expert counts first (a small blocking
all-to-all: the row split sizes depend on them, and Gloo does not check that
split sizes agree), then sends the rows. A combine sends them back with the
same splits, reversed. Backward exchanges run the same all-to-alls the other
way; every member issues every exchange, with zero rows where no gradient
reached, so all members of a group issue the same collectives in the same order.
"""
from __future__ import annotations

import time

import torch

from ..ir import node_key
from ..moe_cut import DISPATCH, Cut, Source, cut
from . import experts as expert_groups
from . import recompute
from .saved import SavedBytes
from .split_backward import backward_inputs, backward_weights, can_split

PARAM, VALUE = "param", "value"


class _Pass:
    """One microbatch's run of a cut region, from its first forward piece to its last backward piece."""

    def __init__(self, args, leaves):
        self.args = args                    # the region's inputs (`Executor._args`)
        self.leaves = leaves                # value id -> leaf, for the region's differentiable value inputs
        self.values: dict[Source, object] = {}          # what pieces and exchanges produced
        self.differentiable: set[Source] = set()        # exchange outputs that carry a gradient back
        self.outs: dict[int, tuple] = {}                # piece -> its outputs (kept for its backward)
        self.boundary: dict[int, list] = {}             # piece -> [(Source, leaf)] it read
        self.grads: dict[Source, torch.Tensor] = {}     # gradients waiting for their producer's backward
        self.input_grads: dict[int, torch.Tensor] = {}  # value id -> gradient (BI)
        self.weight_states: dict[int, object] = {}      # piece -> what its BW needs (BI)
        self.kept: dict[int, object] = {}               # piece -> its inputs (a recomputed region)
        self.seeded = False


def _add(grads: dict, key, g) -> None:
    grads[key] = grads[key] + g if key in grads else g


def _no_views(outs) -> tuple:
    """A piece's outputs, a view of its input (a reshape) copied: its own backward for inputs
    (`split_backward`) detaches its outputs in place, which a view does not allow."""
    return tuple(o.clone() if torch.is_tensor(o) and o.requires_grad and o._is_view() else o for o in outs)


def _count(ex, key, size: int) -> None:
    """`size` more bytes saved for the backward of pass `key` (the executor's activation accounting)."""
    with ex._lock:
        ex.saved_bytes[key] += size
        ex.activations += size
        ex.activation_peak = max(ex.activation_peak, ex.activations)


class Pieces:
    """The cut regions of one device and the microbatches in flight through them."""

    def __init__(self, cuts: dict[int, Cut]):
        self.cuts = cuts
        self.passes: dict[tuple[int, int], _Pass] = {}
        self._split: dict[tuple[int, int], bool] = {}     # (region, piece) -> BW resumes from BI

    def __contains__(self, region: int) -> bool:
        return region in self.cuts

    def __bool__(self) -> bool:
        return bool(self.cuts)

    @staticmethod
    def pass_key(node) -> str:
        """The token of the pass a piece belongs to (its piece 0): `0BI3.2` -> `0BI3`."""
        return node_key(node.op, node.region, node.mb)

    # -- forward ------------------------------------------------------------------------------
    def _input(self, run: _Pass, source: Source, piece: int, recomputed: bool):
        if source.kind == "arg":
            return run.args[source.index]
        value = run.values[source]
        # A recomputed region's forward runs without autograd: any floating value may carry a gradient.
        if torch.is_tensor(value) and (value.requires_grad or source in run.differentiable
                                       or recomputed and value.is_floating_point()):
            leaf = value.detach().requires_grad_()
            run.boundary.setdefault(piece, []).append((source, leaf))
            return leaf
        return value

    def forward(self, ex, action) -> None:
        """Run forward piece `action.node.value` (None: piece 0) of its region for its microbatch."""
        node = action.node
        piece, cut, region = node.value or 0, self.cuts[node.region], ex.spec.regions[node.region]
        key = (node.region, node.mb)
        if piece == 0:
            self.passes[key] = _Pass(*ex._args(region, node.mb))
            ex.saved_bytes[key] = 0
        run = self.passes[key]
        inputs = [self._input(run, s, piece, region.recompute) for s in cut.inputs[piece]]
        if region.recompute:     # keep only the piece's inputs; its backward runs it again (`recompute`)
            outs, run.kept[piece], size = recompute.forward(cut.pieces[piece], inputs, ex.device,
                                                            ex._param_storages)
        else:
            with torch.enable_grad(), SavedBytes(ex._param_storages) as saved:
                outs = _no_views(cut.pieces[piece](*inputs))
            size = saved.size
        run.outs[piece] = outs
        for j, out in enumerate(outs):
            run.values[Source("piece", piece, j)] = out
        _count(ex, key, size)
        if piece == len(cut.pieces) - 1:
            outs = [run.args[s.index] if s.kind == "arg" else run.values[s] for s in cut.outputs]
            for v, out in zip(region.outputs, outs):
                ex.values[(v, node.mb)] = out
            if region.loss:
                ex.losses.append(outs[-1].detach())
        ex._release(action)

    # -- exchanges -----------------------------------------------------------------------------
    def exchange(self, ex, action) -> None:
        """Issue exchange `action.node.value` of its pass (forward or backward); the plan's next
        piece waits for it."""
        node = action.node
        k, run = node.value, self.passes[(node.region, node.mb)]
        kind, sources = self.cuts[node.region].exchanges[k]
        group = expert_groups.current()
        out = Source("exchange", k, 0)
        start = time.perf_counter()
        if node.phase == "F":
            rows = run.values[sources[0]]
            if kind == DISPATCH:
                counts = run.values[sources[1]]
                recv_counts = group.exchange_counts(counts)        # blocking: the row splits need them
                size = group.size
                send = counts.view(size, -1).sum(1)
                recv = recv_counts.view(size, -1).sum(1)
                run.values.update({Source("exchange", k, 1): recv_counts, Source("exchange", k, 2): send,
                                   Source("exchange", k, 3): recv})
                received, work = group.all_to_all_async(rows.detach(), recv, send)
            else:
                send, recv = run.values[sources[1]], run.values[sources[2]]
                received, work = group.all_to_all_async(rows.detach(), send, recv)
            run.values[out] = received
            if rows.requires_grad:
                run.differentiable.add(out)
            then = None
        else:
            arrived = run.values.pop(out)
            grad = run.grads.pop(out, None)
            if grad is None:          # no gradient reached these rows: still issue, with zeros
                grad = torch.zeros_like(arrived)
            if kind == DISPATCH:      # gradients of the rows this device received go back to their senders
                send, recv = run.values[Source("exchange", k, 2)], run.values[Source("exchange", k, 3)]
                back, work = group.all_to_all_async(grad, send, recv)
            else:                     # gradients of the rows that came home go out to the experts again
                send, recv = run.values[sources[1]], run.values[sources[2]]
                back, work = group.all_to_all_async(grad, recv, send)
            target = sources[0]

            def then():
                with ex._lock:
                    _add(run.grads, target, back)
        key = action.key

        def done():
            ex.timings[key] = time.perf_counter() - start        # issue to arrival (`comm_cost`)
            if then is not None:
                then()
        ex.pending[key] = ([work], done)

    # -- backward ------------------------------------------------------------------------------
    def _seed(self, ex, run: _Pass, node, region, cut: Cut, *, whole: bool) -> None:
        """The region's output gradients (and the loss's scale) onto the pieces that made them."""
        run.seeded = True
        outs = [None if s.kind == "arg" else run.values[s] for s in cut.outputs]
        for i, (v, out) in enumerate(zip(region.outputs, outs)):
            g = ex.grads.pop((v, node.mb), None)
            if g is not None and out is not None:
                _add(run.grads, cut.outputs[i], g)
        if region.loss:
            # as `BackwardActions._backward_targets` seeds it (fp16's loss scale included)
            scale = ex.spec.grad_scale * getattr(ex.clip, "loss_scale", 1.0)
            _add(run.grads, cut.outputs[-1], torch.full_like(outs[-1], scale))
        if whole:                   # before the first piece writes weight gradients (BW attaches its own)
            ex._grads_for(region)

    def _targets(self, run: _Pass, piece: int):
        tensors, grads = [], []
        for j, out in enumerate(run.outs.pop(piece)):
            g = run.grads.pop(Source("piece", piece, j), None)
            if g is not None and torch.is_tensor(out) and out.requires_grad:
                tensors.append(out)
                grads.append(g)
        return tensors, grads

    def backward(self, ex, action, *, inputs_only: bool = False) -> None:
        """Backward piece `action.node.value` (B, or BI with `inputs_only`); piece 0 comes last and
        hands the region's input gradients on."""
        node = action.node
        piece, cut, region = node.value or 0, self.cuts[node.region], ex.spec.regions[node.region]
        key = (node.region, node.mb)
        run = self.passes[key]
        if not run.seeded:
            self._seed(ex, run, node, region, cut, whole=not inputs_only)
        if piece in run.kept:
            self._rerun(ex, run, node, region, cut, piece)
        tensors, grads = self._targets(run, piece)
        boundary = run.boundary.pop(piece, [])
        if not inputs_only:
            if tensors:
                torch.autograd.backward(tensors, grads)
            for source, leaf in boundary:
                if leaf.grad is not None:
                    _add(run.grads, source, leaf.grad)
        else:
            values = {i: inp.ref for i, inp in enumerate(region.inputs) if inp.kind == VALUE}
            args = [i for i in cut.args_used(piece) if i in values and values[i] in run.leaves]
            leaves = [leaf for _, leaf in boundary] + [run.args[i] for i in args]
            weights = self._weights(ex, region, run, cut, piece)
            if tensors:
                split = self._split.get((node.region, piece))
                if split is None:
                    split = self._split[(node.region, piece)] = can_split(tensors, leaves, weights)
                result, state = backward_inputs(tensors, grads, leaves, weights, split=split)
                run.weight_states[piece] = (weights, state)
                for (source, _), g in zip(boundary, result):
                    if g is not None:
                        _add(run.grads, source, g)
                for i, g in zip(args, result[len(boundary):]):
                    if g is not None:
                        _add(run.input_grads, values[i], g)
        if piece == 0:
            if inputs_only:
                ex._deliver_input_grads(node, run.leaves, run.input_grads)
            else:
                self._finish(ex, key)
                ex._deliver_input_grads(node, run.leaves, {v: leaf.grad for v, leaf in run.leaves.items()})
        ex._release(action)

    def _rerun(self, ex, run: _Pass, node, region, cut: Cut, piece: int) -> None:
        """A recomputed region's piece, forward again with autograd on the inputs it kept (the
        parameters as this backward sees them: a ZeRO-3 unit is gathered again)."""
        kept = run.kept.pop(piece)
        views = {}
        for u in region.units:
            views.update(ex.units[u].views())
            if ex.experts is not None:
                views.update(ex.experts.views(u))
        kept.args = [views[region.inputs[s.index].ref] if s.kind == "arg" and region.inputs[s.index].kind == PARAM
                     else a for s, a in zip(cut.inputs[piece], kept.args)]
        outs, size = recompute.rerun(cut.pieces[piece], kept, ex.device, ex._param_storages)
        run.outs[piece] = _no_views(outs)
        _count(ex, (node.region, node.mb), size)

    def _weights(self, ex, region, run: _Pass, cut: Cut, piece: int) -> list[torch.Tensor]:
        """The weights piece `piece` reads (all the region's where they are not its own inputs)."""
        mine = {id(run.args[i]) for i in cut.args_used(piece) if region.inputs[i].kind == PARAM}
        every = ex._weights(region)
        found = [w for w in every if id(w) in mine]
        return found if found or not mine else every

    def backward_weights(self, ex, action, *, skip: bool = False) -> None:
        """BW: every piece's weight gradients, from what its BI kept (`skip`: its BI ran a whole B)."""
        node = action.node
        key = (node.region, node.mb)
        if skip:
            ex._release(action)
            return
        run = self.passes[key]
        ex._grads_for(ex.spec.regions[node.region])
        for weights, state in run.weight_states.values():
            backward_weights(weights, state)
        self._finish(ex, key)
        ex._release(action)

    def _finish(self, ex, key) -> None:
        del self.passes[key]
        with ex._lock:
            ex.activations -= ex.saved_bytes.pop(key, 0)


def cut_regions(spec, experts) -> Pieces:
    """The regions this device's plan runs as pieces (its plan names a piece of them), cut for
    this device's expert group."""
    regions = {a.node.region for a in spec.plan if a.node.is_compute and a.node.value}
    if not regions:
        return Pieces({})
    size = experts.lanes[0].size
    return Pieces({r: cut(spec.regions[r].graph, size) for r in sorted(regions)})
