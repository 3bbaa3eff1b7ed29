"""``relayrl serve`` when something fails inside its generation loop (an engine error in prefill or decode, a
reset that fails, a weight load whose copies fail): the failed batch's requests get a 500 naming the cause and
the loop goes on; a loop that cannot go on answers 503 with the cause (``/health`` too), never a hang. A weight
load is checked whole before any tensor is written."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.serving.batcher import Batcher, Request, Unhealthy
from relayrl.serving.protocol import ServeLimits
from test_batcher import PROMPTS, Sink, held

DEADLINE_S = 30  # (a request the loop dropped would wait forever: every wait here has a deadline)


def _raising(real, times: int | None, what: str = "CUDA out of memory. Tried to allocate 2.00 GiB"):
    """``real`` that raises on its first ``times`` calls (None: always); ``.calls`` counts the raises."""

    def wrapped(*a, **kw):
        if times is None or wrapped.calls < times:
            wrapped.calls += 1
            raise RuntimeError(what)
        return real(*a, **kw)

    wrapped.calls = 0
    return wrapped


def _request(tok, prompt: str, sink: Sink, n: int = 1, max_new: int = 6) -> Request:
    return Request(tok(prompt)["input_ids"], SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new,
                                                            ignore_eos=True), emit=sink)


def _served(batcher: Batcher, tok) -> None:
    """A later request is served whole, within the deadline."""
    later = Sink(1)
    batcher.submit(_request(tok, PROMPTS[0], later, max_new=3))
    assert later.done.wait(DEADLINE_S), "a request after the failure was never answered (the loop died?)"
    (done,) = later.finished()
    assert done.finish_reason == "length" and len(done.token_ids) == 3, done


@pytest.fixture()
def batcher(tiny_model, tiny_tokenizer):
    b = Batcher(NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=4, decode="dynamic"))
    yield b
    b.close()


@pytest.mark.parametrize("where", ["advance", "admit"])
def test_a_step_that_raises_fails_its_batch_and_the_loop_serves_on(batcher, tiny_tokenizer, monkeypatch, where):
    """An engine error in a decode step (or in the prefill of new rows) stopped the batcher thread: every later
    request was refused until a restart. Now the requests in the failed batch fail, naming the cause, none is
    retried, and the loop goes on."""
    broken = _raising(getattr(batcher.engine, where), 1)
    monkeypatch.setattr(batcher.engine, where, broken)
    a, b = Sink(1), Sink(1)  # (a failed request gets one DoneEvent, whatever its n)
    with held(batcher):  # (both admitted in the step that fails)
        batcher.submit(_request(tiny_tokenizer, PROMPTS[1], a))
        batcher.submit(_request(tiny_tokenizer, PROMPTS[2], b, n=2))
    assert a.done.wait(DEADLINE_S) and b.done.wait(DEADLINE_S)
    for sink in (a, b):
        (ev,) = sink.finished()
        assert ev.finish_reason == "error" and not ev.unavailable
        assert "CUDA out of memory" in ev.error and "generation failed" in ev.error, ev.error
    assert broken.calls == 1  # (nothing retried them)
    assert batcher.error is None and batcher.problem() is None
    _served(batcher, tiny_tokenizer)
    deadline = time.monotonic() + DEADLINE_S
    while batcher.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.stats()["running"] == 0 and not batcher._reqs and batcher.stats()["recovered_failures"] == 1


def test_requests_waiting_behind_a_failed_batch_are_served(batcher, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(batcher.engine, "advance", _raising(batcher.engine.advance, 1))
    first = [Sink(1) for _ in range(4)]
    behind = Sink(1)
    with held(batcher):  # (four rows fill the batch; the fifth waits)
        for s in first:
            batcher.submit(_request(tiny_tokenizer, PROMPTS[3], s))
        batcher.submit(_request(tiny_tokenizer, PROMPTS[4], behind))
    assert all(s.done.wait(DEADLINE_S) for s in first) and behind.done.wait(DEADLINE_S)
    assert all(s.finished()[0].finish_reason == "error" for s in first)
    (ev,) = behind.finished()
    assert ev.finish_reason == "length" and len(ev.token_ids) == 6


def test_a_step_that_always_raises_stops_the_loop_and_refuses_every_request(batcher, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(batcher.engine, "admit", _raising(batcher.engine.admit, None))
    for k in range(batcher.max_failures):
        s = Sink(1)
        batcher.submit(_request(tiny_tokenizer, PROMPTS[k], s))
        assert s.done.wait(DEADLINE_S)
        assert s.finished()[0].finish_reason == "error" and not s.finished()[0].unavailable
    deadline = time.monotonic() + DEADLINE_S
    while batcher.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f"{batcher.max_failures} generation steps failed in a row" in batcher.problem()
    assert "CUDA out of memory" in batcher.problem()
    with pytest.raises(Unhealthy, match="CUDA out of memory"):
        batcher.submit(_request(tiny_tokenizer, PROMPTS[0], Sink(1)))
    with pytest.raises(Unhealthy, match="restart relayrl serve"):
        batcher.load_weights(lambda: 1, timeout_s=DEADLINE_S)


def test_a_reset_that_fails_stops_the_loop(batcher, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(batcher.engine, "advance", _raising(batcher.engine.advance, 1))
    monkeypatch.setattr(batcher.engine, "release", _raising(batcher.engine.release, None, "cudaErrorIllegalAddress"))
    s, waiting = Sink(1), Sink(1)
    with held(batcher):
        batcher.submit(_request(tiny_tokenizer, PROMPTS[1], s, n=4))
        batcher.submit(_request(tiny_tokenizer, PROMPTS[2], waiting))  # (no free row: it waits)
    assert s.done.wait(DEADLINE_S) and waiting.done.wait(DEADLINE_S)
    assert "CUDA out of memory" in s.finished()[0].error
    (ev,) = waiting.finished()  # never decoded: refused (503), not failed
    assert ev.finish_reason == "error" and ev.unavailable and "cudaErrorIllegalAddress" in ev.error
    assert "resetting the generation loop" in batcher.problem()
    with pytest.raises(Unhealthy, match="cudaErrorIllegalAddress"):
        batcher.submit(_request(tiny_tokenizer, PROMPTS[0], Sink(1)))


# ------------------------------------------------------------------ over HTTP
@pytest.fixture()
def served(tiny_dir):
    from fastapi.testclient import TestClient

    from relayrl.serving.app import build_app
    from relayrl.serving.server import build_state

    state = build_state(str(tiny_dir), limits=ServeLimits(), api_key=None, max_batch=4, name="tiny")
    with TestClient(build_app(state), raise_server_exceptions=False) as c:
        yield c, state
    state.batcher.close()


def _call(fn, *a, **kw):
    """``fn(*a, **kw)`` within the deadline (a hang fails the test instead of stopping the suite)."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn(*a, **kw)), daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert "r" in box, f"no answer within {DEADLINE_S} s"
    return box["r"]


BODY = {"model": "tiny", "prompt": "1+1=", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _events(r) -> list:
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def test_over_http_a_failed_step_is_a_500_naming_the_cause_and_the_next_request_is_served(served, monkeypatch):
    c, state = served
    eng = state.batcher.engine
    monkeypatch.setattr(eng, "advance", _raising(eng.advance, 1))
    r = _call(c.post, "/v1/completions", json=BODY)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "CUDA out of memory" in err["message"], err
    r = _call(c.post, "/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert _call(c.get, "/health").json()["status"] == "ok"
    # a stream: an error event, then the end of the stream; then the server serves on
    monkeypatch.setattr(eng, "advance", _raising(eng.advance, 1, "CUBLAS_STATUS_EXECUTION_FAILED"))
    r = _call(c.post, "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4, "stream": True})
    assert r.status_code == 200
    events = _events(r)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "CUBLAS_STATUS_EXECUTION_FAILED" in err["message"], events
    r = _call(c.post, "/v1/completions", json={**BODY, "stream": True})
    assert _events(r)[-1] == "[DONE]" and all("error" not in json.loads(e) for e in _events(r)[:-1]), r.text


def test_over_http_a_loop_that_cannot_recover_answers_503_with_the_cause(served, monkeypatch):
    c, state = served
    eng = state.batcher.engine
    monkeypatch.setattr(eng, "advance", _raising(eng.advance, None))
    for _ in range(state.batcher.max_failures):
        r = _call(c.post, "/v1/completions", json=BODY)
        assert r.status_code == 500 and "CUDA out of memory" in r.json()["error"]["message"], r.text
    deadline = time.monotonic() + DEADLINE_S
    while state.batcher.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    h = _call(c.get, "/health")
    assert h.status_code == 503 and "CUDA out of memory" in h.json()["error"], h.text
    for path, body in [("/v1/completions", BODY), ("/v1/completions", {**BODY, "stream": True}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})]:
        r = _call(c.post, path, json=body)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "CUDA out of memory" in err["message"], err
    from safetensors.torch import save

    w = eng.model.get_input_embeddings().weight.detach().clone()
    r = _call(c.post, "/v1/relayrl/weights", params={"version": 1}, content=save({"model.embed_tokens.weight": w}),
              headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 503 and "CUDA out of memory" in r.json()["error"]["message"], r.text


class _FailingCopy:
    """Stands in the engine's parameter index for one tensor: its copy fails (as a device copy that runs out
    of memory)."""

    def __init__(self, p: torch.Tensor) -> None:
        self.shape = p.shape

    def copy_(self, *_, **__):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (copying the weight)")


class _CountedCopy:
    """Stands in the engine's parameter index for one tensor and counts the copies into it (``writes``)."""

    def __init__(self, p: torch.Tensor, writes: list[str], name: str) -> None:
        self.p, self.shape, self.writes, self.name = p, p.shape, writes, name

    def copy_(self, src, **kw):
        self.writes.append(self.name)
        return self.p.copy_(src, **kw)


def _post_weights(c, tensors: dict, version: int = 1):
    from safetensors.torch import save

    return _call(c.post, "/v1/relayrl/weights", params={"version": version}, content=save(tensors),
                 headers={"Content-Type": "application/octet-stream"})


def _spoiled(w: torch.Tensor, how: str) -> torch.Tensor:
    if how == "shape":
        return w[:-1].contiguous()
    if how == "integer":  # (int weights into a float parameter: copied, truncated, and served)
        return w.to(torch.int64)
    if how == "complex":  # (copied with its imaginary part dropped, and served)
        return torch.complex(w, w)
    if how == "nan":
        return w.clone().index_fill_(0, torch.tensor([0]), float("nan"))
    assert how == "overflow"  # (finite in float64, infinite once cast to the served float32)
    return w.to(torch.float64).index_fill_(0, torch.tensor([0]), 1e300)


def _bad_last(new: dict[str, torch.Tensor], how: str) -> tuple[dict[str, torch.Tensor], str]:
    """``new`` with its last tensor (by name) bad in the way ``how`` says, and that tensor's name."""
    bad = dict(new)
    name = sorted(new)[-1]
    if how == "unknown_name":
        name = "zz.not_a_parameter"
        bad[name] = new["model.norm.weight"].clone()
    else:
        bad[name] = _spoiled(new[name], how)
    return bad, name


def _read_last(monkeypatch, name: str) -> None:
    """The server reads tensor ``name`` of a payload last (safetensors hands them over in no fixed order)."""
    from relayrl.serving import app

    real = app._load_payload

    def ordered(payload: bytes) -> dict:
        got = real(payload)
        return {**{k: v for k, v in got.items() if k != name}, name: got[name]}

    monkeypatch.setattr(app, "_load_payload", ordered)


@pytest.mark.parametrize("how", ["unknown_name", "shape", "integer", "complex", "nan", "overflow"])
def test_a_bad_tensor_last_in_the_payload_leaves_the_old_weights_serving_with_no_tensor_written(served, monkeypatch,
                                                                                                 how):
    """Every tensor is checked before any is written, so a load whose last tensor is bad writes nothing (counted
    at the engine's copies). An integer or complex tensor was copied (cast) into a float parameter, and a float64
    value past float32's range became inf in the served weights, all answered 200."""
    c, state = served
    eng = state.batcher.engine
    before = _call(c.post, "/v1/completions", json={**BODY, "max_tokens": 8}).json()["choices"][0]["text"]
    old = {k: v.detach().clone() for k, v in eng.model.state_dict().items() if k in eng._params}
    new = {k: v * 1.5 for k, v in old.items()}
    writes: list[str] = []
    for name, p in list(eng._params.items()):
        monkeypatch.setitem(eng._params, name, _CountedCopy(p, writes, name))
    payload, bad = _bad_last(new, how)
    _read_last(monkeypatch, bad)
    r = _post_weights(c, payload)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert repr(bad) in msg and "nothing was loaded" in msg, msg
    assert writes == []
    for k, v in old.items():
        torch.testing.assert_close(eng.model.get_parameter(k) if k in dict(eng.model.named_parameters())
                                   else eng.model.get_buffer(k), v, rtol=0, atol=0, msg=f"{k} changed")
    assert _call(c.get, "/v1/relayrl/weights").json() == {"version": 0}
    assert _call(c.post, "/v1/completions", json={**BODY, "max_tokens": 8}).json()["choices"][0]["text"] == before
    monkeypatch.undo()  # (the copies are counted again below)
    for name, p in list(eng._params.items()):
        monkeypatch.setitem(eng._params, name, _CountedCopy(p, writes, name))
    r = _post_weights(c, new)  # the same load, all good
    assert r.status_code == 200 and r.json()["version"] == 1, r.text
    assert sorted(writes) == sorted(new)  # (one write per tensor)
    torch.testing.assert_close(eng.model.get_input_embeddings().weight, new["model.embed_tokens.weight"])


def test_a_write_that_fails_after_every_check_passed_stops_the_loop(served, monkeypatch):
    """With nothing left to refuse, a failed copy is the device's (the weights before it are new, the rest old):
    the loop stops rather than serve that mix, and every request, the load too, is a 503 naming the cause, coded
    ``generation_stopped`` (the rollout adapter does not retry it). (Before, each tensor was copied to the host
    before it was overwritten and put back on a failure: one extra copy of the weights on every load.)"""
    c, state = served
    eng = state.batcher.engine
    old = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    new = {"model.embed_tokens.weight": old["model.embed_tokens.weight"].flip(0).contiguous(),
           "model.norm.weight": old["model.norm.weight"] * 2}
    monkeypatch.setitem(eng._params, "model.norm.weight", _FailingCopy(old["model.norm.weight"]))
    r = _post_weights(c, new)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "generation_stopped" and "illegal memory access" in err["message"], err
    assert "restart relayrl serve" in err["message"], err
    h = _call(c.get, "/health")
    assert h.status_code == 503 and "neither the old nor the new" in h.json()["error"], h.text
    for path, body in [("/v1/completions", BODY), ("/v1/completions", {**BODY, "stream": True})]:
        r = _call(c.post, path, json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "generation_stopped", r.text
        assert "illegal memory access" in r.json()["error"]["message"], r.text
    assert _post_weights(c, new, 2).json()["error"]["code"] == "generation_stopped"


def test_a_stream_whose_own_detokenizing_fails_ends_with_an_error_event(served, monkeypatch):
    """An exception in the streaming handler itself (not an ApiError) cut the stream without a word: the client
    saw a truncated response, no error and no ``[DONE]``."""
    from relayrl.serving import responses as R

    c, _ = served
    monkeypatch.setattr(R.SampleText, "push", _raising(R.SampleText.push, None, "byte 0xff is not valid UTF-8"))
    r = _call(c.post, "/v1/completions", json={**BODY, "stream": True})
    events = _events(r)
    assert events[-1] == "[DONE]", r.text
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "not valid UTF-8" in err["message"], err
    monkeypatch.undo()
    r = _call(c.post, "/v1/completions", json={**BODY, "stream": True})
    assert _events(r)[-1] == "[DONE]" and "error" not in json.loads(_events(r)[-2]), r.text


def test_a_write_that_fails_stops_the_batchers_loop(batcher, tiny_tokenizer):
    """:func:`~relayrl.serving.weights.write` turns any failure of the engine's copies into :class:`Unrecoverable`,
    which stops the generation loop it ran in: later requests are refused naming it."""
    from types import SimpleNamespace

    from relayrl.serving.batcher import Unrecoverable
    from relayrl.serving.weights import write

    class Engine(SimpleNamespace):
        def update_weights(self, named, version):
            for _name, _t in named:
                raise RuntimeError("CUDA error: out of memory")

    eng = Engine(device=torch.device("cpu"), weight_version=0)
    with pytest.raises(Unrecoverable, match="out of memory.*neither the old nor the new"):
        write(eng, {"w": torch.ones(4)}, 1)
    with pytest.raises(Unrecoverable):
        batcher.load_weights(lambda: write(eng, {"w": torch.ones(4)}, 1), timeout_s=DEADLINE_S)
    deadline = time.monotonic() + DEADLINE_S
    while batcher.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "neither the old nor the new" in batcher.problem()
    with pytest.raises(Unhealthy, match="out of memory"):
        batcher.submit(_request(tiny_tokenizer, PROMPTS[0], Sink(1)))


class _Through:
    """A ``requests.Session`` for the rollout adapter whose calls go to the app in-process; ``calls`` holds the
    status of each reply."""

    def __init__(self, client, calls: list[int]) -> None:
        self.client, self.calls, self.headers = client, calls, {}

    def request(self, method: str, url: str, timeout=None, **kw):  # (in-process: no timeout to pass on)
        r = self.client.request(method, url, **kw)
        self.calls.append(r.status_code)
        return r


def _overloaded_twice(real):
    """``Batcher.submit_all`` whose first two calls find the queue full."""
    from relayrl.serving.batcher import Overloaded

    def wrapped(*a, **kw):
        wrapped.calls += 1
        if wrapped.calls <= 2:
            raise Overloaded("1024 requests are waiting; retry later")
        return real(*a, **kw)

    wrapped.calls = 0
    return wrapped


def test_the_rollout_adapter_fails_at_once_on_a_stopped_server_and_retries_a_busy_one(served, monkeypatch,
                                                                                        tiny_tokenizer):
    """``rollout.engine=openai`` retried the 503s of a loop that had stopped for good (5 retries, 3 s of backoff
    a request) and then said to start the server; now the 503 is coded ``generation_stopped`` and the adapter
    fails at once naming the server's cause. A 503 for a full queue (``server_busy``) is still retried."""
    from types import SimpleNamespace

    import requests

    from relayrl.engines.generation.remote import RemoteGenerationEngine, RemoteSpec, ServerStopped

    c, state = served
    calls: list[int] = []
    eng = RemoteGenerationEngine(RemoteSpec(base_url="http://testserver/v1", model="tiny", weight_sync="none",
                                            retries=5, concurrency=1), tiny_tokenizer)
    eng._requests = SimpleNamespace(Session=lambda: _Through(c, calls), ConnectionError=requests.ConnectionError,
                                    Timeout=requests.Timeout)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=3)
    prompt = tiny_tokenizer("1+1=")["input_ids"]
    try:
        with monkeypatch.context() as m:
            m.setattr(state.batcher, "submit_all", _overloaded_twice(state.batcher.submit_all))
            (done,) = _call(eng.generate, [prompt], params)  # two 503s (server_busy), then served
        assert calls == [503, 503, 200] and len(done.token_ids) == 3
        monkeypatch.setattr(state.batcher.engine, "advance", _raising(state.batcher.engine.advance, None))
        for _ in range(state.batcher.max_failures):
            _call(c.post, "/v1/completions", json=BODY)
        deadline = time.monotonic() + DEADLINE_S
        while state.batcher.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        calls.clear()
        t0 = time.monotonic()
        with pytest.raises(ServerStopped) as e:
            eng.generate([prompt], params, on_error=lambda f: pytest.fail(f"handed to on_error: {f}"))
        assert calls == [503] and time.monotonic() - t0 < 2.5  # one request, no backoff (3.1 s of it before)
        msg = str(e.value)
        assert "generation loop has stopped" in msg and "CUDA out of memory" in msg and "not retried" in msg, msg
    finally:
        eng.close()


# ------------------------------------------------------------------ a weight load past its deadline
def test_a_weight_load_still_written_at_its_deadline_is_a_503_naming_it_and_the_new_weights_land(tiny_dir,
                                                                                                monkeypatch):
    """A write slower than ``--weight-load-timeout-s`` (a slow device or disk) answers a 503 in OpenAI's error
    shape naming the load, the wait, the version served and the fix; the write is not stopped halfway and its
    weights serve once it ends. (It was a 500: ``internal error: TimeoutError(...)``.)"""
    from fastapi.testclient import TestClient

    from relayrl.serving.app import build_app
    from relayrl.serving.server import build_state

    state = build_state(str(tiny_dir), limits=ServeLimits(weight_load_timeout_s=0.3), api_key=None, max_batch=4,
                        name="tiny")
    eng = state.batcher.engine
    real = eng.update_weights

    def slow(named, version):
        time.sleep(1.5)
        return real(named, version)

    monkeypatch.setattr(eng, "update_weights", slow)
    try:
        with TestClient(build_app(state), raise_server_exceptions=False) as c:
            w = eng.model.get_input_embeddings().weight.detach().clone()
            r = _post_weights(c, {"model.embed_tokens.weight": w}, version=3)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "weight_load_timeout", err
            msg = err["message"]
            for part in ["weight load of version 3", "still being written after 0.3 s", "version 0",
                         "--weight-load-timeout-s", "Sending it again queues a second write"]:
                assert part in msg, msg
            deadline = time.monotonic() + DEADLINE_S
            while _call(c.get, "/v1/relayrl/weights").json()["version"] != 3:
                assert time.monotonic() < deadline, "the slow load never landed"
                time.sleep(0.1)
            r = _call(c.post, "/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
    finally:
        state.batcher.close()


def test_a_weight_load_that_never_started_by_its_deadline_is_dropped_and_the_old_weights_serve_on(batcher,
                                                                                                tiny_tokenizer):
    """A load still queued at its deadline (the running batch did not drain) is dropped, nothing written: the
    error says so, with the version that serves on and the fix, and the load never runs later."""
    from relayrl.serving.batcher import WeightLoadTimeout

    inside, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def hold() -> int:  # (the loop is busy here: the second load waits behind it, as behind a long batch)
        inside.set()
        release.wait(DEADLINE_S)
        return batcher.engine.weight_version

    first = threading.Thread(target=batcher.load_weights, args=(hold,), daemon=True)
    first.start()
    assert inside.wait(DEADLINE_S)
    try:
        with pytest.raises(WeightLoadTimeout) as e:
            batcher.load_weights(lambda: ran.append(2) or 2, timeout_s=0.2, version=2)
    finally:
        release.set()
        first.join(DEADLINE_S)
    msg = str(e.value)
    for part in ["weight load of version 2 did not start within 0.2 s", "dropped and nothing was written",
                 "(version 0) serve on", "--weight-load-timeout-s"]:
        assert part in msg, msg
    _served(batcher, tiny_tokenizer)
    assert ran == [] and batcher.engine.weight_version == 0
