"""The app in-process (Starlette's test client, no socket): refusals that depend on the server's own settings."""

from __future__ import annotations

import pytest

from relayrl.serving.protocol import ServeLimits


@pytest.fixture(scope="module")
def client(tiny_dir):
    from fastapi.testclient import TestClient

    from relayrl.serving.app import build_app
    from relayrl.serving.server import build_state

    state = build_state(str(tiny_dir), limits=ServeLimits(max_n=16), api_key=None, max_batch=4, name="tiny")
    with TestClient(build_app(state), raise_server_exceptions=False) as c:
        yield c, state
    state.batcher.close()


def test_n_beyond_the_batch_is_a_400_and_leaves_nothing_running(client):
    c, state = client
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": ["1+1=", "2+2="], "n": 8, "temperature": 1,
                                        "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "--max-batch" in r.json()["error"]["message"] and r.json()["error"]["param"] == "n"
    assert state.batcher.stats()["waiting"] == 0
    ok = c.post("/v1/completions", json={"model": "tiny", "prompt": "1+1=", "n": 4, "temperature": 1,
                                         "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_unknown_routes_and_methods_answer_with_openai_error_bodies(client):
    c, _ = client
    for r, status in ((c.get("/v1/nothing"), 404), (c.get("/v1/completions"), 405)):
        assert r.status_code == status
        err = r.json()["error"]
        assert err["code"] == status and err["message"] and err["type"]


def test_the_dock_api_answers_bad_queries_and_unknown_routes_with_error_objects():
    from fastapi.testclient import TestClient

    from relayrl.dock import Dock
    from relayrl.serving.dockapi import build_dock_app

    dock = Dock(units=1, backend="local", lease_s=30.0)
    try:
        with TestClient(build_dock_app(dock), raise_server_exceptions=False) as c:
            for r, status in ((c.get("/v1/dock/weights", params={"after": "abc"}), 400),
                              (c.get("/v1/dock/progress", params={"partition": "p"}), 400),
                              (c.get("/v1/dock/nothing"), 404)):
                assert r.status_code == status, r.text
                err = r.json()["error"]
                assert err["code"] == status and err["message"]
            assert "after" in c.get("/v1/dock/weights", params={"after": "abc"}).json()["error"]["message"]
    finally:
        dock.shutdown()
