"""Evaluation on a worker: the forward half of the device's plan, without gradients or updates.

Mixed into `Executor`. The forward-only plan keeps, in the training plan's
order, every forward (F), the activations' transfers (SEND/RECV of phase F),
the collectives that serve a forward (expert all-to-alls, and ZeRO-3's gathers
of whatever pass whose parameters a forward reads) and the releases of those
gathered parameters: each device's plan is still a projection of one global
order restricted alike on every device, so it cannot deadlock, and a rank that
takes part in a forward collective in training takes part in it here. Nothing
touches the gradients, the optimizer or the step count; what a training step
reports (timings, memory peaks, the trace) is left as the last step left it.
"""
from __future__ import annotations

import torch

from ...ir.dag import COLLECTIVES
from ..launch import wire

_FORWARD_COMM = frozenset(("SEND", "RECV", *COLLECTIVES))


def forward_only(plan: tuple, uses: dict[int, tuple[int, ...]]) -> tuple:
    """The actions of `plan` a forward pass needs, in order, waiting only on kept keys.

        forward_only([AG_F0, F0, SEND_F0, RECV_B0, B0, REDUCE_SCATTER, UPD], uses) == [AG_F0, F0, SEND_F0]

    `uses` maps a region to the units (owner regions) whose parameters it reads (`RegionSpec.units`).

    ZeRO-3 gathers a unit once for a run of computes that read it and frees it after the run's
    last (`compiler.collectives._gathers`). Such a run can join a backward and the forwards after
    it: with a region per block, 1F1B runs `0B0 0F2` back to back on a device, and 0F2 reads the
    parameters gathered for 0B0. So a gather of any pass stays while a kept forward reads its unit
    before the unit's next release, each forward waits on the gather it reads, and a dropped
    compute that releases units stays for its release alone (`is_release_only`: its compute is
    skipped), so gathered parameters go where training lets them go. A unit's gathers and
    releases are then training's, less gathers nothing reads: alike on every member of its group.
    """
    needed = _gathers_read(plan, uses)
    kept, last = [], {}                   # last: unit -> the key of the kept gather it holds now
    for a in plan:
        node = a.node
        if node.op == "ALL_GATHER" and node.phase:          # ZeRO-3's (ZeRO-1/2's follows UPD)
            if a.key in needed:
                last[node.region] = a.key
                kept.append(a)
        elif node.op == "F":
            waits = list(a.waits)         # those not kept go below
            waits += [last[u] for u in uses.get(node.region, ()) if u in last and last[u] not in waits]
            kept.append(_with(a, waits))
            for u in a.release:
                last.pop(u, None)
        elif node.is_compute:
            held = [u for u in a.release if u in last]
            if held:                      # a release of units no kept gather filled is no release
                kept.append(_with(a, [last.pop(u) for u in held]))
        elif node.op in _FORWARD_COMM and node.phase == "F":
            kept.append(a)
    keys = {a.key for a in kept}
    return tuple(_with(a, [w for w in a.waits if w in keys]) for a in kept)


def is_release_only(action) -> bool:
    """A compute of the forward-only plan other than F: kept for the units it releases."""
    return action.node.op != "F" and action.node.is_compute


def _gathers_read(plan: tuple, uses: dict) -> set[str]:
    """The keys of ZeRO-3 gathers whose unit a forward reads before the unit is next released."""
    read: dict[int, bool] = {}            # unit -> a forward later reads it before any release
    out = set()
    for a in reversed(plan):
        node = a.node
        if node.is_compute:
            for u in a.release:           # released after the compute ran
                read[u] = False
            if node.op == "F":
                for u in uses.get(node.region, ()):
                    read[u] = True
        elif node.op == "ALL_GATHER" and node.phase:
            if read.get(node.region):
                out.add(a.key)
            read[node.region] = False     # training gathers a unit only when it is released
    return out


def _with(action, waits):
    return type(action)(action.node, action.peer, action.tag, action.group, tuple(waits), action.release)


class Evaluation:
    """`run_eval(batch)`: the losses of a forward pass over this device's microbatches; needs
    `_run`, `_wait`, the units and the step state of `StepState`."""

    _evaluating = False           # read by `_f`: no autograd graph while evaluating

    def run_eval(self, batch: dict[int, list[torch.Tensor]]) -> list[float]:
        plan = getattr(self, "_eval_plan", None)
        if plan is None:
            plan = self._eval_plan = forward_only(
                self.spec.plan, {r: region.units for r, region in self.spec.regions.items()})
        kept = (dict(self.timings), dict(self.cpu_timings), getattr(self, "step_peak", 0),
                getattr(self, "activation_peak", 0))
        self._spans_now, self._done_at = [], {}
        self.batch = wire.unpack_batch(batch, self.device)
        self.values, self.grads, self.grad_out, self.saved, self.saved_bytes = {}, {}, {}, {}, {}
        self.losses = []
        self._reducing = {}
        self.activations = 0
        for unit in self.units.values():
            unit.refresh()
        self._evaluating = True
        try:
            with torch.no_grad():
                for action in plan:
                    if is_release_only(action):
                        for key in action.waits:      # the gather must land before its storage goes
                            self._wait(key)
                        for u in action.release:
                            self.units[u].release()
                        continue
                    self._run(action)
                    self._let_go_values(action.key)
                for key in list(self.pending):
                    self._wait(key)
                for work in self.sends.values():
                    work.wait()
                self.sends.clear()
            return [float(x) for x in self.losses]
        finally:
            self._evaluating = False
            self.current = None
            for unit in self.units.values():
                if unit.zero == 3:       # a gathered unit whose release was in backward
                    unit.release()
            self.timings, self.cpu_timings, self.step_peak, self.activation_peak = kept
            self.activations = 0
            if self._events:
                self._events.clear()
            for name in ("values", "grads", "grad_out", "saved", "batch"):
                self.__dict__.pop(name, None)
