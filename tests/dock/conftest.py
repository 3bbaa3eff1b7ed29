"""Fixtures of the dock tests: one Ray cluster (session scope) shared by every Ray test."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """Start Ray once for all ``@pytest.mark.ray`` dock tests (no dashboard, 2 CPUs)."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()
