"""Asking the workers for their status (in the background while a call runs, and all
at once on a failure), and looking closer at those that do not answer: a process
on the driver's node directly (/proc), a lost node through Ray.

Mixed into `Watch` (`watch`).
"""
from __future__ import annotations

import os


class Probing:
    # -- while waiting: status requests in the background, so a death shows what was running
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

    # -- on a failure: who is alive, dead or silent
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


def _death_reason(exc) -> str:
    text = str(exc).lower()
    if "node" in text and ("died" in text or "dead" in text or "lost" in text) and "worker" not in text:
        return "its node was lost"
    return "the process exited (killed by a signal, out of memory, or a crash)"


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
