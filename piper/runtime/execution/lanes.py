"""Overlapped slots (`[F(...), B(...)]` in an `order`): their items run at once, one lane per item.

Mixed into `Executor`. Which plan positions start such a slot, and how its
items divide into lanes, comes from `slots.spans`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ...expert_context import lane_group
from ...tensor_context import lane_group as tensor_lane
from ...compiler.slots import exchanges, interleaved, spans
from ..launch.specs import VALUE


class Lanes:
    """`_run_span` over the slots found at start (`_init_lanes`); needs `_run`, `timings` and `experts`."""

    def _init_lanes(self, spec) -> None:
        # Overlapped slots run their items in threads on CPU, where Gloo matches messages by
        # tag. NCCL matches point-to-point messages by issue order and its communicators
        # must not be called from two threads at once, so CUDA runs the items in turn.
        concurrent = spec.concurrent and self.device.type == "cpu"
        units_of = {r: set(region.units) for r, region in spec.regions.items()}
        feeds = {r: {spec.values[i.ref][0] for i in region.inputs if i.kind == VALUE}
                 for r, region in spec.regions.items()}
        self._spans = spans(spec.plan, spec.slots, units_of, feeds) if concurrent else {}
        # In turn on CPU, the items of a slot that exchange tokens switch at each exchange (`interleaved`).
        self._interleave = not concurrent and self.device.type == "cpu" and bool(self.pieces)
        if self._interleave:
            self._spans = {i: s for i, s in spans(spec.plan, spec.slots, units_of, feeds).items() if exchanges(s)}
        # Units the compute (or overlapped slot) starting at each plan position reads (`_settle_reductions`).
        self._reads = {i: frozenset(spec.regions[a.node.region].units) for i, a in enumerate(spec.plan)
                       if a.node.is_compute}
        for i, s in self._spans.items():
            self._reads[i] = frozenset(u for lane in s.lanes for a in lane if a.node.is_compute
                                       for u in spec.regions[a.node.region].units)
        lanes = max((len(s.lanes) for s in self._spans.values()), default=1) if concurrent else 1
        self._pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="piper-lane") if lanes > 1 else None

    def _run_lane(self, lane, number: int = 0) -> tuple[float, float]:
        """Run a lane's actions; (start of its first compute, end of its last)."""
        with lane_group(self.experts and self.experts.lanes, number), \
                tensor_lane(getattr(self, "tensor_groups", None), number):   # its own expert and TP groups
            busy = [self._run(a) for a in lane]
        computes = [t for a, t in zip(lane, busy) if a.node.is_compute]
        return computes[0][0], computes[-1][1]

    def _run_span(self, span) -> None:
        """An overlapped slot: its items at once, one per lane (see `slots`)."""
        for action in span.before:
            self._run(action)
        if self._interleave:              # in turn, switching items at their expert exchanges
            for action in interleaved(span):
                self._run(action)
            for action in span.after:
                self._run(action)
            return
        first, *rest = span.lanes
        futures = [self._pool.submit(self._run_lane, lane, k) for k, lane in enumerate(rest, 1)]
        try:
            times = [self._run_lane(first)]
        finally:
            errors = [f.exception() for f in futures]    # never leave a lane running behind an error
        for exc in errors:
            if exc is not None:
                raise exc
        times += [f.result() for f in futures]
        # The slot's cost as the simulator counts it: computing, from the first lane's
        # start to the last lane's end (waits for inputs before that are not its cost).
        self.timings[span.key] = max(end for _, end in times) - min(start for start, _ in times)
        # In CPU seconds the slot costs both lanes: a device is one core's worth of work in
        # the cost model, which lets lanes use an idle core only through `cores=`.
        self.cpu_timings[span.key] = sum(self.cpu_timings[a.key] for lane in span.lanes for a in lane
                                         if a.node.is_compute)
        for action in span.after:
            self._run(action)
