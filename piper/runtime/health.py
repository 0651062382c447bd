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

import os
import time

from ..cluster import describe_rank
from ..diagnostics import PiperError, error

POLL_S = 0.5          # while a call runs, ask for statuses this often (what was running, if it dies)
ANSWER_S = 3.0        # a live worker answers a status request within this, even mid-step
LOST_NODE_S = 30.0    # the longest we wait for Ray to confirm that a silent worker's node is gone


class Watch:
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
    def wait(self, refs: list, what: str, limit: float, ranks: list[int] | None = None) -> list:
        """Results of `refs` (one per rank in `ranks`, default all) within `limit` seconds,
        or a PiperError naming the worker that died, stalled or failed."""
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
                continue
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except Exception as exc:    # noqa: BLE001 - every failure is diagnosed below
                    err = self.diagnose(what, failed=(rank_of[ref], exc))
                    _drain([r for r in refs if r not in results])
                    raise err from None
        return [results[r] for r in refs]

    def _collect(self) -> None:
        """Record the status answers that came back."""
        import ray

        if self._polls:
            done, _ = ray.wait(list(self._polls), num_returns=len(self._polls), timeout=0)
            for ref in done:
                rank = self._polls.pop(ref)
                try:
                    self.last[rank] = ray.get(ref)
                except Exception:    # noqa: BLE001 - a dead worker shows up in diagnose
                    pass

    def _poll(self) -> None:
        """Collect the status answers that came back; ask the others again."""
        self._collect()
        asked = set(self._polls.values())
        for rank, actor in enumerate(self.actors):
            if rank not in asked:
                self._polls[actor.status.remote()] = rank

    # -- who is it? ---------------------------------------------------------------------
    def probe(self, wait_s: float) -> tuple[dict, dict, set]:
        """Ask every worker for its status: (alive {rank: status}, dead {rank: reason}, silent {ranks})."""
        import ray
        import ray.exceptions as rex

        refs = {actor.status.remote(): rank for rank, actor in enumerate(self.actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        alive, dead = {}, {}
        for ref in ready:
            rank = refs[ref]
            try:
                alive[rank] = self.last[rank] = ray.get(ref)
            except rex.RayActorError as exc:
                dead[rank] = _death_reason(exc)
            except Exception as exc:    # noqa: BLE001
                dead[rank] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        silent = set(range(len(self.actors))) - set(alive) - set(dead)
        return alive, dead, silent

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

    def _look_locally(self, silent: set, dead: dict) -> set:
        """Silent ranks on the driver's node: a missing process goes into `dead`; returns the
        ranks whose process is stopped (SIGSTOP, state T in /proc)."""
        import ray

        if not os.path.isdir("/proc/self"):    # no procfs (macOS): rely on Ray alone
            return set()
        try:
            here = ray.get_runtime_context().get_node_id()
        except Exception:    # noqa: BLE001 - Ray client: the driver is on no node
            return set()
        stopped = set()
        for r in silent:
            where = self.where.get(r, {})
            if where.get("node") != here or "pid" not in where:
                continue
            state = _process_state(where["pid"])
            if state is None:
                dead[r] = "the process is gone (killed by a signal, out of memory, or a crash)"
            elif state == "T":
                stopped.add(r)
                self.stopped.add(r)
        return stopped

    def _whole_nodes(self, dead: dict) -> None:
        """Several workers of one node dying at once is the node going, whatever each process saw."""
        nodes = {self.where.get(r, {}).get("node") for r in dead} - {None}
        for node in nodes:
            on_node = {r for r, w in self.where.items() if w.get("node") == node}
            if len(on_node) > 1 and on_node <= set(dead):
                for r in on_node:
                    if dead[r] != "its node was lost":
                        dead[r] = f"every worker on node {node[:8]} died at once (the node was lost or restarted)"

    # -- messages -----------------------------------------------------------------------
    def _running(self, rank: int) -> str:
        steps, action = self.last.get(rank, (None, None))
        if action is None:
            return ""
        return f" while running {action} (step {steps})"

    def _positions(self, alive: dict) -> str:
        return "; ".join(f"rank {r} at {a or 'no action'}" for r, (_, a) in sorted(alive.items())) or "none"

    def _died(self, what: str, dead: dict, alive: dict) -> PiperError:
        lines = [f"{self.describe(r)} died during `{what}`{self._running(r)}: {reason}"
                 for r, reason in sorted(dead.items())]
        notes = ["the other workers were at: " + self._positions(alive)] if alive else []
        notes += lines[1:]
        return error("worker-died", lines[0], notes=tuple(notes),
                     hint="the job was closed; `piper run --max-restarts N` restarts a run from its last "
                          "checkpoint, or check the worker's memory use and logs, then compile a new job")

    def _stalled(self, what: str, silent: set, alive: dict, limit: float | None) -> PiperError:
        names = [f"{self.describe(r)} does not answer" + (f"; it was last seen{self._running(r)}"
                                                        if self._running(r) else "") for r in sorted(silent)]
        within = f"within {limit:.0f} s" if limit is not None else "in time"
        why = ("its process is stopped (SIGSTOP or a debugger)" if min(silent) in self.stopped
               else "stopped, swapping, or stuck outside Python")
        message = f"workers did not finish `{what}` {within}: {names[0]} ({why})"
        notes = [f"also not answering: {n}" for n in names[1:]]
        if alive:
            notes.append("the other workers answer, at: " + self._positions(alive))
        return error("worker-timeout", message, notes=tuple(notes),
                     hint="the job was closed; look at that process (e.g. `py-spy dump --pid PID`, or whether it "
                          "was stopped), or raise timeout= in piper.compile if it is only slow")

    def _failed(self, what: str, rank: int, exc: BaseException) -> PiperError:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, PiperError):
            return cause
        inner = cause or exc
        text = str(inner).strip().splitlines()
        trace = [line for line in str(exc).splitlines() if line.strip()][-8:]
        return error("worker-failed", f"{self.describe(rank)} failed during `{what}`"
                     f"{self._running(rank)}: {type(inner).__name__}: {text[-1] if text else ''}",
                     notes=("worker traceback (last lines):\n" + "\n".join(trace),),
                     hint="the job was closed; the message above comes from the worker")


def _death_reason(exc) -> str:
    text = str(exc).lower()
    if "node" in text and ("died" in text or "dead" in text or "lost" in text) and "worker" not in text:
        return "its node was lost"
    return "the process exited (killed by a signal, out of memory, or a crash)"


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


def _process_state(pid: int) -> str | None:
    """The state letter of a process on this machine (R, S, T, Z...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


def _lost_nodes_confirmed(where: dict, ranks: set, dead: dict) -> list[int]:
    """Ranks among `ranks` whose node Ray lists as dead: marked in `dead`, and returned."""
    import ray

    try:
        alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:    # noqa: BLE001 - Ray client connections cannot list nodes
        return []
    out = []
    for r in ranks:
        node = where.get(r, {}).get("node")
        if node is not None and node not in alive_nodes:
            dead[r] = "its node was lost"
            out.append(r)
    return out
