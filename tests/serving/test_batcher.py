"""Continuous batching across requests (in-process, no HTTP): rows of different requests, admitted while
others run, with their own settings, give what each request would get alone."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.serving.batcher import Batcher, DoneEvent, Overloaded, Request, TokenEvent

PROMPTS = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1=", "countdown 3 7 5 -> 9 :", "9+9="]


@contextlib.contextmanager
def held(batcher: Batcher):
    """The batcher thread held inside a weight load for the block: nothing is admitted or decoded meanwhile, so
    the queue holds exactly what the block submits."""
    inside, release = threading.Event(), threading.Event()

    def apply() -> int:
        inside.set()
        release.wait(60)
        return batcher.engine.weight_version

    loader = threading.Thread(target=batcher.load_weights, args=(apply,), daemon=True)
    loader.start()
    assert inside.wait(60)
    try:
        yield
    finally:
        release.set()
        loader.join(60)


class Sink:
    def __init__(self, n: int) -> None:
        self.events: list = []
        self.left = n
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if isinstance(ev, DoneEvent):
            self.left -= 1
            if self.left <= 0:
                self.done.set()

    def finished(self) -> list[DoneEvent]:
        return sorted((e for e in self.events if isinstance(e, DoneEvent)), key=lambda e: e.sample)


@pytest.fixture()
def batcher(tiny_model, tiny_tokenizer):
    b = Batcher(NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=4, decode="dynamic"))
    yield b
    b.close()


def test_requests_batched_together_match_each_alone(batcher, tiny_tokenizer):
    eng = batcher.engine
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPTS]
    lengths = [3, 9, 5, 12, 7, 4]
    alone = [eng.generate([p], SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True))[0]
             for p, m in zip(prompts, lengths)]
    sinks = [Sink(1) for _ in prompts]
    for p, m, s in zip(prompts, lengths, sinks):  # max_batch=4: later requests join as earlier ones finish
        batcher.submit(Request(p, SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True), emit=s,
                               stream_tokens=True))
    for s, a in zip(sinks, alone):
        assert s.done.wait(60)
        (done,) = s.finished()
        assert list(done.token_ids) == a.token_ids.tolist() and done.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(done.logprobs), a.logprobs, atol=1e-4, rtol=1e-4)
        assert [e.token_id for e in s.events if isinstance(e, TokenEvent)] == list(done.token_ids)
    assert batcher.steps < sum(lengths)  # rows of several requests shared decode steps


def test_sampled_logprobs_follow_each_requests_temperature(batcher, tiny_model, tiny_tokenizer):
    p = tiny_tokenizer(PROMPTS[1])["input_ids"]
    sinks = {t: Sink(2) for t in (0.5, 1.5)}
    for t, s in sinks.items():
        batcher.submit(Request(p, SamplingParams(n=2, temperature=t, max_new_tokens=6), emit=s, seed=3,
                               top_logprobs=2))
    for t, s in sinks.items():
        assert s.done.wait(60)
        for d in s.finished():
            with torch.no_grad():
                logits = tiny_model(torch.tensor([p + list(d.token_ids)])).logits[0, len(p) - 1:-1] / t
            ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(d.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(d.logprobs), ref, atol=1e-4, rtol=1e-4)
        tops = [e.top for e in s.events if isinstance(e, TokenEvent)]
        assert all(len(t2) == 2 and t2[0][1] >= t2[1][1] for t2 in tops)


def test_seeded_requests_repeat(batcher, tiny_tokenizer):
    p = tiny_tokenizer(PROMPTS[0])["input_ids"]
    runs = []
    for _ in range(2):
        s = Sink(3)
        batcher.submit(Request(p, SamplingParams(n=3, temperature=1.0, max_new_tokens=6), emit=s, seed=11))
        assert s.done.wait(60)
        runs.append([d.token_ids for d in s.finished()])
    assert runs[0] == runs[1]


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_cancelled_request_leaves_the_batch_and_weights_wait_for_a_drain(batcher, tiny_tokenizer, tiny_model):
    p = tiny_tokenizer(PROMPTS[2])["input_ids"]
    s = Sink(1)
    r = Request(p, SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True), emit=s, stream_tokens=True)
    batcher.submit(r)
    while not any(isinstance(e, TokenEvent) for e in s.events):
        pass
    r.cancel()
    assert s.done.wait(30) and s.finished()[0].finish_reason == "cancelled"
    named = [(n, t.detach().clone()) for n, t in tiny_model.named_parameters()]
    assert batcher.load_weights(lambda: (batcher.engine.update_weights(named, 5), batcher.engine.weight_version)[1]) == 5
    assert batcher.stats()["running"] == 0 and batcher.stats()["weight_version"] == 5


def test_full_queue_is_refused(tiny_model, tiny_tokenizer):
    b = Batcher(NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=1, decode="dynamic"), max_waiting=1)
    try:
        p = tiny_tokenizer(PROMPTS[0])["input_ids"]
        long = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
        reqs = [Request(p, long, emit=lambda ev: None) for _ in range(3)]
        with pytest.raises(Overloaded):
            for r in reqs:
                b.submit(r)
        for r in reqs:
            r.cancel()
    finally:
        b.close()


def test_a_penalised_request_beside_plain_ones_gets_what_it_gets_alone(batcher, tiny_tokenizer):
    """Requests with and without a repetition penalty or min-p share the batch (rows join while the penalised
    one runs, so the batch's seen-token mask grows and shrinks under it); each gets its greedy tokens alone."""
    eng = batcher.engine
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPTS]
    settings = [dict(repetition_penalty=1.8), {}, dict(repetition_penalty=1.3), {}, dict(min_p=0.3), {}]
    params = [SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True, **s)
              for m, s in zip([12, 3, 9, 4, 6, 5], settings)]
    alone = [eng.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    plain = eng.generate([prompts[0]], params[0].model_copy(update={"repetition_penalty": 1.0}))[0]
    assert plain.token_ids.tolist() != alone[0].token_ids.tolist()  # the penalty changes this prompt's answer
    sinks = [Sink(1) for _ in prompts]
    for p, sp, s in zip(prompts, params, sinks):
        batcher.submit(Request(p, sp, emit=s))
    for s, a in zip(sinks, alone):
        assert s.done.wait(60)
        assert list(s.finished()[0].token_ids) == a.token_ids.tolist()


def test_the_prompts_of_one_request_are_queued_together_or_not_at_all(tiny_model, tiny_tokenizer):
    # (prompts were submitted one by one: a 503 came after some were queued, and the handler had to cancel them)
    b = Batcher(NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=1, decode="dynamic"), max_waiting=2)
    p = tiny_tokenizer(PROMPTS[0])["input_ids"]
    reqs = [Request(p, SamplingParams(max_new_tokens=2), emit=lambda ev: None) for _ in range(4)]
    try:
        with held(b):
            with pytest.raises(ValueError, match="--max-waiting"):
                b.submit_all(reqs[:3])  # more than the queue holds: never
            b.submit(reqs[0])
            with pytest.raises(Overloaded):
                b.submit_all(reqs[1:3])  # one place left, two prompts: later
            assert b.stats()["waiting"] == 1
            b.submit_all(reqs[1:2])
            assert b.stats()["waiting"] == 2
            for r in reqs:
                r.cancel()
    finally:
        b.close()


def test_a_seeded_sample_does_not_depend_on_n(batcher, tiny_tokenizer):
    # (one generator per request was shared by its rows: sample 0 of n=3 differed from the n=1 sample of the
    # same seed; vLLM seeds sample k of a request with seed + k)
    p = tiny_tokenizer(PROMPTS[0])["input_ids"]
    got = {}
    for n in (1, 3):
        s = Sink(n)
        batcher.submit(Request(p, SamplingParams(n=n, temperature=1.0, max_new_tokens=8, ignore_eos=True), emit=s,
                               seed=11))
        assert s.done.wait(60)
        got[n] = [d.token_ids for d in s.finished()]
    assert got[3][0] == got[1][0]
    s = Sink(1)
    batcher.submit(Request(p, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True), emit=s, seed=12))
    assert s.done.wait(60)
    assert s.finished()[0].token_ids == got[3][1]  # sample 1 is the seed + 1 sample
    assert len(set(got[3])) == 3


def test_a_request_its_sampler_fails_on_fails_alone_and_the_loop_goes_on(batcher, tiny_tokenizer, monkeypatch):
    """A sampling failure (settings the sampler could not sample with: temperature=1e-300 and top_p=1e-300 gave
    NaN probabilities) stopped the batcher thread: the request beside it failed too, and every later one."""
    import relayrl.serving.batcher as batching

    real = batching.sample_next

    def flaky(logits, params, **kw):
        if params.temperature == 0.5:
            raise RuntimeError("index 3 is out of bounds")
        return real(logits, params, **kw)

    monkeypatch.setattr(batching, "sample_next", flaky)
    p = tiny_tokenizer(PROMPTS[1])["input_ids"]
    bad, good = Sink(2), Sink(1)
    with held(batcher):  # (both admitted in one step)
        batcher.submit(Request(p, SamplingParams(n=2, temperature=0.5, max_new_tokens=6), emit=bad))
        batcher.submit(Request(p, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True), emit=good))
    assert bad.done.wait(60) and good.done.wait(60)
    assert [d.finish_reason for d in bad.finished()] == ["error", "error"]
    assert all("sampling failed" in d.error and "index 3" in d.error for d in bad.finished())
    (done,) = good.finished()
    assert done.finish_reason == "length" and len(done.token_ids) == 6
    assert batcher.error is None
    later = Sink(1)
    batcher.submit(Request(p, SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True), emit=later))
    assert later.done.wait(60) and later.finished()[0].finish_reason == "length"
    import time

    deadline = time.monotonic() + 30  # (the rows leave the batch just after their last event)
    while batcher.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.stats()["running"] == 0 and not batcher._reqs  # the failed rows left nothing behind
