"""``relayrl serve`` over real HTTP on loopback: the API, its log-probs, streaming, weights and bad input."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from e2e_cli import relayrl
from serve_proc import start_server

pytestmark = pytest.mark.slow


def post(server, path: str, body, **kw) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def assert_alive(server) -> None:
    assert requests.get(f"{server.root}/health", timeout=10).json()["status"] == "ok"
    r = post(server, "/completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_completion_token_ids_and_logprobs_match_a_full_forward(server, tiny_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    r = post(server, "/completions", {"model": "tiny", "prompt": ["12+34=", "sort 3 1 ="], "n": 2, "max_tokens": 6,
                                      "temperature": 0.7, "logprobs": 1, "return_token_ids": True, "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    model = load_model(tiny_dir)
    for c in body["choices"]:
        p, ids = c["prompt_token_ids"], c["token_ids"]
        assert p == tiny_tokenizer(["12+34=", "sort 3 1 ="][c["index"] // 2])["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([p + ids])).logits[0, len(p) - 1:-1] / 0.7
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c["logprobs"]["token_logprobs"]), ref, atol=1e-4, rtol=1e-4)
        assert len(c["logprobs"]["top_logprobs"]) == len(ids)
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


def test_a_repetition_penalty_and_min_p_reach_the_sampler(server, tiny_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    p = tiny_tokenizer("1+2=")["input_ids"]
    r = post(server, "/completions", {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0,
                                      "repetition_penalty": 1.8, "min_p": 0.2, "ignore_eos": True,
                                      "return_token_ids": True})
    assert r.status_code == 200, r.text
    ref = load_model(tiny_dir).generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                                        eos_token_id=None, pad_token_id=tiny_tokenizer.pad_token_id)[0, len(p):]
    assert r.json()["choices"][0]["token_ids"] == ref.tolist()
    plain = post(server, "/completions", {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0,
                                          "ignore_eos": True, "return_token_ids": True})
    assert plain.json()["choices"][0]["token_ids"] != ref.tolist()  # (the penalty changes this answer)


def test_official_openai_client_chat_stream_and_stop(server, tiny_tokenizer):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    msgs = [{"role": "user", "content": "2+2="}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, seed=1, logprobs=True,
                                          top_logprobs=2, extra_body={"return_token_ids": True})
    want = tiny_tokenizer(tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]
    assert full.model_extra["prompt_token_ids"] == want
    assert len(full.choices[0].logprobs.content) == len(full.choices[0].model_extra["token_ids"])
    chunks = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, seed=1, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="55+5=", max_tokens=12, seed=2, temperature=0).choices[0].text
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.completions.create(model="tiny", prompt="55+5=", max_tokens=12, seed=2, temperature=0,
                                        stop=[stop], stream=True)
        streamed = "".join(c.choices[0].text for c in cut)
        assert streamed == text[: text.find(stop)]


def test_concurrent_requests_share_decode_steps(server):
    before = requests.get(f"{server.root}/health").json()
    body = {"model": "tiny", "prompt": "7+8=", "max_tokens": 32, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda _: post(server, "/completions", body), range(16)))
    assert all(r.status_code == 200 for r in replies)
    after = requests.get(f"{server.root}/health").json()
    assert after["generated_tokens"] - before["generated_tokens"] == 16 * 32
    assert after["steps"] - before["steps"] < 16 * 32 / 2  # at least two requests per decode step on average


@pytest.mark.parametrize("case", ["malformed_json", "not_an_object", "negative_max_tokens", "absurd_max_tokens",
                                  "unknown_model", "unknown_field", "bad_token_id", "n_too_large", "empty_body"])
def test_bad_requests_get_4xx_and_the_server_goes_on(server, case):
    url = f"{server.url}/completions"
    ok = {"model": "tiny", "prompt": "1+1=", "max_tokens": 4}
    raw = {"malformed_json": b'{"model": "tiny", "prompt": ', "not_an_object": b"[1, 2]", "empty_body": b""}
    bodies = {"negative_max_tokens": {**ok, "max_tokens": -5}, "absurd_max_tokens": {**ok, "max_tokens": 10**12},
              "unknown_model": {**ok, "model": "gpt-9"}, "unknown_field": {**ok, "frobnicate": 1},
              "bad_token_id": {**ok, "prompt": [1, 2, 10**9]}, "n_too_large": {**ok, "n": 10**6, "temperature": 1}}
    if case in raw:
        r = requests.post(url, data=raw[case], headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = requests.post(url, json=bodies[case], timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["code"] == r.status_code
    if case == "unknown_model":
        assert r.status_code == 404
    assert_alive(server)


def test_a_request_without_its_model_is_served_by_the_one_model(server):
    # (vLLM's server takes `model` as optional; relayrl serve refused such a request with 400)
    for route, body in (("/completions", {"prompt": "1+1=", "max_tokens": 2}),
                        ("/chat/completions", {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2})):
        r = requests.post(f"{server.url}{route}", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny"
    assert_alive(server)


def test_every_invalid_field_of_a_request_is_named(server):
    # (the message named the first alone with "(and 1 more)": a bad max_tokens hid the bad temperature after it)
    r = requests.post(f"{server.url}/chat/completions", json={"messages": [{"role": "user", "content": "1+1="}],
                                                               "temperature": -1, "max_tokens": -3, "frobnicate": 1},
                      timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    for part in ("temperature: ", "max_tokens: ", "frobnicate: unknown field"):
        assert part in err["message"], err["message"]
    assert_alive(server)


def test_invalid_utf8_and_huge_body(server):
    r = requests.post(f"{server.url}/completions", data=b'{"model": "tiny", "prompt": "\xff\xfe"}', timeout=30)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    huge = json.dumps({"model": "tiny", "prompt": "x" * (4 << 20)}).encode()
    r = requests.post(f"{server.url}/completions", data=huge, timeout=60)
    assert r.status_code == 413
    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(64):
            yield b"x" * (64 << 10)
    r = requests.post(f"{server.url}/completions", data=chunks(), timeout=60)
    assert r.status_code == 413
    assert_alive(server)


def test_client_disconnecting_mid_stream(server):
    host, port = server.root[len("http://"):].split(":")
    body = json.dumps({"model": "tiny", "prompt": "3+4=", "max_tokens": 400, "ignore_eos": True, "stream": True})
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    got = b""
    while b"data:" not in got:
        got += s.recv(4096)
    s.close()  # gone mid-stream
    deadline = time.monotonic() + 30
    while requests.get(f"{server.root}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests.get(f"{server.root}/health").json()["running"] == 0  # its rows left the batch
    assert_alive(server)


def test_weights_endpoint_loads_a_payload_and_a_path(server, tiny_dir, tmp_path):
    from safetensors.torch import save, save_file

    from relayrl.models.load import load_model

    greedy = {"model": "tiny", "prompt": "12+34=", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    before = post(server, "/completions", greedy).json()["choices"][0]["token_ids"]
    model = load_model(tiny_dir)
    torch.manual_seed(0)
    perturbed = {n: (p + 0.5 * torch.randn_like(p)).contiguous() for n, p in model.named_parameters()}
    r = requests.post(f"{server.url}/relayrl/weights", params={"version": 7}, data=save(perturbed),
                      headers={"Content-Type": "application/octet-stream"}, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == 7
    assert requests.get(f"{server.url}/relayrl/weights").json() == {"version": 7}
    assert post(server, "/completions", greedy).json()["choices"][0]["token_ids"] != before
    original = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(original, str(tmp_path / "w.safetensors"))
    r = post(server, "/relayrl/weights", {"path": str(tmp_path / "w.safetensors"), "version": 8})
    assert r.status_code == 200 and r.json()["version"] == 8
    assert post(server, "/completions", greedy).json()["choices"][0]["token_ids"] == before
    bad = requests.post(f"{server.url}/relayrl/weights", params={"version": 9}, data=b"not safetensors",
                        headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert bad.status_code == 400
    wrong = save({"no.such.weight": torch.zeros(2)})
    bad = requests.post(f"{server.url}/relayrl/weights", params={"version": 9}, data=wrong,
                        headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert bad.status_code == 400 and "no.such.weight" in bad.json()["error"]["message"]
    assert requests.get(f"{server.url}/relayrl/weights").json() == {"version": 8}


def test_bearer_token_and_public_host_refusal(tiny_dir, tmp_path):
    s = start_server(tiny_dir, tmp_path / "auth.log", "--name", "tiny", env={"RELAYRL_API_KEY": "s3cret"})
    try:
        body = {"model": "tiny", "prompt": "1+1=", "max_tokens": 2}
        assert requests.get(f"{s.root}/health").status_code == 200
        assert requests.post(f"{s.url}/completions", json=body).status_code == 401
        assert requests.post(f"{s.url}/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert requests.post(f"{s.url}/completions", json=body,
                             headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        s.stop()
    r = relayrl("serve", str(tiny_dir), "--host", "0.0.0.0", timeout=120, env={"RELAYRL_API_KEY": None})
    assert r.returncode == 1 and "bearer token" in r.stderr


def test_limits_of_relayrl_serve_answer_with_a_status(tiny_dir, tmp_path):
    """64 MiB to /v1/completions through the official client: 413; a weights payload declared over its limit:
    413 before the body is read, the connection closed; a body that never finishes: 408 after --body-timeout-s."""
    openai = pytest.importorskip("openai")
    s = start_server(tiny_dir, tmp_path / "limits.log", "--name", "tiny", "--body-timeout-s", "1")
    try:
        client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt="x" * (64 << 20))
        assert e.value.status_code == 413
        host, port = s.root[len("http://"):].split(":")
        for head in (f"POST /v1/relayrl/weights?version=3 HTTP/1.1\r\nContent-Length: {1 << 40}\r\n",
                     "POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n"):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(f"{head}Host: x\r\nContent-Type: application/octet-stream\r\n\r\n".encode() + b"{")
            reply = b""
            while chunk := sock.recv(65536):  # the server closes the connection after its answer
                reply += chunk
            sock.close()
            assert reply.startswith(b"HTTP/1.1 413" if "weights" in head else b"HTTP/1.1 408"), reply
            assert b'"code":4' in reply
        assert client.completions.create(model="tiny", prompt="1+1=", max_tokens=2).choices
    finally:
        s.stop()
