"""Starting a job's workers: Ray, placement on the cluster's nodes (or a closed job's workers kept,
`runtime/launch/pool.py`), torch.distributed, set-up.

Mixed into `piper.job.Job`; `placement()` says where each rank went.
"""
from __future__ import annotations

import os
import time

from ..diagnostics import error


class JobStartup:
    """`_start` (called once by `Job.__init__`), `_new_workers` and `placement`; needs `_spec`, `_multi_slots`
    and `_get`."""

    def _start(self, model, optimizer, address, device) -> None:
        import ray

        from ..runtime.launch import pool

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster needs no token
        if not ray.is_initialized():
            self._progress("starting Ray" + (f" (joining {address})" if address else " (a local cluster)"))
            if not address:               # a cluster of its own goes with this process, however it ends
                from ..runtime.launch.cluster_reaper import watch_local_cluster

                watch_local_cluster()
            ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=True)
            self._owns_ray = True
        world = self.mesh.world_size
        gpus = ray.cluster_resources().get("GPU", 0)
        if device == "auto":
            device = "cuda" if gpus >= world else "cpu"
        elif device == "cuda" and gpus < world:
            # Waiting `timeout` for a placement group that can never fit tells the user nothing.
            raise error("no-resources", f"device='cuda' needs a GPU for each of the {world} devices, and the Ray "
                        f"cluster has {gpus:g}", hint="shrink the mesh, add GPUs to the cluster, or run on CPU "
                        "(device='cpu', Gloo)")
        self.device = device
        from .memory_check import check_memory, local_address

        check_memory(self, optimizer, ray.nodes(), local_address())    # before any worker starts
        from ..runtime.launch.placement import node_capacity, plan_placement
        from ..runtime.health import faults
        from ..runtime.health.watch import Watch

        started = time.monotonic()
        placement = plan_placement(self.mesh.axes, node_capacity(ray.nodes(), device), device)
        self._progress(f"placing {world} worker{'s' if world != 1 else ''} ({placement.strategy} over the cluster's nodes)")
        # A test's injected fault (runtime.health.faults) reaches the workers with their set-up, not in
        # their environment: it is no part of the pool's key, so kept workers serve fault tests too.
        self._fault = self.worker_env.pop(faults.ENV, None) or os.environ.get(faults.ENV) or None
        self._pool_key = pool.key(placement, device, self.worker_env)
        kept = pool.take(self._pool_key)       # PIPER_KEEP_WORKERS: a closed job's workers of this shape
        if kept is not None:
            self._pg, self.actors = kept
        else:
            self._pg, self.actors = self._new_workers(placement, device, world)
        self._watch = Watch(self.actors, self.mesh)
        from .quiet import quiet_driver_noise, quiet_worker_noise

        quiet_driver_noise()
        quieted = [a.__ray_call__.remote(quiet_worker_noise) for a in self.actors]
        self.where = dict(enumerate(self._get([a.where.remote() for a in self.actors], "start",
                                              self.startup_timeout)))
        self._get(quieted, "start", self.startup_timeout)
        self._watch.where = self.where
        self._progress(f"{world} worker{'s' if world != 1 else ''} started on {len({w['node'] for w in self.where.values()})} node(s) "
                       f"({time.monotonic() - started:.1f} s); joining torch.distributed")
        self.rendezvous = self._get([self.actors[0].rendezvous_address.remote()], "start", self.startup_timeout)[0]
        self.pids = self._get([a.init.remote(self.rendezvous, self.timeout) for a in self.actors], "join",
                              self.startup_timeout)
        params = dict(model.named_parameters())
        slots = self._multi_slots()
        received = self._received(slots)
        refs = [a.setup.remote(*self._spec(rank, params, optimizer, slots.get(rank, ()), received.get(rank)),
                               self._fault)
                for rank, a in enumerate(self.actors)]
        self._get(refs, "set up", self.startup_timeout)
        self._progress(f"workers ready ({time.monotonic() - started:.1f} s)")

    def _new_workers(self, placement, device, world):
        """A placement group for the mesh and one actor per rank in its bundle."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ..runtime.workers.worker import Worker

        from ..runtime.launch import pool

        pg = placement_group([dict(b) for b in placement.bundles], strategy=placement.strategy)
        self._pg = pg            # removed by `close` if what follows fails
        # Kept workers of other shapes (PIPER_KEEP_WORKERS) may hold what this group needs: a group
        # that does not fit at once lets them go, then waits as long as a start may take.
        ready = pg.wait(timeout_seconds=min(pool.FIT_S, self.startup_timeout))
        if not ready:
            pool.release()
            ready = pg.wait(timeout_seconds=self.startup_timeout)
        if not ready:
            raise error("no-resources", f"the cluster cannot host {world} workers ({placement.strategy} of "
                        f"{len(placement.bundles)} bundles of {placement.bundles[0]})",
                        hint="shrink the mesh or add nodes/GPUs to the Ray cluster")
        actor = ray.remote(concurrency_groups={"health": 1})(Worker)    # `Worker.status` answers mid-step
        return pg, [
            actor.options(**placement.resources(device),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              pg, placement_group_bundle_index=placement.bundle_of[r]),
                          **({"runtime_env": {"env_vars": {k: str(v) for k, v in self.worker_env.items()}}}
                             if self.worker_env else {}))
            .remote(r, world, device)
            for r in range(world)]

    def placement(self) -> dict[int, dict]:
        """Where every rank runs: `{rank: {"node": id, "ip": ..., "device": "cpu" | "cuda:N", "pid": ...,
        "coords": {"dp": 0, "pp": 1}}}` (`cuda:N` is the GPU's physical index on its node)."""
        return {rank: {**w, "coords": self.mesh.coords(rank)} for rank, w in self.where.items()}
