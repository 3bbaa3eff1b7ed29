"""``rollout.engine=openai`` against the fake server: a 503 from a server that is busy is retried
(``rollout.retries``, with backoff); ``relayrl serve``'s 503 after its generation loop stopped for good (error code
``generation_stopped``) fails the rollout at once, naming the server's cause, whatever ``rollout.on_error`` says
(it was retried five times, three seconds of backoff per request, then reported as a server to start)."""

from __future__ import annotations

import time

import pytest
import torch

from fake_openai import FakeServer
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.remote import RemoteGenerationEngine, RemoteSpec, ServerStopped

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
PROMPTS = [[4, 5, 6], [7, 8, 9]]


def _engine(server: FakeServer, tok, retries: int = 5) -> RemoteGenerationEngine:
    return RemoteGenerationEngine(RemoteSpec(base_url=server.url, weight_sync="none", retries=retries), tok)


@pytest.mark.parametrize("on_error", [None, "drop"])
def test_a_stopped_server_fails_the_rollout_at_once_naming_its_cause(tiny_tokenizer, on_error):
    server = FakeServer(fails=lambda p: True, how="stopped")
    eng = _engine(server, tiny_tokenizer)
    dropped: list = []
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerStopped) as e:
            eng.generate(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(0),
                         on_error=dropped.append if on_error else None)
    finally:
        eng.close()
        server.stop()
    assert time.monotonic() - t0 < 2.5  # (no backoff: 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s per request before)
    msg = str(e.value)
    assert "generation loop has stopped" in msg and "illegal memory access" in msg and "not retried" in msg, msg
    assert "restart relayrl serve" in msg
    assert len(server.failed) <= len(PROMPTS)  # one request per prompt at most, none retried
    assert dropped == []  # (not one prompt's failure: no group dropped for it)


def test_a_busy_server_is_retried_until_it_answers(tiny_tokenizer):
    server = FakeServer(fails=lambda p: True, how="busy", times=2)
    eng = _engine(server, tiny_tokenizer)
    try:
        comps = eng.generate(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(0))
    finally:
        eng.close()
        server.stop()
    assert len(comps) == len(PROMPTS) * PARAMS.n
    assert sorted(map(tuple, server.failed)) == sorted(map(tuple, PROMPTS * 2))  # two 503s each, then answered


def test_a_busy_server_past_the_retries_fails_naming_the_503(tiny_tokenizer):
    server = FakeServer(fails=lambda p: True, how="busy")
    eng = _engine(server, tiny_tokenizer, retries=1)
    try:
        with pytest.raises(Exception, match="503.*the server is busy.*after 1 retries"):
            eng.generate(PROMPTS[:1], PARAMS)
    finally:
        eng.close()
        server.stop()
    assert len(server.failed) == 2
