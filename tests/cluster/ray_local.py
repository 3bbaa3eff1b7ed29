"""A local Ray for the cluster tests, its workers with this folder (the test workers) and the repository on
their path."""

import os

from relayrl.cluster import ClusterConfig


def local_ray(num_cpus: int):
    """Start Ray with ``num_cpus`` CPUs (after shutting down one already running), yield the Ray backend's
    config, shut it down after: the body of a module-scoped fixture (``yield from local_ray(2)``)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ray.init(num_cpus=num_cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, here])}})
    yield ClusterConfig(backend="ray")
    ray.shutdown()
