"""Workers kept after a job closes, for the next job of the same shape in this process.

A worker's start is a new process that imports torch (seconds of CPU each), joins a
placement group and a rendezvous. A notebook or a test suite that compiles job after
job pays that every time. With `PIPER_KEEP_WORKERS=1` a job that closes cleanly
hands its placement group and actors here instead of killing them; the next job
with the same placement (bundles, strategy, device, worker environment) takes them,
and each worker forgets the old job first (`Worker.reset`: process groups, plan,
store). Ranks keep their bundles, so rank r of the new job runs where rank r ran.

A worker that failed, timed out or belongs to a job that did not close cleanly is
never kept: a pool only ever holds processes that answered `reset`. The pool is
emptied by `release()` and at exit, and forgotten when Ray restarts (its actors
died with the old cluster).
"""
from __future__ import annotations

import atexit
import os
import threading

ENV = "PIPER_KEEP_WORKERS"
RESET_S = 30.0        # a healthy idle worker forgets its job in well under this
ALIVE_S = 10.0        # an idle worker answers a status request at once
FIT_S = 5.0           # a placement group that fits is ready well within this
MAX_IDLE = 8          # idle workers kept at most (each holds a few hundred MB); the oldest go first

_lock = threading.Lock()
_idle: list[tuple[tuple, object, list]] = []         # (key, placement group, actors), oldest first
_cluster = None                                      # the Ray cluster the idle workers live in


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def key(placement, device: str, env: dict) -> tuple:
    bundles = tuple(tuple(sorted(b.items())) for b in placement.bundles)
    return (bundles, placement.strategy, tuple(placement.bundle_of), device,
            tuple(sorted((k, str(v)) for k, v in env.items())))


def _this_cluster():
    import ray

    ctx = ray.get_runtime_context()   # a restarted cluster may reuse the address, never the node id
    return ctx.gcs_address, ctx.get_node_id()


def take(k: tuple):
    """(placement group, actors) of an idle set with this key, or None."""
    if not enabled():
        return None
    while True:
        with _lock:
            if _cluster != _this_cluster():        # Ray restarted: whatever was kept died with it
                _idle.clear()
                return None
            found = next((i for i in range(len(_idle) - 1, -1, -1) if _idle[i][0] == k), None)
            if found is None:
                return None
            kept = _idle.pop(found)
        if _alive(kept[2]):
            return kept[1], kept[2]
        _stop([kept])                              # one died while idle (OOM, a node lost): try the next


def _alive(actors) -> bool:
    import ray

    try:
        ray.get([a.status.remote() for a in actors], timeout=ALIVE_S)
    except Exception:
        return False
    return True


def give(k: tuple, pg, actors: list) -> bool:
    """Keep a closed job's workers if they all forget it in time; False: the caller kills them."""
    global _cluster
    if not enabled() or pg is None or not actors:
        return False
    import ray

    try:
        ray.get([a.reset.remote() for a in actors], timeout=RESET_S)
    except Exception:
        return False
    with _lock:
        cluster = _this_cluster()
        if _cluster != cluster:
            _idle.clear()
            _cluster = cluster
        _idle.append((k, pg, actors))
        evicted = []
        while sum(len(a) for _, _, a in _idle) > MAX_IDLE and len(_idle) > 1:
            evicted.append(_idle.pop(0))
    _stop(evicted)
    return True


def release() -> int:
    """Stop every kept worker; returns how many there were."""
    with _lock:
        sets = list(_idle)
        _idle.clear()
    _stop(sets)
    return sum(len(actors) for _, _, actors in sets)


def stop(pg, actors: list) -> None:
    """Kill `actors` and remove their placement group (None: they have none): a job's workers that are
    not kept."""
    _stop([(None, pg, actors)])


def _stop(sets) -> None:
    if not sets:
        return
    try:
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            for _, pg, actors in sets:
                for a in actors:
                    ray.kill(a)
                if pg is not None:
                    remove_placement_group(pg)
    except Exception:
        pass


atexit.register(release)
