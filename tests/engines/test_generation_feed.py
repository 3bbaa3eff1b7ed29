"""The feed helpers every engine's ``generate`` shares (relayrl.engines.generation.base): a fixed prompt list as a
PromptFeed, the completions gathered back in (prompt, sample) order, and the empty-prompt refusal."""

import pytest
import torch

from relayrl.engines.generation.base import Completion, ListFeed, SamplingParams, check_prompts, generate_from_feed


def _completion(prompt: int, sample: int) -> Completion:
    return Completion(prompt, sample, torch.tensor([prompt, sample]), torch.zeros(2), "stop")


def test_list_feed_hands_over_each_prompt_once_in_order_with_the_budget():
    feed = ListFeed([[1], [2, 3], [4]], 7)
    got = []
    while feed.wait():
        got.append(feed.take())
    assert got == [(0, [1], 7), (1, [2, 3], 7), (2, [4], 7)]
    assert feed.take() is None and not feed.wait()


def test_generate_from_feed_returns_prompt_sample_order_and_streams_each_completion():
    seen_feed, streamed = [], []

    def generate_feed(feed, params, generator, on_finish, between):
        # an engine finishes rows in any order: here the last sample of the last prompt first
        while (row := feed.take()) is not None:
            seen_feed.append(row)
        for key, _, _ in reversed(seen_feed):
            for s in reversed(range(params.n)):
                on_finish(_completion(key, s))
        assert generator is gen and between is stop

    gen, stop = torch.Generator(), (lambda: False)
    params = SamplingParams(n=2, max_new_tokens=5)
    out = generate_from_feed(generate_feed, [[9], [8, 7]], params, gen, streamed.append, stop)
    assert seen_feed == [(0, [9], 5), (1, [8, 7], 5)]
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(c.prompt_index, c.sample_index) for c in streamed] == [(1, 1), (1, 0), (0, 1), (0, 0)]


def test_an_empty_prompt_is_refused_by_its_index_before_the_engine_runs():
    def generate_feed(*_):
        raise AssertionError("the engine ran")

    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_from_feed(generate_feed, [[1], []], SamplingParams())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        check_prompts([[]])
    check_prompts([[1], [2]])
