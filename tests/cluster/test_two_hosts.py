"""A real two-host Ray cluster (two network namespaces on this machine, see ``two_hosts.py``): roles placed
on the intended nodes, a GRPO run whose rollout and trainer sit on different hosts, and a host lost mid-run."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from two_hosts import start_two_hosts, usable

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def hosts():
    why = usable()
    if why:
        pytest.skip(why)
    h = start_two_hosts({"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
                         "RELAYRL_CACHE": os.environ.get("RELAYRL_CACHE", str(ROOT / ".cache" / "test-models"))})
    yield h
    h.close()


def driver(hosts, code: str, *args: str):
    out = hosts.run([sys.executable, "-c", textwrap.dedent(code), *args], timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pools_pinned_to_nodes_land_there_and_an_unknown_node_is_refused(hosts):
    got = driver(hosts, """
        import json, sys
        from cluster_workers import Echo
        from relayrl.cluster import ClusterConfig, PlacementError, ResourcePool, make_group
        cfg = ClusterConfig(backend="ray", ray_address=sys.argv[1])
        a = make_group(cfg, Echo, ResourcePool("a", devices=2, node=sys.argv[2]), "on_head", init_kwargs={"tag": "a"})
        b = make_group(cfg, Echo, ResourcePool("b", devices=1, node=sys.argv[3]), "on_worker", init_kwargs={"tag": "b"})
        out = {"a": a.nodes(), "b": b.nodes(), "echo": b.all("echo", 7)}
        try:
            make_group(cfg, Echo, ResourcePool("c", node="10.99.99.99"), "nowhere")
        except PlacementError as e:
            out["refused"] = str(e)
        a.shutdown(); b.shutdown()
        print(json.dumps(out))
        """, hosts.address, hosts.head, hosts.worker)
    assert got["a"] == [hosts.head, hosts.head] and got["b"] == [hosts.worker]
    assert got["echo"] == [[0, 7]]
    assert "placement.nodes" in got["refused"] and hosts.worker in got["refused"] and hosts.head in got["refused"]


def test_ranks_of_four_devices_keep_to_one_host_each(hosts):
    """A pool of 4 devices per node on 2 nodes, packed in runs of 4 (a rollout with tensor_parallel_size=4): each
    node has 4 CPUs, so each run fills one host; a rank of 4 devices sits on one host with its run, and the
    one-device ranks colocated on the pool follow the runs. A run of 8 fits no host (8 CPUs in all) and is
    refused at once, naming the key."""
    got = driver(hosts, """
        import json, sys
        from cluster_workers import Echo
        from relayrl.cluster import ClusterConfig, PlacementError, ResourcePool, make_group
        cfg = ClusterConfig(backend="ray", ray_address=sys.argv[1])
        pool = ResourcePool("tp", devices=4, nodes=2, pack=4)
        actor = make_group(cfg, Echo, pool, "actor", distributed=False)
        # (no process group: gloo across these namespaces' hosts would need GLOO_SOCKET_IFNAME)
        rollout = make_group(cfg, Echo, pool, "rollout", devices_per_rank=4, distributed=False)
        out = {"actor": actor.nodes(), "rollout": rollout.nodes(),
               "owned": [o["devices"] for o in rollout.all(Echo.owned)],
               "local": [w["local_rank"] for w in rollout.all(Echo.whoami)]}
        rollout.shutdown(); actor.shutdown()
        try:
            make_group(cfg, Echo, ResourcePool("wide", devices=8, pack=8), "wide", devices_per_rank=8)
        except PlacementError as e:
            out["refused"] = str(e)
        print(json.dumps(out))
        """, hosts.address)
    first, second = got["rollout"]
    assert {first, second} == {hosts.head, hosts.worker}
    assert got["actor"] == [first] * 4 + [second] * 4  # device d's bundle is in run d // 4
    assert got["owned"] == [["cpu"] * 4] * 2 and got["local"] == [0, 0]
    assert "largest node has 4 CPU(s): set rollout.vllm.tensor_parallel_size <= 4" in got["refused"]


def grpo(hosts, run_dir: Path, *extra: str):
    return hosts.run([sys.executable, "-m", "relayrl.cli.main", "train", str(ROOT / "recipes" / "arith_grpo.yaml"),
                      "cluster.backend=ray", f"cluster.ray_address={hosts.address}", "placement.pools.gen=1",
                      "placement.rollout=gen", f"placement.nodes.main={hosts.head}",
                      f"placement.nodes.gen={hosts.worker}", f"run.dir={run_dir}", "run.threads=1",
                      "trainer.init_from=null", "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8",
                      "eval.every=0", "eval.size=8", "telemetry.sinks=[jsonl]", *extra], timeout=600)


def test_grpo_with_the_rollout_on_the_other_host(hosts, tmp_path):
    out = grpo(hosts, tmp_path, "trainer.mode=periodic", "trainer.steps=3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"actor on {hosts.head}" in out.stdout and f"rollout on {hosts.worker}" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "perf/step_time_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["relay/bytes"] > 0 for r in steps[1:])  # the weights crossed to the rollout's host
    assert all(r["dock/driver_bytes"] == 0 for r in steps)  # the samples went rollout host -> units -> trainer


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip() and "perf/step_time_s" in x]


def test_losing_the_rollout_host(hosts, tmp_path):
    """Without restarts the run ends with an error naming the group, rank and host, and hangs nowhere; with
    ``run.max_restarts=1`` it waits for the host to come back, resumes from the last checkpoint and finishes."""
    import subprocess
    import time

    def launch(run_dir: Path, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "relayrl.cli.main", "train", str(ROOT / "recipes" / "arith_grpo.yaml"),
               "cluster.backend=ray", f"cluster.ray_address={hosts.address}", "placement.pools.gen=1",
               "placement.rollout=gen", f"placement.nodes.main={hosts.head}", f"placement.nodes.gen={hosts.worker}",
               f"run.dir={run_dir}", "run.threads=1", "trainer.init_from=null", "data.prompts_per_step=4",
               "rollout.n=4", "rollout.max_new_tokens=8", "eval.every=0", "eval.size=8", "telemetry.sinks=[jsonl]",
               "run.save_every=1", "trainer.steps=5", "cluster.start_timeout_s=120", *extra]
        return subprocess.Popen(hosts.exec("head", cmd), env={**os.environ, **hosts.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def kill_after_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
        deadline = time.monotonic() + 300
        while max(_steps(run_dir), default=0) < step:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.5)
        hosts.kill_node("worker")

    lone = tmp_path / "no-restart"
    proc = launch(lone)
    try:
        kill_after_step(proc, lone, 2)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        hosts.start_node("worker")
        hosts.wait_nodes(2)
    assert proc.returncode not in (0, None), out[-3000:]
    # What the driver meets first names the host: the rollout's rank, or a dock storage unit Ray spread onto it.
    lost = "'rollout' rank 0" in out or "storage unit" in out
    assert lost and hosts.worker in out and "run.max_restarts" in out, out[-3000:]
    for bug in ("relayrl.cluster.errors.WorkerError", "UnitLostError"):  # no bug: one message, no traceback
        assert bug not in out, out[-3000:]

    again = tmp_path / "restart"
    proc = launch(again, "run.max_restarts=1")
    try:
        kill_after_step(proc, again, 2)
        # The host comes back at once, before Ray has noticed that the old one died (the restart must not place
        # anything on the dead node meanwhile), and the driver waits to place the rollout there.
        hosts.start_node("worker")
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "restart 1/1" in out and "restart 1/1" in (again / "restarts.log").read_text()
    assert max(_steps(again)) == 5
