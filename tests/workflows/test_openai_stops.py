"""``rollout.engine=openai`` against the fake server: what a request asks about stops, and that the trained
response is the token ids the server returned, whatever its text (vLLM cuts its own text at a stop string
unless asked to keep it; relayrl decodes the text from the ids, as the native engine does)."""

from __future__ import annotations

import torch

from fake_openai import FakeServer
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.remote import RemoteGenerationEngine, RemoteSpec


def test_the_trained_response_is_the_servers_ids_with_the_stop_string_kept(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok("12+34=46")["input_ids"]
    done = next(k for k in range(len(ids)) if "=" in tok.decode(ids[:k + 1]))  # the token completing "="
    sampled = ids[:done + 1]

    def reply(body: dict) -> list[dict]:  # a vLLM server that cut its text at the stop string, ids kept
        return [{"index": 0, "token_ids": sampled, "text": tok.decode(sampled).split("=")[0], "finish_reason": "stop",
                 "logprobs": {"token_logprobs": [-0.25] * len(sampled)}}]

    server = FakeServer(fails=lambda p: False, choices=reply)
    eng = RemoteGenerationEngine(RemoteSpec(base_url=server.url, weight_sync="none", retries=0), tok)
    try:
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, stop_strings=("=", "<|im_end|>"))
        (c,) = eng.generate([[1, 2, 3]], params, generator=torch.Generator().manual_seed(0))
    finally:
        eng.close()
        server.stop()
    (body,) = server.bodies
    assert body["include_stop_str_in_output"] is True and body["no_stop_trim"] is True
    assert body["stop"] == ["="] and body["stop_token_ids"] == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert c.token_ids.tolist() == sampled and c.finish_reason == "stop"
    assert c.text == tok.decode(sampled, skip_special_tokens=True) and c.text.endswith("=")
    assert c.logprobs.tolist() == [-0.25] * len(sampled)
