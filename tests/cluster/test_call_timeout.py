"""``cluster.call_timeout_s``: a rank that hangs outside a collective (an event nobody sets) ends the call with a
``CallTimeout`` naming the group, the method, the ranks that had not answered (not those that had), the
seconds waited and the key, and the group's rank processes (Ray: actors) are stopped; a call under the limit
runs as before. Without the limit the driver waited forever: each test that calls a hung rank waits for the
call's future with a deadline of its own and then kills the ranks itself, so the old code fails instead of
hanging the suite."""
from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pickle
import signal
import subprocess
import threading
import time

import pytest
from pydantic import ValidationError

from cluster_workers import Echo, StuckStart
from relayrl.cluster import CallTimeout, ClusterConfig, ResourcePool, WorkerError, WorkerGroup
from relayrl.cluster.rank import Replies, Reply
from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config

WAIT_S = 30.0  # the test's own deadline for a call the limit should have ended within a few seconds


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that ``ps`` lists as running (a zombie has ended)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-p", ",".join(map(str, pids))], capture_output=True,
                         text=True).stdout
    return [int(pid) for pid, stat in (line.split() for line in out.splitlines()) if not stat.startswith("Z")]


def _wait_gone(pids: list[int], within_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(pids)


def _finish(fut: concurrent.futures.Future, pids: list[int]) -> float:
    """Seconds until ``fut`` is done; if it is not within ``WAIT_S``, kill ``pids`` (so the hung call ends and
    the group can shut down) and fail."""
    t0 = time.monotonic()
    done, _ = concurrent.futures.wait([fut], timeout=WAIT_S)
    if not done:
        for pid in _running(pids):
            os.kill(pid, signal.SIGKILL)
        concurrent.futures.wait([fut], timeout=WAIT_S)
        pytest.fail(f"the call on a hung rank still waited after {WAIT_S:g} s: no call timeout")
    return time.monotonic() - t0


# -- the shared bookkeeping (both backends) ---------------------------------------------------------------------
def test_replies_name_the_ranks_that_did_not_answer_and_not_those_that_did():
    replies = Replies("actor", "update", [0, 1, 2, 3], 0.2, "cluster.call_timeout_s", grace_s=3.0)
    replies.add(0, Reply(7, True, "a"))
    replies.add(2, Reply(7, True, "c"))
    while replies.timeout():
        time.sleep(0.02)
    with pytest.raises(CallTimeout) as e:
        replies.outcome()
    err = e.value
    assert (err.group, err.method, err.ranks, err.answered) == ("actor", "update", [1, 3], [0, 2])
    assert (err.rank, err.other_ranks, err.key, err.limit_s, err.lost) == (1, [3], "cluster.call_timeout_s", 0.2, False)
    assert 0.2 <= err.elapsed_s < 5.0
    assert replies.timed_out and "ranks [1, 3] did not answer 'update'" in replies.broken
    msg = str(err)
    assert msg.startswith("worker group 'actor' ranks 1, 3 did not answer 'update' within cluster.call_timeout_s=0.2 "
                          "s (waited "), msg
    assert "ranks 0, 2 answered; the group's rank processes were stopped" in msg
    assert "raise cluster.call_timeout_s (null: no limit)" in msg and err.brief() == msg
    again = pickle.loads(pickle.dumps(err))  # (errors cross Ray pickled)
    assert isinstance(again, CallTimeout) and str(again) == msg and again.answered == [0, 2]


def test_replies_in_time_and_a_rank_error_are_as_before():
    ok = Replies("g", "m", [0, 1], 5.0, "cluster.call_timeout_s", grace_s=3.0)
    ok.add(1, Reply(0, True, "b"))
    ok.add(0, Reply(0, True, "a"))
    assert ok.outcome() == ["a", "b"] and not ok.timed_out
    bad = Replies("g", "m", [0, 1], None, "cluster.call_timeout_s", grace_s=0.0)
    assert bad.timeout() is None
    bad.add(0, Reply(0, False, traceback="ValueError: no"))
    with pytest.raises(Exception) as e:
        bad.outcome()
    assert type(e.value) is not CallTimeout and "rank 0 failed in 'm'" in str(e.value) and not bad.timed_out


def test_the_cli_prints_one_line_and_a_restart_is_not_tried(tmp_path, capsys):
    """A hang is not a lost worker: ``run.max_restarts`` does not start the run again (it would hang again);
    the CLI prints the error's one line (no remote traceback: there is none) and exits 1."""
    import argparse

    from relayrl.cli.boundary import EXIT_USER, run_guarded
    from relayrl.workflows.restart import run_with_restarts

    err = CallTimeout("rollout", [0], "generate_rows", 3600.4, "cluster.call_timeout_s", 3600.0)
    calls = []

    def run(cfg):
        calls.append(cfg)
        raise err

    cfg = load_config(Config, None, ["run.max_restarts=2", f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(CallTimeout):
        run_with_restarts(cfg, run, log=lambda _: None)
    assert len(calls) == 1
    assert run_guarded(lambda a: run(cfg), argparse.Namespace(), debug=False) == EXIT_USER
    out = capsys.readouterr().err
    assert out.startswith("relayrl: error: worker group 'rollout' rank 0 did not answer 'generate_rows' within "
                          "cluster.call_timeout_s=3600 s (waited 3600.4 s); the group's rank processes were "
                          "stopped."), out
    assert "Traceback" not in out


def test_an_in_driver_rank_past_the_limit_is_reported_not_stopped(capfd):
    """A one-rank group in the driver (``cluster.in_process``) cannot be stopped from outside: past the limit
    the driver says so on stderr, naming the group, the method and the key that would stop it; the call
    still returns."""
    g = WorkerGroup(Echo, ResourcePool("inside", devices=1), name="inside", distributed=False,
                    backend=ClusterConfig(call_timeout_s=0.2))
    try:
        assert g.in_driver
        assert g.one(Echo.hold, _set_after(1.0)) == "held"
        err = capfd.readouterr().err
        assert "relayrl: warning: worker group 'inside' (its one rank runs in the driver) has not answered 'hold' " \
               "within cluster.call_timeout_s=0.2 s" in err and "cluster.in_process=false" in err, err
        assert g.one(Echo.echo, 1) == (0, 1)  # a quick call: no warning
        assert "warning" not in capfd.readouterr().err
    finally:
        g.shutdown()


def _set_after(seconds: float) -> threading.Event:
    ev = threading.Event()
    threading.Timer(seconds, ev.set).start()
    return ev


# -- the config key ---------------------------------------------------------------------------------------------
def test_call_timeout_key_default_null_and_positive_only():
    assert ClusterConfig().call_timeout_s == 3600.0 > ClusterConfig().collective_timeout_s
    assert ClusterConfig(call_timeout_s=None).call_timeout_s is None
    for bad in (0, -1.0):
        with pytest.raises(ValidationError, match="call_timeout_s"):
            ClusterConfig(call_timeout_s=bad)
    assert load_config(Config, None, ["cluster.call_timeout_s=null"]).cluster.call_timeout_s is None
    assert load_config(Config, None, ["cluster.call_timeout_s=90"]).cluster.call_timeout_s == 90.0
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, ["cluster.call_timeout_s=0"])
    assert "cluster.call_timeout_s" in str(e.value) and "greater than 0" in str(e.value), str(e.value)


# -- local backend: rank processes ------------------------------------------------------------------------------
def _check_timeout(g: WorkerGroup, fut: concurrent.futures.Future, pids: list[int], limit_s: float) -> CallTimeout:
    elapsed = _finish(fut, pids)
    with pytest.raises(CallTimeout) as e:
        fut.result()
    err = e.value
    assert limit_s <= elapsed < limit_s + 8.0, elapsed  # (the limit, then the ranks' stop)
    assert (err.group, err.method, err.ranks, err.answered, err.key) == ("hangs", "block", [1], [0],
                                                                         "cluster.call_timeout_s")
    assert f"worker group 'hangs' rank 1 did not answer 'block' within cluster.call_timeout_s={limit_s:g} s" \
           in str(err) and "rank 0 answered" in str(err)
    assert not _wait_gone(pids), "rank processes still running after the call timed out"
    with pytest.raises(RuntimeError, match="is broken .*did not answer 'block'"):
        g.all(Echo.whoami)
    t0 = time.monotonic()
    g.shutdown()  # (the run's shutdown path: nothing left to wait for)
    assert time.monotonic() - t0 < 5.0
    return err


@pytest.mark.multiproc
def test_local_rank_hung_outside_a_collective_times_out_and_its_processes_are_stopped():
    g = WorkerGroup(Echo, ResourcePool("hangs", devices=2), name="hangs", distributed=False,
                    backend=ClusterConfig(call_timeout_s=2.0))
    try:
        pids = g.pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids
        _check_timeout(g, g.all_async(Echo.block, on_ranks=(1,)), pids, 2.0)
    finally:
        g.shutdown()


@pytest.mark.multiproc
def test_local_call_under_the_limit_passes():
    g = WorkerGroup(Echo, ResourcePool("slowok", devices=2), name="slowok", distributed=False,
                    backend=ClusterConfig(call_timeout_s=5.0))
    try:
        t0 = time.monotonic()
        assert g.all(Echo.block, hold_s=1.0) == [0, 1]
        assert time.monotonic() - t0 >= 1.0
        assert g.one(Echo.echo, 3, rank=1) == (1, 3)  # the group is still whole
    finally:
        g.shutdown()


@pytest.mark.multiproc
def test_local_start_up_that_hangs_names_the_rank_and_the_start_key(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(CallTimeout) as e:
        WorkerGroup(StuckStart, ResourcePool("stuck", devices=2), name="stuck", distributed=False,
                    init_kwargs={"pid_dir": str(tmp_path), "hang_rank": 1}, backend=ClusterConfig(start_timeout_s=2.0))
    assert time.monotonic() - t0 < 20.0
    err = e.value
    assert (err.method, err.ranks, err.answered, err.key) == ("__init__", [1], [0], "cluster.start_timeout_s")
    assert "rank 1 did not start within cluster.start_timeout_s=2 s" in str(err)
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert not _wait_gone(pids)


# -- Ray backend: actors ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    from ray_local import local_ray

    yield from local_ray(2)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
def test_ray_rank_hung_outside_a_collective_times_out_and_its_actors_are_killed(ray_cluster):
    cfg = ray_cluster.model_copy(update={"call_timeout_s": 2.0})
    g = WorkerGroup(Echo, ResourcePool("hangs", devices=2), name="hangs", distributed=False, backend=cfg)
    try:
        pids = g.pids()
        assert g.all(Echo.block, hold_s=0.5) == [0, 1]  # under the limit: as before
        _check_timeout(g, g.all_async(Echo.block, on_ranks=(1,)), pids, 2.0)
    finally:
        g.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
def test_ray_ctrl_c_kills_the_actors_of_a_call_in_the_background_without_waiting(ray_cluster):
    """`relayrl.cluster.interrupt` on Ray: the call in flight fails at once as a lost worker, its actors gone
    (the local backend's processes: tests/cluster/test_ctrl_c_background_call.py)."""
    from relayrl.cluster.interrupt import stop_calls_in_flight

    g = WorkerGroup(Echo, ResourcePool("rctrlc", devices=2), name="rctrlc", distributed=False, backend=ray_cluster)
    try:
        pids = g.pids()
        fut = g.all_async(Echo.block, on_ranks=(0, 1))
        time.sleep(1.0)  # (the call reaches the actors)
        assert not fut.done()
        t0 = time.monotonic()
        assert stop_calls_in_flight() == ("interrupted: stopped the ranks of worker group 'rctrlc' in 'block' "
                                          "without waiting for the call")
        with pytest.raises(WorkerError) as e:
            fut.result(timeout=WAIT_S)
        assert e.value.lost and time.monotonic() - t0 < 10
        assert not _wait_gone(pids), "the actors of the stopped call are gone"
    finally:
        g.shutdown()
