"""Memory accounting on a worker: what is held between steps and at most during the last one.

Mixed into `Executor`; `job.memory()` reports it (`Executor.memory`).
"""
from __future__ import annotations

import threading


class MemoryAccounting:
    """`_sample` after each action, `_release` of gathered parameters, `memory`; needs the units and experts."""

    def _init_accounting(self) -> None:
        self.activation_peak = 0                  # bytes saved for backward, at most, last step
        self.step_peak = 0                        # bytes of units + saved activations, at most, last step
        self._unit_list = list(self.units.values())
        self._param_storages = {full.untyped_storage()._cdata for u in self.units.values() for full in u.full}
        self._param_storages |= {s for u in self.units.values() for s in getattr(u, "storages", list)()}
        if self.experts is not None:      # expert rows are parameters too (expert_mm saves them for backward)
            self._param_storages |= self.experts.storages()
        self._lock = threading.Lock()             # activation accounting and gradient sums, shared by lanes

    def _release(self, action) -> None:
        self._sample()
        for u in action.release:
            self.units[u].release()

    def _sample(self) -> None:
        """Raise `step_peak` to what is held now: every unit's buffers plus the saved activations.

        Sampled after each action (a compute's gathered parameters before they go), so a
        transient inside an action (autograd's own temporaries) is not seen."""
        held = self.activations
        for unit in self._unit_list:
            held += unit.held
        if self.experts is not None:
            held += self.experts.held
        if held > self.step_peak:           # lanes sample too: raise it under the lock
            with self._lock:
                self.step_peak = max(self.step_peak, held)

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held between steps,
        and the peak of activations saved for backward during the last step."""
        total = {"params": 0, "grads": 0, "optimizer": 0}
        for unit in self.units.values():
            for k, v in unit.memory().items():
                total[k] += v
        if self.experts is not None:
            for k, v in self.experts.memory().items():
                total[k] += v
        total["activations_peak"] = self.activation_peak
        total["step_peak"] = self.step_peak
        return total
