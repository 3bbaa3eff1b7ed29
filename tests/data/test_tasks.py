"""Built-in tasks: difficulty options, the careless teacher, held-out sets that stay held out."""

import json
import random

import pytest

from relayrl.data.tasks import ArithmeticTask, _without_carries, make_task
from relayrl.workflows.session import PromptSource


def _draw(task, n=4000, seed=0):
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]


def test_sums_are_right_and_within_the_digit_bounds():
    for p in _draw(make_task("arith", min_digits=2, max_digits=3)):
        a, b = p.meta["a"], p.meta["b"]
        assert p.prompt == f"{a}+{b}=" and p.answer == str(a + b)
        assert 10 <= a <= 999 and 10 <= b <= 999


@pytest.mark.parametrize("a,b,careless", [(56, 78, "124"), (95, 7, "92"), (12, 34, "46"), (999, 1, "990"), (50, 70, "120")])
def test_sum_without_carrying(a, b, careless):
    assert _without_carries(a, b) == careless


def test_carry_filters():
    none = _draw(make_task("arith", min_digits=2, max_digits=2, carries="none"), 500)
    assert all(p.meta["carries"] == 0 for p in none)
    inner = _draw(make_task("arith", min_digits=2, max_digits=2, carries="inner"), 500)
    assert all(_without_carries(p.meta["a"], p.meta["b"]) != p.answer for p in inner)
    some = _draw(make_task("arith", min_digits=2, max_digits=2, carries="some"), 500)
    assert all(p.meta["carries"] > 0 for p in some)
    assert any(_without_carries(p.meta["a"], p.meta["b"]) == p.answer for p in some)  # 50+70: a carry, not inner


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_careless_teacher_rate_and_true_answers_elsewhere():
    task = make_task("arith", min_digits=2, max_digits=2, forget_carry=0.7)
    probs = _draw(task, 6000)
    inner = [p for p in probs if _without_carries(p.meta["a"], p.meta["b"]) != p.meta["true_answer"]]
    wrong = [p for p in inner if p.answer != p.meta["true_answer"]]
    assert 0.66 < len(wrong) / len(inner) < 0.74
    assert all(p.answer == _without_carries(p.meta["a"], p.meta["b"]) for p in wrong)
    assert all(p.answer == p.meta["true_answer"] for p in probs if p not in inner)
    # the held-out set and the verifier never use the teacher's answers
    assert all(p.answer == str(p.meta["a"] + p.meta["b"]) for p in task.eval_set())
    assert task.verify("134", "134") == 1.0 and task.verify("124", "134") == 0.0


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="forget_carry"):
        make_task("arith", forget_carry=1.5)
    with pytest.raises(ValueError, match="carries must be"):
        make_task("arith", carries="most")
    with pytest.raises(ValueError, match="unknown task"):
        make_task("algebra")


def test_training_prompts_skip_the_held_out_set():
    task = ArithmeticTask(min_digits=1, max_digits=1)  # 100 problems, so collisions would be certain
    held = {p.prompt for p in task.eval_set()[:40]}
    src = PromptSource(0, task=task, exclude=frozenset(held))
    drawn = src.take(2000)
    assert not held & {p.prompt for p in drawn}
    assert len({p.prompt for p in drawn}) == 100 - 40


def test_an_exhausted_problem_space_is_an_error_not_a_hang():
    task = ArithmeticTask(min_digits=1, max_digits=1)
    everything = frozenset(f"{a}+{b}=" for a in range(10) for b in range(10))
    with pytest.raises(RuntimeError, match="held-out"):
        PromptSource(0, task=task, exclude=everything).take(1)


def test_a_dataset_without_eval_file_holds_rows_out(tmp_path):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.session import Session

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(50)))
    cfg = load_config(Config, None, ["workflow=sft", "data.task=null", f"data.path={data}", "reward.verifier=exact",
                                     "eval.size=10", f"run.dir={tmp_path / 'run'}"])
    lines = []
    s = Session(cfg, log=lines.append)
    train = {p.prompt for p in s.prompts.problems}
    held = {p.prompt for p in s.eval_problems}
    assert len(held) == 10 and len(train) == 40 and not train & held
    assert any("holding out 10 of 50 rows" in line for line in lines)


def test_reversed_answers_ones_digit_first():
    task = make_task("arith", min_digits=2, max_digits=2, reverse=True, forget_carry=1.0)
    for p in _draw(task, 300):
        a, b = p.meta["a"], p.meta["b"]
        assert p.meta["true_answer"] == str(a + b)[::-1]
        assert p.answer == _without_carries(a, b)[::-1]
    assert all(p.answer == str(p.meta["a"] + p.meta["b"])[::-1] for p in task.eval_set())


def test_arith_preference_pairs_prefer_the_true_sum_to_the_careless_one():
    probs = _draw(make_task("arith", min_digits=2, max_digits=2, forget_carry=0.5), 2000)
    paired = [p for p in probs if "rejected" in p.meta]
    assert paired and all(p.answer == p.meta["true_answer"] != p.meta["rejected"] for p in paired)
    assert all(p.meta["rejected"] == _without_carries(p.meta["a"], p.meta["b"]) for p in paired)
    # no pair where the (careless) training answer would be its own rejected answer, or where there is no carry
    assert not [p for p in probs if "rejected" in p.meta and p.answer != p.meta["true_answer"]]
    assert not [p for p in _draw(make_task("arith", carries="none"), 500) if "rejected" in p.meta]
