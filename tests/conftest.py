"""Shared fixtures: one local Ray cluster per test session, shut down at the end."""
import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output")


def pytest_collection_modifyitems(items):
    # Everything that needs the cluster is slow: mark it, so `-m "not ray"` runs the rest in seconds.
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster; Gloo workers take a sliver of CPU each so any mesh fits."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # "local": a cluster someone started with `ray start` on this machine is not the tests' to use.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()
