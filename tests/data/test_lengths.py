"""The context check that ``relayrl train`` and ``relayrl eval`` share, and a run's prompt limit
(``data.max_prompt_tokens``, ``data.long_prompts``): ``relayrl.data.lengths``."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError
from relayrl.data.errors import DatasetError
from relayrl.data.lengths import PromptRoom, fit_prompts, over_limit
from relayrl.data.tasks import Problem


def _rows(*lengths: int) -> list[Problem]:
    return [Problem("x" * n, "1", {"row": i, "source": "d.jsonl"}) for i, n in enumerate(lengths, start=1)]


def _encode(p: Problem) -> list[int]:
    return [0] * len(p.prompt)


def _check(problems, budget: int, key: str, limit: int, model: str, drop: bool = False, log=print):
    """The context check of ``relayrl eval`` (its flag ``--long-prompts drop`` named in the messages)."""
    room = PromptRoom(budget=budget, key=key, limit=limit, model=model, drop="--long-prompts drop")
    return fit_prompts(problems, _encode, room, drop=drop, what="evaluation", log=log)


def test_a_budget_past_the_context_names_the_largest_that_fits():
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=600 new tokens cannot fit in the model's "
                       r"max_position_embeddings=512 \(m\) beside a prompt; give at most 482 \(the longest prompt"):
        _check(_rows(10, 30), 600, "rollout.max_new_tokens", 512, "m")


def test_every_prompt_too_long_is_counted_and_the_largest_budget_fits_all_the_others():
    with pytest.raises(DatasetError) as info:
        _check(_rows(10, 600, 400, 700), 200, "eval.max_new_tokens", 512, "m")
    assert str(info.value) == ("d.jsonl row 2: the prompt is 600 tokens and eval.max_new_tokens=200 more make 800, "
                               "beyond the model's max_position_embeddings=512 (m); shorten or drop the row, or set "
                               "--long-prompts drop to leave out every such row (2 more too long: rows 3, 4)")
    with pytest.raises(DatasetError, match=r"row 2: .* or lower k to at most 112, or set --long-prompts drop"):
        _check(_rows(10, 400), 200, "k", 512, "m")
    rows = _rows(10, 312)
    assert _check(rows, 200, "k", 512, "m") is rows  # exactly fits


def test_relayrl_evals_drop_leaves_out_the_long_rows_and_says_so():
    """Old behaviour: ``relayrl eval --data`` had no way to leave a too-long row out (the file had to be edited)."""
    said = []
    kept = _check(_rows(10, 600, 300, 700), 200, "k", 512, "m", drop=True, log=said.append)
    assert [p.meta["row"] for p in kept] == [1, 3]
    assert said == ["relayrl: --long-prompts drop: dropped 2 of 4 evaluation prompts too long for the model's "
                    "max_position_embeddings=512 beside k=200 (over 312 tokens)"]
    with pytest.raises(ConfigError, match=r"^--long-prompts drop would drop all 2 evaluation prompts"):
        _check(_rows(600, 700), 200, "k", 512, "m", drop=True)


def test_over_limit_takes_the_tighter_of_the_cap_and_the_room():
    lengths = [10, 600, 400, 700, 450]
    assert over_limit(lengths) == []  # no limit
    assert over_limit(lengths, max_tokens=500) == [1, 3]
    assert over_limit(lengths, room=400) == [1, 3, 4]  # 400 fits exactly
    assert over_limit(lengths, max_tokens=650, room=420) == [1, 3, 4]
    assert over_limit(lengths, max_tokens=420, room=650) == [1, 3, 4]
    assert over_limit(lengths, max_tokens=9) == [0, 1, 2, 3, 4]


def _never(p: Problem) -> list[int]:
    raise AssertionError("measured a prompt with no limit set")


def test_nothing_is_measured_without_a_limit():
    rows = _rows(10, 900)
    assert fit_prompts(rows, _never, PromptRoom(), drop=False, what="training", log=print) is rows
    # a set that is not generated from (budget None) has no context limit to meet
    assert fit_prompts(rows, _never, PromptRoom(key="k", limit=512, model="m"), drop=True, what="training",
                       log=print) is rows


def test_fail_names_the_first_row_its_length_the_limit_the_others_and_the_fix():
    room = PromptRoom(max_tokens=100, budget=16, key="rollout.max_new_tokens", limit=512, model="m")
    with pytest.raises(DatasetError) as info:
        fit_prompts(_rows(10, 150, 20, 600, 101), _encode, room, drop=False, what="training", log=print)
    assert str(info.value) == ("d.jsonl row 2: the prompt is 150 tokens, longer than data.max_prompt_tokens=100; "
                               "raise data.max_prompt_tokens, shorten or drop the row, or set data.long_prompts=drop "
                               "to leave out every such row (2 more too long: rows 4, 5)")
    # over the context only: the context's message, with the run's drop option
    room = PromptRoom(budget=200, key="rollout.max_new_tokens", limit=512, model="m")
    with pytest.raises(DatasetError, match=r"^d.jsonl row 2: the prompt is 400 tokens and rollout.max_new_tokens=200 "
                       r"more make 600, .*; shorten or drop the row, or lower rollout.max_new_tokens to at most 112, "
                       r"or set data.long_prompts=drop to leave out every such row$"):
        fit_prompts(_rows(10, 400), _encode, room, drop=False, what="training", log=print)


def test_drop_keeps_the_other_rows_with_their_numbers_and_says_how_many_went():
    lines: list[str] = []
    room = PromptRoom(max_tokens=100, budget=16, key="rollout.max_new_tokens", limit=512, model="m")
    kept = fit_prompts(_rows(10, 150, 100, 600, 5), _encode, room, drop=True, what="training", log=lines.append)
    assert [p.meta["row"] for p in kept] == [1, 3, 5]
    assert lines == ["relayrl: data.long_prompts=drop: dropped 2 of 5 training prompts longer than "
                     "data.max_prompt_tokens=100 tokens"]
    lines.clear()  # a cap above the context's room: the two reasons counted apart
    room = PromptRoom(max_tokens=550, budget=100, key="eval.max_new_tokens", limit=512, model="m")
    kept = fit_prompts(_rows(10, 600, 450, 412), _encode, room, drop=True, what="held-out", log=lines.append)
    assert [p.meta["row"] for p in kept] == [1, 4]
    assert lines == ["relayrl: data.long_prompts=drop: dropped 2 of 4 held-out prompts: 1 longer than "
                     "data.max_prompt_tokens=550 tokens, 1 too long for the model's max_position_embeddings=512 "
                     "beside eval.max_new_tokens=100 (over 412 tokens)"]


def test_drop_refuses_to_leave_no_row_and_a_budget_past_the_context():
    room = PromptRoom(max_tokens=8, budget=16, key="rollout.max_new_tokens", limit=512, model="m")
    with pytest.raises(ConfigError) as info:
        fit_prompts(_rows(10, 30), _encode, room, drop=True, what="training", log=print)
    assert str(info.value) == ("data.long_prompts=drop would drop all 2 training prompts (longer than "
                               "data.max_prompt_tokens=8 tokens; the shortest is 10 tokens): raise "
                               "data.max_prompt_tokens to at least 10")
    room = PromptRoom(budget=500, key="rollout.max_new_tokens", limit=512, model="m")
    with pytest.raises(ConfigError, match="the shortest is 20 tokens[)]: lower rollout.max_new_tokens to at most 492"):
        fit_prompts(_rows(20, 30), _encode, room, drop=True, what="training", log=print)
    room = PromptRoom(budget=600, key="rollout.max_new_tokens", limit=512, model="m")
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=600 new tokens cannot fit"):
        fit_prompts(_rows(20), _encode, room, drop=True, what="training", log=print)


@pytest.mark.parametrize("model_type, kwargs, limit", [
    ("qwen2", dict(max_position_embeddings=64), 64),
    ("gpt2", dict(n_positions=64), 64),  # GPT-2 keeps its context as n_positions (transformers' attribute_map)
    ("gemma3", dict(text_config=dict(max_position_embeddings=64)), 64),  # a multimodal model's text config
    ("bloom", {}, None),  # (ALiBi: no position limit in its config)
])
def test_the_context_is_read_where_each_config_keeps_it(tmp_path, model_type, kwargs, limit):
    """Read at max_position_embeddings alone, GPT-2's context and a multimodal model's were never checked: GPT-2 with
    a budget past its 1024 positions generated until it failed deep inside its position embedding (IndexError)."""
    from transformers import AutoConfig

    from relayrl.data.lengths import context_limit

    AutoConfig.for_model(model_type, **kwargs).save_pretrained(tmp_path)
    assert context_limit(tmp_path) == limit


def test_a_vllm_rollouts_max_model_len_is_the_context_the_prompts_must_fit(tmp_path, tiny_dir):
    """vLLM ends a request at rollout.vllm.max_model_len as 'length', before its budget: the prompt check measures
    against it where it is shorter than the model's context, and names it (it measured against
    max_position_embeddings, and the rows vLLM would cut went through)."""
    import json

    from relayrl.engines.generation.config import vllm_available
    from relayrl.workflows.problems import RunProblems

    if not vllm_available():
        pytest.skip("rollout.engine=vllm is validated against an install")
    from relayrl.config.loader import load_run_config

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": " ".join(["12+34"] * 12) + "=", "answer": "0"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = ["data.task=null", f"data.path={tmp_path / 'd.jsonl'}", f"data.eval_path={tmp_path / 'd.jsonl'}",
            f"trainer.init_from={tiny_dir}", "rollout.max_new_tokens=16", "model.device=cpu", "rollout.engine=vllm",
            "rollout.vllm.max_model_len=40", "reward.verifier=exact", "data.answer_key=answer"]
    with pytest.raises(DatasetError, match=r"d.jsonl row 2: the prompt is \d+ tokens and rollout.max_new_tokens=16 "
                                           r"more make \d+, beyond rollout.vllm.max_model_len=40"):
        RunProblems(load_run_config("recipes/arith_grpo.yaml", over), training=True, log=lambda _: None)
    lines: list[str] = []
    rp = RunProblems(load_run_config("recipes/arith_grpo.yaml", over + ["data.long_prompts=drop"]), training=True,
                     log=lines.append)
    assert [p.answer for p in rp.train_problems] == ["3"]
    assert any("too long for rollout.vllm.max_model_len=40 beside rollout.max_new_tokens=16" in x for x in lines)
