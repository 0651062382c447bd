"""What one step holds on a worker: made at its start, let go at its end (`StepState`).

Mixed into `Executor` through `StepLoop`.
"""
from __future__ import annotations

import torch

from ..launch import wire


class StepState:
    """`_begin_step` and `_end_step`; needs the units, `pending`, `sends`, `clip`, `experts`, `_run`
    and `_wait`."""

    def _begin_step(self, batch: dict[int, list[torch.Tensor]]) -> None:
        self.batch = wire.unpack_batch(batch, self.device)
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_out: dict[tuple[int, int, int], torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: list[torch.Tensor] = []
        self.nonfinite: list[str] = []                # units whose update a non-finite gradient skipped
        self.saved_bytes: dict[tuple[int, int], int] = {}
        self._reducing: dict[str, tuple] = {}         # reduce-scatter in flight -> (computes since, unit)
        for unit in self.units.values():
            unit.refresh()
        self.activations = self.activation_peak = self.step_peak = 0
        if self._events:                              # left by a step that failed
            self._events.clear()

    def _end_step(self) -> list[float]:
        """After the plan's last entry: wait for what is in flight, run the updates clipping held
        back, and let the step's tensors go. The losses of the step."""
        for key in list(self.pending):
            self._wait(key)
        for work in self.sends.values():
            work.wait()
        self.sends.clear()
        if self.clip is not None:        # the updates it held back, after clipping
            self.clip.finish(self._unit_list, self._run, self.experts.gradients() if self.experts else ())
            for key in list(self.pending):
                self._wait(key)
        losses = [float(x) for x in self.losses]
        self.current = None
        if self._events:
            self._device_timings()
        del self.values, self.grads, self.grad_out, self.saved, self.batch
        return losses

    def _device_timings(self) -> None:
        """Replace the computes' host times with their CUDA-event times (the step is over)."""
        for key, (begin, done) in self._events.items():
            done.synchronize()
            self.timings[key] = begin.elapsed_time(done) / 1e3
        self._events.clear()
