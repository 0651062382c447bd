"""Evaluation on a worker: the forward half of the device's plan, without gradients or updates.

Mixed into `Executor`. The forward-only plan keeps, in the training plan's
order, every forward (F), the activations' transfers (SEND/RECV of phase F)
and the collectives that serve a forward (ZeRO-3's gathers, expert
all-to-alls): each device's plan is still a projection of one global order
restricted alike on every device, so it cannot deadlock, and a rank that
takes part in a forward collective in training takes part in it here. Nothing
touches the gradients, the optimizer or the step count; what a training step
reports (timings, memory peaks, the trace) is left as the last step left it.
"""
from __future__ import annotations

import torch

from ...ir.dag import COLLECTIVES
from ..launch import wire

_FORWARD_COMM = frozenset(("SEND", "RECV", *COLLECTIVES))


def forward_only(plan: tuple) -> tuple:
    """The actions of `plan` a forward pass needs, in order, waiting only on kept keys.

        forward_only([AG_F0, F0, SEND_F0, RECV_B0, B0, REDUCE_SCATTER, UPD]) == [AG_F0, F0, SEND_F0]
    """
    kept = [a for a in plan if a.node.op == "F" or (a.node.op in _FORWARD_COMM and a.node.phase == "F")]
    keys = {a.key for a in kept}
    return tuple(type(a)(a.node, a.peer, a.tag, a.group, tuple(w for w in a.waits if w in keys), a.release)
                 for a in kept)


class Evaluation:
    """`run_eval(batch)`: the losses of a forward pass over this device's microbatches; needs
    `_run`, `_wait`, the units and the step state of `StepState`."""

    _evaluating = False           # read by `_f`: no autograd graph while evaluating

    def run_eval(self, batch: dict[int, list[torch.Tensor]]) -> list[float]:
        plan = getattr(self, "_eval_plan", None)
        if plan is None:
            plan = self._eval_plan = forward_only(self.spec.plan)
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
