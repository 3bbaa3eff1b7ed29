"""Which Ray `ensure_ray` starts or joins, and which it gives a session reaper, decided from the config and
``RAY_ADDRESS`` with Ray's public `ray.init` only (no Ray cluster: `ray.init` is recorded instead, and the
environment it sees: the mark of a local session's processes, its reaper armed before it, then taken out)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from relayrl.cluster.config import ClusterConfig
from relayrl.cluster.reaper import MARK


@pytest.mark.parametrize(("ray_address", "env", "joined"), [
    (None, None, None),  # nothing named: a new local Ray, reaped with this driver
    (None, "", None),  # (an empty RAY_ADDRESS is none, as Ray reads it)
    (None, "10.0.0.1:6379", "10.0.0.1:6379"),  # a Ray job's driver: the cluster RAY_ADDRESS names
    ("auto", "10.0.0.1:6379", "auto"),  # the config's address first
    (None, "local", None),
])
def test_a_local_ray_is_started_with_address_local_and_only_it_gets_a_reaper(monkeypatch, ray_address, env,
                                                                              joined):
    from relayrl.cluster import ray_backend  # (it imports ray, ~2.3 s: here, not in every worker's collection)

    inits, marks = [], []

    def init(**kwargs):
        inits.append(kwargs)
        marks.append((os.environ.get(MARK), os.environ.get("SPT_NOENV")))
        return SimpleNamespace(address_info={"session_dir": "/tmp/ray/session_x"})

    monkeypatch.setattr(ray_backend.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_backend.ray, "init", init)
    monkeypatch.delenv(MARK, raising=False)
    monkeypatch.delenv("SPT_NOENV", raising=False)
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    ray_backend.ensure_ray(ClusterConfig(backend="ray", ray_address=ray_address, num_cpus=3))
    assert len(inits) == 1
    if joined is None:
        assert inits[0] == {"address": "local", "num_cpus": 3, "include_dashboard": False}
        mark, noenv = marks[0]
        assert mark is not None and len(mark) == 32, "what the local Ray starts is marked as its session's"
        assert noenv == "1", "Ray's process titles would overwrite the mark in its workers' and agents' /proc"
    else:
        assert inits[0]["address"] == joined and "num_cpus" not in inits[0]  # (Ray refuses it when joining)
        assert marks == [(None, None)], "a cluster joined is no session of this driver's"
    assert MARK not in os.environ and "SPT_NOENV" not in os.environ, "the environment is not as it was"


def test_a_local_ray_that_fails_to_start_takes_the_mark_out_again(monkeypatch):
    from relayrl.cluster import ray_backend

    def init(**kwargs):
        raise RuntimeError("no room for the object store")

    monkeypatch.setattr(ray_backend.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_backend.ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv(MARK, "f" * 32)  # (this driver is itself a process of another relayrl driver's session)
    with pytest.raises(RuntimeError, match="object store"):
        ray_backend.ensure_ray(ClusterConfig(backend="ray", num_cpus=1))
    assert os.environ[MARK] == "f" * 32
