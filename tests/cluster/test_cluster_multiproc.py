"""Local backend with several ranks: rank processes (forked from a preloaded server) forming a gloo group."""
import os
import signal

import pytest
import torch

from cluster_workers import CountsPickles, Echo, Rows
from relayrl.cluster import ClusterConfig, ResourcePool, WorkerError, WorkerGroup

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup(Echo, ResourcePool("mp", devices=2), name="mp", init_kwargs={"tag": "m"}, distributed=True)
    yield g
    g.shutdown()


def test_ranks_are_separate_processes_with_torch_distributed_env(group):
    who = group.all("whoami")
    assert [w["rank"] for w in who] == [0, 1]
    assert {w["world_size"] for w in who} == {2} and {w["group"] for w in who} == {"mp"}
    assert [w["env_rank"] for w in who] == ["0", "1"] and all(w["distributed"] for w in who)
    pids = [w["pid"] for w in who]
    assert pids == group.pids() and len(set(pids)) == 2 and os.getpid() not in pids


def test_cpu_ranks_fork_from_a_preloaded_server_and_see_the_drivers_environment_now(group, monkeypatch):
    """CPU ranks start from the fork server that imported torch and transformers once; a rank still gets the
    driver's environment as it is when its group starts, not the server's from when the server started
    (fails without the environment passed: the second group would not see the variable)."""
    assert group.all("start_method") == ["forkserver", "forkserver"]
    assert group.all("modules_at_start") == [True, True]
    monkeypatch.setenv("RELAYRL_TEST_SET_LATER", "after the server started")
    monkeypatch.delenv("RELAYRL_CACHE", raising=False)
    later = WorkerGroup(Echo, ResourcePool("later", devices=2), name="later")
    try:
        assert later.all("env", "RELAYRL_TEST_SET_LATER") == ["after the server started"] * 2
        assert later.all("env", "RELAYRL_CACHE") == [None, None]  # removed in the driver: gone in the rank
    finally:
        later.shutdown()


def test_dispatch_and_gather_order(group):
    assert group.all("echo", 2, scale=3) == [(0, 6), (1, 6)]
    assert group.split("tag_items", [0, 1, 2, 3, 4], offset=1) == [(0, 1), (0, 2), (0, 3), (1, 4), (1, 5)]
    assert torch.equal(group.split("double", torch.arange(5)), torch.arange(5) * 2)
    assert group.split("rows_plus_rank", Rows([1, 2, 3, 4])) == Rows([1, 2, 103, 104])
    assert group.one("echo", "x", rank=1) == (1, "x")


def test_a_method_reference_reaches_rank_processes_by_its_name(group):
    """Only the name crosses the pipe (a function is never pickled); results are as for the name."""
    assert group.all(Echo.echo, 2, scale=3) == [(0, 6), (1, 6)]
    assert group.split(Echo.tag_items, [0, 1, 2], offset=1) == [(0, 1), (0, 2), (1, 3)]
    assert group.one(Echo.echo, "x", rank=1) == (1, "x")
    assert group.all(Echo.all_reduce_rank) == [3.0, 3.0]


def test_bytes_count_arguments_per_rank_and_results(group):
    group.reset_bytes()
    group.all("echo", torch.ones(5))  # 20 bytes of arguments to each of 2 ranks, 20 bytes back from each
    group.split("double", torch.arange(4, dtype=torch.float32))  # 8 bytes to each rank, 8 back from each
    assert group.bytes_by_method == {"echo": 80, "double": 32}


def test_an_all_call_pickles_its_payload_once(group):
    CountsPickles.pickled = 0
    assert group.all("echo", CountsPickles(7)) == [(0, CountsPickles(7)), (1, CountsPickles(7))]
    assert CountsPickles.pickled == 1  # one pickle for both rank processes
    CountsPickles.pickled = 0
    group.split("tag_items", [CountsPickles(1), CountsPickles(2)])
    assert CountsPickles.pickled == 2  # split payloads differ per rank


def test_collectives_inside_the_group(group):
    assert group.all("all_reduce_rank") == [3.0, 3.0]
    assert group.all("all_gather_rank") == [[0, 10], [0, 10]]


def test_rank0_kinds_run_on_every_rank_and_return_rank_0s_result(group):
    assert group.all_rank0(Echo.all_reduce_rank) == 3.0  # a collective: both ranks joined
    assert group.all_rank0("echo", 2, scale=3) == (0, 6)
    # split_rank0 is rank 0's result, not the gathered one (split concatenates lists: [0] would be a row of it)
    assert group.split_rank0(Echo.tag_items, [0, 1, 2, 3], offset=1) == [(0, 1), (0, 2)]
    assert group.split(Echo.tag_items, [0, 1, 2, 3], offset=1)[0] == (0, 1)
    assert group.all_rank0_async("echo", 4).result(timeout=30) == (0, 4)
    assert group.split_rank0_async("tag_items", [5, 6]).result(timeout=30) == [(0, 5)]


def test_async_calls_keep_order(group):
    futs = [group.all_async("echo", i) for i in range(4)]
    assert [f.result(timeout=30) for f in futs] == [[(0, i), (1, i)] for i in range(4)]


def test_remote_error_carries_rank_method_and_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.all("boom", on_rank=1)
    err = info.value
    assert (err.group, err.rank, err.method) == ("mp", 1, "boom")
    assert "ValueError: boom on rank 1" in err.remote_traceback and "cluster_workers.py" in err.remote_traceback
    with pytest.raises(WorkerError, match="could not be pickled"):
        group.one("unpicklable", rank=0)
    with pytest.raises(TypeError, match="'mp': the arguments of 'identity' cannot be pickled"):
        group.one("identity", lambda: 0)
    assert group.all("echo", 1) == [(0, 1), (1, 1)]  # the group is still usable


def test_a_user_error_on_every_rank_arrives_as_one_message(group):
    with pytest.raises(WorkerError) as info:
        group.all("user_mistake", "train.jsonl")
    err = info.value
    assert err.user_message == "train.jsonl row 3: field 'answer' is missing (columns present: prompt)"
    assert sorted([err.rank, *err.other_ranks]) == [0, 1]
    assert err.brief() == ("worker group 'mp' ranks 0, 1 failed in 'user_mistake': train.jsonl row 3: field "
                           "'answer' is missing (columns present: prompt)")
    with pytest.raises(WorkerError) as info:  # an internal error keeps its traceback and has no user message
        group.all("boom", on_rank=0)
    assert info.value.user_message is None and "ValueError: boom on rank 0" in info.value.remote_traceback


def test_a_lost_dock_unit_in_a_rank_process_counts_as_lost(group):
    with pytest.raises(WorkerError) as info:
        group.all("lose_a_unit")
    assert info.value.lost and "storage unit 0 (pid 4242) died" in info.value.brief()
    assert info.value.node_id == "node-of-the-unit"  # the unit's node reaches the driver
    with pytest.raises(WorkerError) as info:
        group.all("boom", on_rank=0)
    assert not info.value.lost


def test_rank_exit_during_a_collective_raises_promptly():
    g = WorkerGroup(Echo, ResourcePool("die", devices=2), name="dying", distributed=True)
    try:
        fut = g.all_async("exit_or_reduce", dying_rank=1, code=7)
        with pytest.raises(WorkerError) as info:
            fut.result(timeout=60)  # rank 0 is stuck in all_reduce; the driver must not wait for it
        assert (info.value.rank, info.value.method) == (1, "exit_or_reduce")
        assert "exited with code 7" in str(info.value)
        with pytest.raises(RuntimeError, match="broken"):
            g.all("echo", 1)
    finally:
        g.shutdown()
    assert g.pids() == []


def test_killed_rank_raises_worker_error():
    g = WorkerGroup(Echo, ResourcePool("kill", devices=2), name="victim", distributed=False,
                    backend=ClusterConfig(error_grace_s=0.5))
    try:
        os.kill(g.pids()[0], signal.SIGKILL)
        g._ranks.procs[0].join(timeout=10)  # make sure it is gone before calling
        with pytest.raises(WorkerError, match="SIGKILL") as info:
            g.one_async("echo", 1, rank=0).result(timeout=30)
        assert info.value.rank == 0
    finally:
        g.shutdown()


def test_failing_rank_construction_raises_worker_error():
    pool = ResourcePool("badinit", devices=2)
    with pytest.raises(WorkerError, match="init failed on rank") as info:
        WorkerGroup(Echo, pool, name="bad", init_kwargs={"fail_init": True}, distributed=False)
    assert info.value.method == "__init__"
    assert pool.groups == ()


def test_a_one_rank_group_can_get_its_own_process():
    g = WorkerGroup(Echo, ResourcePool("solo", devices=1), name="solo", backend=ClusterConfig(in_process=False))
    try:
        assert g.pids() != [os.getpid()] and len(g.pids()) == 1 and not g.in_driver
        assert g.one("echo", 3) == (0, 3)
    finally:
        g.shutdown()


def test_rank_processes_leave_no_semaphore_behind(tmp_path):
    """Rank processes exit with os._exit; a progress bar's multiprocessing lock would then be reported by the
    driver's resource tracker as a leaked semaphore at exit."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "bars.py"
    script.write_text(
        "from cluster_workers import Bars\n"
        "from relayrl.cluster import ResourcePool, WorkerGroup\n"
        "if __name__ == '__main__':\n"
        "    g = WorkerGroup(Bars, ResourcePool('bars', devices=2), 'bars')\n"
        "    assert g.all('ping') == [0, 1]\n"
        "    g.shutdown()\n")
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "leaked semaphore" not in r.stderr
