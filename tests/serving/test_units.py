"""Fast unit tests of the serving pieces that need no server: host rule, streamed text with stop strings,
request records."""

from __future__ import annotations

import pytest

from relayrl.serving.guard import is_loopback
from relayrl.serving.protocol import ChatCompletionRequest, CompletionRequest
from relayrl.serving.responses import SampleText


def test_only_loopback_hosts_go_without_a_token():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_serve_refuses_a_public_host_without_a_token(tmp_path):
    from relayrl.serving.server import ServeError, serve

    with pytest.raises(ServeError, match="bearer token"):
        serve(str(tmp_path), host="0.0.0.0", api_key=None)


def test_streamed_text_holds_back_a_possible_stop_string(tiny_tokenizer):
    ids = tiny_tokenizer("12+34=46 and more")["input_ids"]
    full = SampleText(tiny_tokenizer, ("and",)).full(ids)
    st = SampleText(tiny_tokenizer, ("and",))
    streamed = "".join(st.push(i) for i in ids) + st.finish()
    assert streamed == full == tiny_tokenizer.decode(ids, skip_special_tokens=True).split("and")[0]
    assert st.stopped


def test_request_records_refuse_what_is_not_supported():
    with pytest.raises(ValueError, match="echo"):
        CompletionRequest(model="m", prompt="x", echo=True)
    with pytest.raises(ValueError, match="frequency_penalty"):
        CompletionRequest(model="m", prompt="x", frequency_penalty=0.5)
    with pytest.raises(ValueError, match="identical"):
        CompletionRequest(model="m", prompt="x", temperature=0, n=2)
    with pytest.raises(ValueError, match="tools"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="tool_choice"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tool_choice="auto")
    # (no tools and tool_choice "none" ask for nothing, as docs/serving.md says)
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[],
                                 tool_choice="none").tools == []
    with pytest.raises(ValueError, match="a 'user' message needs 'content'"):
        ChatCompletionRequest(model="m", messages=[{"role": "user"}])
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"},
                                                      {"role": "assistant"}]).messages[1].text() == ""
    assert CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompt_list() == [[1, 2], [3]]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompt_list() == [[1, 2]]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                 max_completion_tokens=7)
    assert chat.max_tokens == 7 and chat.messages[0].text() == "a"


def test_vllm_sampling_extensions_are_read():
    req = CompletionRequest(model="m", prompt="x", min_p=0.05, repetition_penalty=1.1, top_k=5)
    assert (req.min_p, req.repetition_penalty, req.top_k) == (0.05, 1.1, 5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        CompletionRequest(model="m", prompt="x", repetition_penalty=0)


def test_request_records_refuse_what_would_be_ignored_or_crash():
    with pytest.raises(ValueError, match="seed"):  # (torch's generator takes 64 bits: a 500 before)
        CompletionRequest(model="m", prompt="x", seed=2**70)
    assert CompletionRequest(model="m", prompt="x", seed=-5).seed == -5
    with pytest.raises(ValueError, match="stream_options"):
        CompletionRequest(model="m", prompt="x", stream_options={"include_usage": True})
    assert CompletionRequest(model="m", prompt="x", stream=True, stream_options={"include_usage": True}).include_usage
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="max_completion_tokens"):
        ChatCompletionRequest(model="m", messages=msgs, max_tokens=2, max_completion_tokens=5)
    assert ChatCompletionRequest(model="m", messages=msgs, max_tokens=5, max_completion_tokens=5).max_tokens == 5
