"""The driver's watch over its workers: wait for their results, and when something goes
wrong, find out which worker it was before blaming anyone.

A killed worker's peers usually fail first (Gloo: "Connection reset by peer"), so
the first error to arrive names the wrong rank. `Watch.wait` therefore asks every
worker for its status (`Worker.status`, answered from its own concurrency group
even mid-step) and sorts them into alive, dead (Ray says the actor died) and
silent (no answer: stopped, or on a node Ray has not yet declared lost), and
names the dead or silent ones: rank, mesh position, node, pid and the action
they were last seen running.
"""
from __future__ import annotations

import time

from ..launch.placement import describe_rank
from ...diagnostics import PiperError, error
from .failure_messages import FailureMessages
from .probing import Probing, _death_reason, _lost_nodes_confirmed

POLL_S = 0.5          # while a call runs, ask for statuses this often (what was running, if it dies)
ANSWER_S = 3.0        # a live worker answers a status request within this, even mid-step
LOST_NODE_S = 30.0    # the longest we wait for Ray to confirm that a silent worker's node is gone


class Watch(Probing, FailureMessages):
    """Waits on calls to a job's workers and names the worker behind a failure."""

    def __init__(self, actors, mesh, where: dict[int, dict] | None = None):
        self.actors = actors
        self.mesh = mesh
        self.where = where or {}
        self.last: dict[int, tuple[int, str | None]] = {}    # rank -> (steps done, action) last reported
        self._polls: dict = {}                                 # status requests in flight -> rank
        self.stopped: set[int] = set()                         # ranks seen stopped (state T) on this node

    def describe(self, rank: int) -> str:
        coords = self.mesh.coords(rank) if self.mesh.axes else {}
        return describe_rank(rank, coords, self.where.get(rank))

    # -- waiting ------------------------------------------------------------------------
    def wait(self, refs: list, what: str, limit: float, ranks: list[int] | None = None, on_poll=None) -> list:
        """Results of `refs` (one per rank in `ranks`, default all) within `limit` seconds,
        or a PiperError naming the worker that died, stalled or failed. `on_poll()`, called at each
        poll, returns True when the calls made progress: the `limit` then counts from there."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = dict(zip(refs, ranks))
        deadline = time.monotonic() + limit
        results = {}
        remaining = list(refs)
        while remaining:
            left = deadline - time.monotonic()
            if left <= 0:
                err = self.diagnose(what, limit=limit)
                _drain(remaining)
                raise err
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=min(POLL_S, left))
            if not ready:
                self._poll()
                if on_poll is not None and on_poll():
                    deadline = time.monotonic() + limit
                continue
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except Exception as exc:    # noqa: BLE001 - every failure is diagnosed below
                    err = self.diagnose(what, failed=(rank_of[ref], exc))
                    _drain([r for r in refs if r not in results])
                    raise err from None
        return [results[r] for r in refs]

    # -- who is it? (asking: `probing`; the messages: `failure_messages`) -----------
    def diagnose(self, what: str, *, failed: tuple[int, BaseException] | None = None,
                 limit: float | None = None) -> PiperError:
        """The error to raise: dead workers first, then silent ones, then the one that failed."""
        import ray.exceptions as rex

        self._collect()          # what the workers said they were running, up to the failure
        self._polls.clear()
        alive, dead, silent = self.probe(ANSWER_S)
        if failed is not None and isinstance(failed[1], rex.RayActorError):
            dead.setdefault(failed[0], _death_reason(failed[1]))
            silent.discard(failed[0])
            alive.pop(failed[0], None)
        # A silent worker is stalled, or dead in a way Ray has not reported yet (a lost node takes
        # its health checks). A process on the driver's own node can be looked at directly.
        stopped = self._look_locally(silent, dead)
        silent -= set(dead)
        suspects = silent - stopped
        if failed is None:
            # The deadline passed and nothing failed: only a worker whose whole node is silent may be dead.
            answering_nodes = {self.where.get(r, {}).get("node") for r in alive}
            suspects = {r for r in suspects if self.where.get(r, {}).get("node") not in answering_nodes}
        lost_by = time.monotonic() + LOST_NODE_S
        while suspects and not dead and time.monotonic() < lost_by:
            more_alive, more_dead, still = self.probe(ANSWER_S)
            alive.update(more_alive)
            dead.update(more_dead)
            silent = (silent & still) - set(more_dead) - set(more_alive)
            suspects &= silent
            suspects -= set(_lost_nodes_confirmed(self.where, suspects, dead))
        if dead:
            self._whole_nodes(dead)
            return self._died(what, dead, alive)
        if silent:
            return self._stalled(what, silent, alive, limit)
        if failed is not None:
            return self._failed(what, *failed)
        return error("worker-timeout", f"workers did not finish `{what}` within {limit:.0f} s, and every worker "
                     f"answers: {self._positions(alive)}",
                     hint="a worker is very slow or the plan waits on itself; raise timeout= in piper.compile "
                          "if the model is large, or check the workers' logs")


def _drain(refs) -> None:
    """Read the errors of the calls that already failed, so Ray does not log each peer's traceback
    as unhandled: the diagnosis above is the one message."""
    import ray

    if not refs:
        return
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for ref in done:
        try:
            ray.get(ref)
        except Exception:    # noqa: BLE001
            pass
