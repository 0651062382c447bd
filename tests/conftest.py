"""Shared fixtures: one local Ray cluster for the session's tests, shut down at the end.

The suite is hermetic: Piper's cache (`PIPER_CACHE`: tune's
measurements) lives in a temporary folder for the session, removed at its end, and
a local Ray cluster needs no token file (`RAY_AUTH_MODE=disabled`), so nothing is
written under $HOME.
"""
import os
import shutil
import tempfile

import pytest


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output")


# Set before any test imports piper (the parser looks its cache up on first use).
_CACHE = tempfile.mkdtemp(prefix="piper-test-cache-")
os.environ["PIPER_CACHE"] = _CACHE
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)


FULL = bool(os.environ.get("PIPER_FULL"))
# A closed job's workers serve the next job of the same shape (piper/runtime/launch/pool.py): the suite
# starts worker processes (a torch import each) a few times instead of once per job.
os.environ.setdefault("PIPER_KEEP_WORKERS", "1")


# Run last, in this order: test_pool.py empties the pool of kept workers (its counts need an empty one),
# test_multinode.py shuts the session's cluster down for a cluster of several nodes. Anywhere else
# both make every test after them start its workers anew.
_LAST = ("test_pool.py", "test_multinode.py")


def pytest_collection_modifyitems(items):
    items[:] = sorted(items, key=lambda item: _LAST.index(item.path.name) + 1 if item.path.name in _LAST else 0)
    # Everything that needs the cluster is slow: mark it, so `-m "not ray"` runs the rest in seconds.
    # `@pytest.mark.full`: a further case of something the default suite already trains (another
    # strategy, another family); it runs with PIPER_FULL=1, so the default suite stays within minutes.
    skip_full = pytest.mark.skip(reason="runs with PIPER_FULL=1 (a further case of what the default suite covers)")
    for item in items:
        if {"ray_cluster", "two_nodes"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
        if not FULL and item.get_closest_marker("full"):
            item.add_marker(skip_full)


@pytest.fixture(scope="session")
def _ray_session():
    yield
    import ray

    from piper.runtime.launch import pool

    pool.release()
    ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_session):
    """A local Ray cluster; Gloo workers take a sliver of CPU each so any mesh fits.

    Started by the first test that asks and shared by all after it; started again if a
    module with a cluster of its own (test_multinode.py: several nodes) shut it down.
    """
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # "local": a cluster someone started with `ray start` on this machine is not the tests' to use.
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
