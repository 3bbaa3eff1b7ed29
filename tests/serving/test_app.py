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


def test_the_dock_api_refuses_a_partition_beyond_memory_and_names_a_stale_generation():
    """rows=10**12 answered a 500 ("Unable to allocate 7.28 TiB"); an ack naming a generation the open
    partition does not have said the partition "has been closed", though it was open."""
    from fastapi.testclient import TestClient

    from relayrl.dock import Dock
    from relayrl.serving.dockapi import MAX_PARTITION_ROWS, build_dock_app

    dock = Dock(units=1, backend="local", lease_s=30.0)
    try:
        with TestClient(build_dock_app(dock), raise_server_exceptions=False) as c:
            r = c.post("/v1/dock/partitions", json={"name": "p", "rows": 10**12})
            assert r.status_code == 400 and r.json()["error"]["param"] == "rows", r.text
            assert f"at most {MAX_PARTITION_ROWS}" in r.json()["error"]["message"]
            assert c.post("/v1/dock/partitions", json={"name": "p", "rows": 4}).status_code == 200
            gen = dock._parts["p"].gen
            r = c.post("/v1/dock/ack", json={"partition": "p", "gen": gen + 7, "stage": "s", "lease_id": 1,
                                             "indexes": [1]})
            assert r.status_code == 404, r.text
            msg = r.json()["error"]["message"]
            assert f"generation {gen + 7}" in msg and f"open as generation {gen}" in msg and "closed" in msg
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


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
DONE = {"model": "tiny", "prompt": "1+1=", "max_tokens": 2}


@pytest.mark.parametrize("route, body, param, words", [
    # (chat's top_logprobs over the limit was reported as param "logprobs")
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs=21 exceeds"),
    # (checks across fields were reported as param "body", their messages "body: Value error, ...")
    ("completions", {**DONE, "echo": True}, "echo", "echo: not supported"),
    ("completions", {**DONE, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ("chat", {**CHAT, "frequency_penalty": 1}, "frequency_penalty", "not supported"),
    ("completions", {**DONE, "logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools are not"),
    ("completions", {**DONE, "suffix": "y"}, "suffix", "not supported"),
    ("completions", {**DONE, "best_of": 2}, "best_of", "not supported"),
    ("chat", {**CHAT, "top_logprobs": 3}, "top_logprobs", "needs logprobs=true"),
    ("chat", {**CHAT, "max_completion_tokens": 3}, "max_completion_tokens", "disagree"),
    ("completions", {**DONE, "temperature": 0, "n": 2}, "n", "identical"),
    ("chat", {**CHAT, "messages": [{"role": "user"}]}, "messages.0.content", "needs 'content'"),
    # (a field validator's message came as "max_tokens: Value error, max_tokens=0 ...")
    ("completions", {**DONE, "max_tokens": 0}, "max_tokens", "max_tokens: max_tokens=0 must be >= 1"),
    # (NaN passed as far as le=100: "Input should be less than or equal to 100")
    ("completions", {**DONE, "temperature": float("nan")}, "temperature", "finite number"),
    ("completions", {**DONE, "top_p": float("inf")}, "top_p", "finite number"),
    # (refused as "at most 4 non-empty strings", which hid the reason)
    ("completions", {**DONE, "stop": [""]}, "stop", "an empty stop string is not allowed"),
    ("completions", {**DONE, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    # (lax ints: true was read as max_tokens=1, "5" as 5; OpenAI refuses both)
    ("completions", {**DONE, "max_tokens": True}, "max_tokens", "valid integer"),
    ("completions", {**DONE, "max_tokens": "5"}, "max_tokens", "valid integer"),
    ("completions", {**DONE, "n": 2.0, "temperature": 1}, "n", "valid integer"),
    ("completions", {**DONE, "prompt": [1, True]}, "prompt", "token ids"),
    # (a prompt of the wrong type was named by union member: param "prompt.str", four reasons)
    ("completions", {**DONE, "prompt": 5}, "prompt", "give a text"),
    # (lax floats and booleans: true was read as temperature=1.0, "0.5" as 0.5, "yes" as stream=true, 1 as
    # logprobs=true; OpenAI refuses each, as the integer fields here do)
    ("completions", {**DONE, "temperature": True}, "temperature", "valid number"),
    ("chat", {**CHAT, "top_p": "0.5"}, "top_p", "valid number"),
    ("completions", {**DONE, "stream": "yes"}, "stream", "valid boolean"),
    ("completions", {**DONE, "echo": "no"}, "echo", "valid boolean"),
    ("chat", {**CHAT, "logprobs": 1}, "logprobs", "valid boolean"),
    ("chat", {**CHAT, "add_generation_prompt": "false"}, "add_generation_prompt", "valid boolean"),
    # (stream_options was any dict: an option it does not implement, or include_usage="yes", was taken)
    ("completions", {**DONE, "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "unknown field"),
    ("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "valid boolean"),
    # (a stop token id outside the vocabulary was taken and could never match)
    ("completions", {**DONE, "stop_token_ids": [7, 99999]}, "stop_token_ids", "stop token id 99999 is outside"),
    ("chat", {**CHAT, "stop_token_ids": [-5]}, "stop_token_ids", "stop token id -5 is outside"),
    # (a text part without "text" was "content part 'text' is not supported; only text parts", param "messages")
    ("chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text",
     "a text part needs 'text'"),
    ("chat", {**CHAT, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.1.content.1.type", "'image_url' parts are not supported"),
    # (logits / 1e-300 overflowed to inf: a 500 and the generation loop stopped for every later request)
    ("completions", {**DONE, "temperature": 1e-300}, "temperature", "temperature=1e-300 is below 1e-05"),
    ("chat", {**CHAT, "repetition_penalty": 1e-40}, "repetition_penalty", "repetition_penalty=1e-40 is below"),
    ("chat", {**CHAT, "repetition_penalty": 1e38}, "repetition_penalty", "repetition_penalty=1e+38 is above 100000"),
    # (named by union member: param "stop.str", "messages.0.content.str", a reason per member)
    ("completions", {**DONE, "stop": 5}, "stop", "give a string or a list of strings, not int"),
    ("completions", {**DONE, "stop": ["a", 5]}, "stop", "a list of strings, not list holding other values"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content", "give a text or a list"),
])
def test_a_refusal_names_the_offending_field_in_its_own_words(client, route, body, param, words):
    import json

    c, _ = client
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})  # (NaN as JSON's NaN)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "Value error" not in err["message"] and "body" != err["param"]


def test_a_key_given_twice_in_the_body_is_refused_naming_it(client):
    """``json`` kept the last of two max_tokens unsaid (another server may keep the first)."""
    c, _ = client
    raw = b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 2, "max_tokens": 3}'
    r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "given twice" in err["message"], err
    nested = b'{"model": "tiny", "messages": [{"role": "user", "content": "a", "content": "b"}], "max_tokens": 2}'
    r = c.post("/v1/chat/completions", content=nested, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text


def test_a_temperature_that_overflows_the_logits_is_refused_and_the_server_keeps_serving(client):
    """temperature=1e-300 divided the logits to inf, the sampler's softmax to NaN: the batcher thread died on an
    index error, that request and every later one got a 500 ("the generation loop stopped")."""
    c, _ = client
    for t in (1e-300, 1e-38, 5e-6):
        r = c.post("/v1/completions", json={**DONE, "temperature": t})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        assert "use 0 for greedy decoding" in r.json()["error"]["message"]
    ok = c.post("/v1/completions", json={**DONE, "temperature": 1e-5})  # (the smallest taken samples greedily)
    assert ok.status_code == 200, ok.text
    assert c.get("/health").json()["status"] == "ok"


def test_the_official_openai_client_sends_what_the_strict_fields_take(client):
    openai = pytest.importorskip("openai")
    c, _ = client
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c, max_retries=0)
    done = api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, n=2, seed=4, logprobs=1,
                                  temperature=1, extra_body={"top_k": 5, "stop_token_ids": [7]})
    assert len(done.choices) == 2
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=2, logprobs=True, top_logprobs=2, seed=1)
    assert chat.choices[0].logprobs is not None


def test_streamed_text_offsets_run_on_across_chunks_as_the_non_streamed_ones(client):
    # (every streamed chunk reported text_offset [0])
    import json

    c, _ = client
    body = {"model": "tiny", "prompt": ["12+34=", "sort 3 1 ="], "n": 2, "max_tokens": 8, "temperature": 1,
            "seed": 3, "logprobs": 1, "ignore_eos": True}
    whole = c.post("/v1/completions", json=body).json()
    streamed: dict[int, dict[str, list]] = {}
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[len("data: "):])["choices"]:
                if ch["logprobs"]:
                    got = streamed.setdefault(ch["index"], {"text_offset": [], "tokens": []})
                    got["text_offset"] += ch["logprobs"]["text_offset"]
                    got["tokens"] += ch["logprobs"]["tokens"]
    for choice in whole["choices"]:
        lp = choice["logprobs"]
        assert streamed[choice["index"]] == {"text_offset": lp["text_offset"], "tokens": lp["tokens"]}
        assert lp["text_offset"][-1] > 0


def _streamed_text(c, path: str, body: dict) -> str:
    import json

    out = []
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[len("data: "):])["choices"]:
                    out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return "".join(out)


def test_a_stop_token_leaves_its_text_out_but_stays_in_the_token_ids(client, tiny_tokenizer):
    # (the text ended with the stop token's text; vLLM's detokenizer leaves it out unless
    # include_stop_str_in_output, and keeps the id in token_ids and the log-probs)
    c, _ = client
    body = {"model": "tiny", "prompt": "2+2=", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 0}
    free = c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    stop = next(t for t in free[1:] if tiny_tokenizer.decode([t], skip_special_tokens=True))
    cut = free[:free.index(stop) + 1]
    r = c.post("/v1/completions", json={**body, "stop_token_ids": [stop]}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == cut
    assert r["text"] == tiny_tokenizer.decode(cut[:-1], skip_special_tokens=True)
    assert len(r["logprobs"]["tokens"]) == len(cut)
    assert _streamed_text(c, "/v1/completions", {**body, "stop_token_ids": [stop]}) == r["text"]
    kept = {**body, "stop_token_ids": [stop], "include_stop_str_in_output": True}
    whole = tiny_tokenizer.decode(cut, skip_special_tokens=True)
    assert c.post("/v1/completions", json=kept).json()["choices"][0]["text"] == whole
    assert _streamed_text(c, "/v1/completions", kept) == whole
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    ids = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["token_ids"]
    r = c.post("/v1/chat/completions", json={**chat, "stop_token_ids": [ids[2]]}).json()["choices"][0]
    assert r["token_ids"] == ids[:ids.index(ids[2]) + 1]
    assert r["message"]["content"] == tiny_tokenizer.decode(r["token_ids"][:-1], skip_special_tokens=True)


def test_include_stop_str_in_output_keeps_a_stop_string(client, tiny_tokenizer):
    c, _ = client
    body = {"model": "tiny", "prompt": "2+2=", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[2:4]
    if len(text) < 4 or not stop.strip():
        pytest.skip(f"the tiny model's greedy text {text!r} has no stop string to cut at")
    kept = {**body, "stop": [stop], "include_stop_str_in_output": True}
    assert c.post("/v1/completions", json=kept).json()["choices"][0]["text"] == text[:text.find(stop) + len(stop)]
    assert _streamed_text(c, "/v1/completions", kept) == text[:text.find(stop) + len(stop)]


def test_a_prompts_seeded_samples_are_those_of_a_request_for_it_alone(client):
    # (prompt i of a list was seeded seed + i and sample 0 depended on n; vLLM gives every prompt the seed and
    # sample k seed + k)
    c, _ = client
    body = {"model": "tiny", "max_tokens": 6, "temperature": 1, "seed": 7, "ignore_eos": True}
    alone = c.post("/v1/completions", json={**body, "prompt": "2+2="}).json()["choices"][0]["text"]
    many = c.post("/v1/completions", json={**body, "prompt": ["1+1=", "2+2="], "n": 2}).json()["choices"]
    assert many[2]["text"] == alone  # prompt 1, sample 0


def test_chat_template_kwargs_reach_the_template(client, tiny_tokenizer):
    # (refused as an unknown field; vLLM passes it to the tokenizer's apply_chat_template)
    c, state = client
    tok = state.tokenizer
    plain = tok.chat_template
    tok.chat_template = plain + "{% if enable_thinking %}<think>{% endif %}"
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 1,
                "return_token_ids": True}
        off = c.post("/v1/chat/completions", json=body).json()["prompt_token_ids"]
        on = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": True}})
        assert on.status_code == 200, on.text
        assert tok.decode(on.json()["prompt_token_ids"]) == tok.decode(off) + "<think>"
        r = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        r = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": ["enable_thinking"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    finally:
        tok.chat_template = plain


def test_a_training_checkpoint_of_a_tied_model_loads_by_path(tiny_dir, tmp_path):
    # (a checkpoint's state dict holds the tied head under its own name: "weight 'lm_head.weight' is not a
    # parameter of the served model", so a checkpoint directory could not be served)
    import torch
    from fastapi.testclient import TestClient
    from safetensors.torch import save

    from relayrl.checkpoint.manager import CheckpointManager
    from relayrl.serving.app import build_app
    from relayrl.serving.server import build_state

    state = build_state(str(tiny_dir), limits=ServeLimits(), api_key=None, max_batch=2, name="tiny")
    model = state.batcher.engine.model
    assert model.config.tie_word_embeddings
    torch.manual_seed(0)
    trained = {n: t + 0.01 * torch.randn_like(t) for n, t in model.state_dict().items()}
    trained["lm_head.weight"] = trained["model.embed_tokens.weight"]  # tied: one tensor under both names
    step = CheckpointManager(tmp_path / "checkpoints").save(2, model_state=trained, optimizer_state=None,
                                                            scheduler_state=None, trainer_state={})
    embed = model.get_input_embeddings().weight

    def post_payload(tensors: dict, version: int):
        return c.post("/v1/relayrl/weights", params={"version": version}, content=save(tensors),
                      headers={"Content-Type": "application/octet-stream"})

    try:
        with TestClient(build_app(state)) as c:
            r = c.post("/v1/relayrl/weights", json={"path": str(step), "version": 2})
            assert r.status_code == 200, r.text
            assert r.json()["version"] == 2 and r.json()["tensors"] == len(trained) - 1
            torch.testing.assert_close(embed, trained["model.embed_tokens.weight"], rtol=0, atol=0)
            assert model.lm_head.weight is embed  # still tied

            head = torch.randn_like(embed)  # the head alone: in the served model it is the embedding
            assert post_payload({"lm_head.weight": head}, 3).status_code == 200
            torch.testing.assert_close(embed, head, rtol=0, atol=0)

            r = post_payload({"model.embed_tokens.weight": head, "lm_head.weight": head + 1}, 4)
            assert r.status_code == 400 and "tie" in r.json()["error"]["message"], r.text
            assert c.get("/v1/relayrl/weights").json() == {"version": 3}
            torch.testing.assert_close(embed, head, rtol=0, atol=0)
    finally:
        state.batcher.close()


def test_weights_that_are_not_finite_are_refused_and_the_server_keeps_serving(tiny_dir, tmp_path):
    """A NaN embedding was loaded (200), then the first completion's sampler met NaN probabilities: the batcher
    thread died and every later request, /health included, answered 500 until a restart."""
    import torch
    from fastapi.testclient import TestClient
    from safetensors.torch import save, save_file

    from relayrl.serving.app import build_app
    from relayrl.serving.server import build_state

    state = build_state(str(tiny_dir), limits=ServeLimits(), api_key=None, max_batch=2, name="tiny")
    embed = state.batcher.engine.model.get_input_embeddings().weight
    before = embed.detach().clone()
    bad = before.clone()
    bad[3, 5], bad[7, 1] = float("nan"), float("inf")
    save_file({"model.embed_tokens.weight": bad}, str(tmp_path / "bad.safetensors"))
    try:
        with TestClient(build_app(state), raise_server_exceptions=False) as c:
            r = c.post("/v1/relayrl/weights", params={"version": 1}, content=save({"model.embed_tokens.weight": bad}),
                       headers={"Content-Type": "application/octet-stream"})
            assert r.status_code == 400, r.text
            assert "'model.embed_tokens.weight' holds 2 values that are not finite" in r.json()["error"]["message"]
            r = c.post("/v1/relayrl/weights", json={"path": str(tmp_path / "bad.safetensors"), "version": 1})
            assert r.status_code == 400 and "not finite" in r.json()["error"]["message"], r.text
            torch.testing.assert_close(embed, before, rtol=0, atol=0)  # nothing was copied
            assert c.get("/v1/relayrl/weights").json() == {"version": 0}
            assert c.post("/v1/completions", json={**DONE, "temperature": 1}).status_code == 200
            assert c.get("/health").json()["status"] == "ok"
    finally:
        state.batcher.close()


def test_a_request_that_leaves_sampling_out_takes_the_models_generation_config(tiny_dir, tmp_path):
    """As ``vllm serve`` (its default ``--generation-config auto``): a request without temperature, top_p or top_k
    samples with the model's generation_config.json values (old behaviour: always OpenAI's 1.0, 1.0, none, so
    a Qwen3 model served at temperature 1 where its card and vLLM use 0.6); its own values and
    ``--generation-config none`` win."""
    import shutil

    from fastapi.testclient import TestClient
    from transformers import GenerationConfig

    from relayrl.serving.app import _sampling, build_app
    from relayrl.serving.protocol import CompletionRequest
    from relayrl.serving.server import build_state

    d = shutil.copytree(tiny_dir, tmp_path / "m")
    gen = GenerationConfig.from_pretrained(d)
    gen.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    gen.save_pretrained(d)
    state = build_state(str(d), limits=ServeLimits(), api_key=None, max_batch=2, name="m")
    bare = build_state(str(d), limits=ServeLimits(), api_key=None, max_batch=2, name="m", generation_config="none")
    try:
        assert state.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20} and not bare.sampling_defaults

        def params(st, **fields):
            return _sampling(st, CompletionRequest.model_validate({"prompt": "1+1=", "max_tokens": 2, **fields}),
                             [[1, 2]], chat=False)

        p = params(state)
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.95, 20, 0.0, 1.0)
        p = params(state, temperature=1.0, top_k=-1)
        assert (p.temperature, p.top_p, p.top_k) == (1.0, 0.95, 0)
        p = params(bare)
        assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
        with TestClient(build_app(state)) as c:
            r = c.post("/v1/completions", json={"model": "m", "prompt": "1+1=", "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    finally:
        state.batcher.close()
        bare.batcher.close()


@pytest.mark.slow
def test_the_openai_engines_request_gives_the_native_engines_response_at_a_stop_string(tiny_model, tiny_tokenizer,
                                                                                       tmp_path):
    """``rollout.engine=openai``'s request to ``relayrl serve`` (SGLang's no_stop_trim beside vLLM's
    include_stop_str_in_output, a special token's stop string as its id): the server refused no_stop_trim (400),
    and the response must be the native engine's, the token that completes the stop string kept, in the ids and
    in the text."""
    from fastapi.testclient import TestClient

    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.engines.generation.remote import RemoteGenerationEngine, parse_choice
    from relayrl.serving.app import build_app
    from relayrl.serving.server import build_state

    tok = tiny_tokenizer
    tiny_model.save_pretrained(tmp_path)  # (the perturbed model: the untrained one repeats one token)
    tok.save_pretrained(tmp_path)
    native = NativeGenerationEngine(tiny_model, tok)
    def first_new_text(prompt: list[int]):
        """(prompt, its greedy response, k, the text its k-th token adds first): a stop string the response
        first spells at a token past the first (None: the response repeats one token)."""
        free = native.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12))[0].token_ids.tolist()
        texts = [tok.decode(free[:k], skip_special_tokens=True) for k in range(len(free) + 1)]
        return next(((prompt, free, k, texts[k][len(texts[k - 1]):]) for k in range(2, len(free) + 1)
                     if texts[k][len(texts[k - 1]):] and texts[k][len(texts[k - 1]):] not in texts[k - 1]), None)

    prompt, free, k, stop = next(f for p in ("1+2=", "7*8=", "12+34=", "9-4=") if (f := first_new_text(
        tok(p)["input_ids"])) is not None)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_strings=(stop, "<|im_end|>"))
    want = native.generate([prompt], params)[0]
    assert want.token_ids.tolist() == free[:k] and want.finish_reason == "stop" and want.text.endswith(stop)

    eng = object.__new__(RemoteGenerationEngine)  # (its request body; the app in-process stands for the server)
    eng.model, eng.tokenizer = "tiny", tok
    body = eng._body(prompt, params, seed=None)
    assert body["no_stop_trim"] and body["include_stop_str_in_output"] and body["stop"] == [stop]
    assert body["stop_token_ids"] == [tok.convert_tokens_to_ids("<|im_end|>")]
    state = build_state(str(tmp_path), limits=ServeLimits(), api_key=None, max_batch=2, name="tiny")
    try:
        with TestClient(build_app(state)) as c:
            r = c.post("/v1/completions", json=body)
    finally:
        state.batcher.close()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, logps = parse_choice(choice)
    assert ids == want.token_ids.tolist() and choice["finish_reason"] == "stop"
    assert choice["text"] == want.text  # (the server's text keeps the stop string, as the native engine's)
    assert logps == pytest.approx(want.logprobs.tolist(), abs=1e-5)


def test_a_message_s_name_reaches_the_chat_template(client):
    """OpenAI's ``name`` on a message goes to the template beside role and content, as vLLM passes it (it was
    dropped before the template: a template that renders it never saw it)."""
    c, state = client
    tok = state.tokenizer
    kept = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% if m.name %}{{ m.name }}: {% endif %}{{ m.content }}\n"
                         "{% endfor %}")
    try:
        def prompt_tokens(**named):
            body = {**CHAT, "messages": [{"role": "user", "content": "1+1=", **named}]}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        plain, named = prompt_tokens(), prompt_tokens(name="bob")
        assert named == plain + len(tok("bob: ", add_special_tokens=False)["input_ids"]), (plain, named)
    finally:
        tok.chat_template = kept
