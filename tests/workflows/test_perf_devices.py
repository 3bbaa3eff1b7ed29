"""`perf/tokens_per_s_per_device` divides by every device the step's roles hold (MindSpeed RL's TPS)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from relayrl.cluster import ResourcePool
import relayrl.workflows.pipeline as pipeline
from relayrl.workflows.pipeline import GRPOPipeline


def _group(pool: ResourcePool) -> SimpleNamespace:
    return SimpleNamespace(pool=pool)


def _perf(groups: dict, monkeypatch) -> dict:
    """The step's metrics for roles on ``groups`` (the others absent): 1200 tokens in 2 s."""
    me = SimpleNamespace(**{k: groups.get(k) for k in ("actor", "rollout", "ref", "critic", "teacher", "scorer")})
    me._groups = lambda: GRPOPipeline._groups(me)
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: 102.0)
    return GRPOPipeline.perf(me, {}, 100.0, 1200, None)


def test_a_reference_and_a_critic_on_pools_of_their_own_count_their_devices(monkeypatch):
    main, gen, ref, critic = (ResourcePool("main", 2), ResourcePool("gen", 1), ResourcePool("ref", 1),
                              ResourcePool("critic", 2))
    m = _perf({"actor": _group(main), "rollout": _group(gen), "ref": _group(ref), "critic": _group(critic)}, monkeypatch)
    assert m["perf/tokens_per_s_per_device"] == pytest.approx(1200 / (2.0 * 6))  # 2 + 1 + 1 + 2 devices


def test_a_pool_shared_by_several_roles_counts_once(monkeypatch):
    main, rm = ResourcePool("main", 2), ResourcePool("rm", 1)
    m = _perf({"actor": _group(main), "rollout": _group(main), "ref": _group(main), "scorer": _group(rm)}, monkeypatch)
    assert m["perf/tokens_per_s_per_device"] == pytest.approx(1200 / (2.0 * 3))  # main once, the reward model's pool
