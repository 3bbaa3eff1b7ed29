"""The dock's service API (``relayrl dock``) with producers and consumers in other processes, killed midway."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from serve_proc import ROOT

HERE = Path(__file__).resolve().parent


def test_row_codec_round_trip_and_refusals():
    from relayrl.dock.rowcodec import RowCodecError, decode_rows, encode_rows

    cols = {"ids": [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.long), torch.tensor([4])],
            "reward": [1.0, 0.0, -1.0], "hidden": [torch.ones(2, 3), torch.zeros(1, 3), torch.ones(4, 3)]}
    got, meta = decode_rows(encode_rows(cols, {"partition": "p"}))
    assert meta == {"partition": "p"}
    for name, rows in cols.items():
        assert [torch.as_tensor(r).tolist() for r in rows] == [r.tolist() for r in got[name]]
    with pytest.raises(RowCodecError):
        decode_rows(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    with pytest.raises(RowCodecError, match="rows"):
        encode_rows({"a": [1.0], "b": [1.0, 2.0]})


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"})


def _wait_for(path: Path, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited ({proc.returncode}) before it got there")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: nothing within {timeout} s")
        time.sleep(0.05)


@pytest.mark.multiproc
def test_killed_producer_and_consumer_lose_and_duplicate_nothing(tmp_path):
    from relayrl.dock.client import DockClient, DockServiceError

    procs: list[subprocess.Popen] = []
    try:
        log = tmp_path / "dock.log"
        svc = _start(["-m", "relayrl.cli.main", "dock", "--port", "0", "--lease-s", "2"], log)
        procs.append(svc)
        _wait_for(log, svc, "relayrl dock")
        while "http://" not in log.read_text():
            time.sleep(0.05)
        url = "http://" + log.read_text().split("http://", 1)[1].split()[0]
        dock = DockClient(url)
        batches, per = 6, 4
        dock.open_partition("p", rows=2 * batches * per, group_size=per)

        # producer 1 is killed while its 4th put's body is on the wire; producer 2 runs through
        a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
        a = _start([str(HERE / "dock_actors.py"), "produce", url, "1", str(batches), "3", str(a_out)], tmp_path / "a.log")
        b = _start([str(HERE / "dock_actors.py"), "produce", url, "2", str(batches), "-1", str(b_out)], tmp_path / "b.log")
        procs += [a, b]
        _wait_for(a_out.with_suffix(".midput"), a, "producer 1")
        time.sleep(0.3)  # part of the body has gone out
        a.send_signal(signal.SIGKILL)
        a.wait(30)
        assert b.wait(120) == 0, (tmp_path / "b.log").read_text()

        # a consumer leases a batch and is killed before acknowledging it
        c1_out = tmp_path / "c1.json"
        c1 = _start([str(HERE / "dock_actors.py"), "consume", url, "c1", "die", str(c1_out)], tmp_path / "c1.log")
        procs.append(c1)
        _wait_for(c1_out, c1, "consumer 1")
        c1.send_signal(signal.SIGKILL)
        c1.wait(30)
        lost_lease = json.loads(c1_out.read_text())
        assert lost_lease

        # producer 1 restarts and re-sends every put with the same ids: the first three are repeats
        a2 = _start([str(HERE / "dock_actors.py"), "produce", url, "1", str(batches), "-1", str(a_out)], tmp_path / "a2.log")
        procs.append(a2)
        assert a2.wait(120) == 0, (tmp_path / "a2.log").read_text()
        puts = [json.loads(line) for line in a_out.read_text().splitlines()]
        first, again = puts[:3], puts[3:]
        assert [p["indexes"] for p in again[:3]] == [p["indexes"] for p in first]  # the same rows, not new ones

        # a second consumer drains the partition; consumer 1's rows come back when its lease expires (2 s)
        c2_out = tmp_path / "c2.jsonl"
        c2 = _start([str(HERE / "dock_actors.py"), "consume", url, "c2", "all", str(c2_out)], tmp_path / "c2.log")
        procs.append(c2)
        assert c2.wait(180) == 0, (tmp_path / "c2.log").read_text()
        rows = [json.loads(line) for line in c2_out.read_text().splitlines()]
        acked = [r["index"] for r in rows if r["acked"]]
        assert sorted(acked) == list(range(2 * batches * per))  # every row acknowledged exactly once
        assert set(lost_lease) <= set(acked)  # including the dead consumer's
        contents = sorted(tuple(r["ids"]) for r in rows if r["acked"])
        want = sorted((pid, bb, r) for pid in (1, 2) for bb in range(batches) for r in range(per))
        assert contents == want  # no producer row lost, none twice
        assert all(r["reward"] == r["ids"][0] * 100 + r["ids"][1] * 10 + r["ids"][2] for r in rows)
        prog = dock.progress("p", "train")
        assert prog["acked"] == prog["rows"] == 2 * batches * per
        assert dock.get_experience_data("p", "train", ["prompt_ids", "reward"], 8, consumer_id="late") is None

        # a late ack of a batch already acknowledged retires nothing
        assert DockClient(url)._call("POST", "/v1/dock/ack", retry=False, json={
            "partition": "p", "gen": 1, "stage": "train", "lease_id": 1, "indexes": lost_lease}).json()["acked"] == []

        # weight-sync notices: a waiter wakes on the new version
        seen = []
        waiter = threading.Thread(target=lambda: seen.append(dock.wait_weights(after=0, timeout_s=30)))
        waiter.start()
        time.sleep(0.2)
        dock.weight_sync_notify(1, path="/ckpt/v1")
        waiter.join(30)
        assert seen and seen[0].version == 1 and seen[0].path == "/ckpt/v1"
        with pytest.raises(DockServiceError) as e:
            dock.weight_sync_notify(0)
        assert e.value.status == 409

        # bad input: a 4xx with a message, and the service goes on
        with pytest.raises(DockServiceError) as e:
            dock._call("POST", "/v1/dock/put", retry=False, data=b"garbage")
        assert e.value.status == 400
        with pytest.raises(DockServiceError) as e:
            dock.put_experience_data("nope", {"x": [1.0]})
        assert e.value.status == 404
        with pytest.raises(DockServiceError) as e:
            dock.put_experience_data("p", {"x": [1.0] * per})  # the partition is full
        assert e.value.status == 400 and "exceed" in str(e.value)
        dock.close_partition("p")
        assert dock.partitions() == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_a_refused_call_leaves_the_keep_alive_connection_usable(caplog):
    """(The dock's ValueError refusals went through a handler for the base Exception: Starlette answered 400
    from its ServerErrorMiddleware and re-raised, uvicorn logged "Exception in ASGI application" and dropped
    the connection, so the next call on the same keep-alive connection failed with ConnectionResetError.)"""
    import logging

    import requests
    import uvicorn

    from relayrl.dock import Dock
    from relayrl.serving.dockapi import build_dock_app
    from relayrl.serving.server import listening_socket

    dock = Dock(units=1, backend="local", lease_s=30.0)
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_dock_app(dock), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while not server.started:
            time.sleep(0.02)
        with caplog.at_level(logging.ERROR), requests.Session() as s:
            body = {"name": "p", "rows": 8, "group_size": 4}
            assert s.post(f"{url}/v1/dock/partitions", json=body, timeout=30).status_code == 200
            again = s.post(f"{url}/v1/dock/partitions", json=body, timeout=30)  # a ValueError in the dock
            assert again.status_code == 400 and "already open" in again.json()["error"]["message"]
            assert again.headers.get("connection") != "close"
            bad = s.post(f"{url}/v1/dock/ack", json={"partition": "nope", "gen": 1, "stage": "s", "lease_id": 1,
                                                      "indexes": [0]}, timeout=30)  # a KeyError-like refusal
            assert 400 <= bad.status_code < 500, bad.text
            ok = s.post(f"{url}/v1/dock/partitions", json={"name": "q", "rows": 4}, timeout=30)
            assert ok.status_code == 200, ok.text
        assert "Exception in ASGI application" not in caplog.text
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        dock.shutdown()
