"""The app in-process (Starlette's test client, no socket): refusals that depend on the server's own settings."""

from __future__ import annotations

import time

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


def test_the_server_stops_at_an_eos_id_of_the_generation_config(tiny_model, tiny_tokenizer, eos_listed):
    """``relayrl serve`` on an instruct checkpoint whose generation_config.json lists more EOS ids than the
    tokenizer's (as vLLM's server does): a completion ends at the first of them with finish_reason ``stop``."""
    from fastapi.testclient import TestClient

    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.serving.app import build_app
    from relayrl.serving.server import build_state

    prompt = tiny_tokenizer("1+2=")["input_ids"]
    free = NativeGenerationEngine(tiny_model, tiny_tokenizer).generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=12))[0].token_ids.tolist()
    end = free[3]
    state = build_state(str(eos_listed(tiny_model, tiny_tokenizer, end)), limits=ServeLimits(), api_key=None,
                        max_batch=2, name="it")
    try:
        with TestClient(build_app(state)) as c:
            r = c.post("/v1/completions", json={"model": "it", "prompt": prompt, "temperature": 0, "max_tokens": 12,
                                                "return_token_ids": True})
    finally:
        state.batcher.close()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == free[:free.index(end) + 1]


def test_a_request_with_more_prompts_than_the_queue_is_a_400_and_a_full_queue_a_503(tiny_dir, tiny_tokenizer):
    """(Each prompt counted against --max-waiting before any was admitted: a 2-prompt request on an idle server
    with --max-waiting 1 got "503 server_busy ... retry later" every time, though retrying could never help.)"""
    from fastapi.testclient import TestClient

    from relayrl.engines.generation.base import SamplingParams
    from relayrl.serving.app import build_app
    from relayrl.serving.batcher import Request
    from relayrl.serving.server import build_state

    from test_batcher import held

    state = build_state(str(tiny_dir), limits=ServeLimits(max_waiting=1), api_key=None, max_batch=1, name="tiny")
    try:
        with TestClient(build_app(state)) as c:
            two = {"model": "tiny", "prompt": ["5", "6"], "max_tokens": 2}
            r = c.post("/v1/completions", json=two)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "prompt" and "--max-waiting" in err["message"]
            assert c.post("/v1/completions", json={**two, "prompt": "5"}).status_code == 200
            with held(state.batcher):  # the queue is full: waiting helps, so a 503
                waiting = Request(tiny_tokenizer("1+1=")["input_ids"], SamplingParams(max_new_tokens=2),
                                  emit=lambda ev: None)
                state.batcher.submit(waiting)
                r = c.post("/v1/completions", json={**two, "prompt": "5"})
                assert r.status_code == 503 and r.json()["error"]["type"] == "server_busy", r.text
                assert state.batcher.stats()["waiting"] == 1  # the refused request left nothing queued
                waiting.cancel()
    finally:
        state.batcher.close()
