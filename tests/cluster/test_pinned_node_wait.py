"""A pool pinned to a node that was lost waits for it to join again; a pool pinned to an unknown node is refused
at once (no Ray cluster: Ray's resource table is replaced)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relayrl.cluster.errors import PlacementError


def test_a_lost_node_is_waited_for_and_an_unknown_one_refused_at_once(monkeypatch):
    from relayrl.cluster import ray_backend  # (it imports ray, ~2.3 s: here, not in every worker's collection)

    calls = []

    def resources():  # the node joins again at the third look
        calls.append(1)
        return {"CPU": 2.0, **({"node:10.0.0.2": 1.0} if len(calls) >= 3 else {})}

    monkeypatch.setattr(ray_backend.ray, "cluster_resources", resources)
    monkeypatch.setattr(ray_backend.time, "sleep", lambda s: None)  # (the deadline still runs on the clock)
    monkeypatch.setattr(ray_backend, "node_ips", lambda: ["10.0.0.1"])
    pool = SimpleNamespace(name="gen", node="10.0.0.2", world_size=1)
    with pytest.raises(PlacementError, match="pinned to node '10.0.0.2'.*not in the Ray cluster; its nodes: 10.0.0.1"):
        ray_backend._node_resource(pool, {"CPU": 2.0})  # at start-up: a typo is not waited for
    assert ray_backend._node_resource(pool, {"CPU": 2.0}, wait_s=10.0) == "node:10.0.0.2"
    calls.clear()
    monkeypatch.setattr(ray_backend.ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(PlacementError, match=r"\(waited 0.05 s\)"):
        ray_backend._node_resource(pool, {"CPU": 2.0}, wait_s=0.05)
