"""evaluate(): greedy accuracy, pass@k and avg@k on fixed completions, checked by hand."""

import json

import pytest
import torch

from relayrl.data.tasks import ArithmeticTask, Problem
from relayrl.engines.generation.base import Completion
from relayrl.evaluation.runner import evaluate, write_report

PROBLEMS = [Problem("1+1=", "2"), Problem("2+2=", "4"), Problem("3+3=", "6")]
GREEDY = ["2", "5", "6"]  # 2 of 3 right
SAMPLED = [["2", "2", "3", "2"], ["1", "4", "0", "9"], ["7", "7", "7", "7"]]  # 3/4, 1/4, 0/4 right


def fake_generate(prompts, params):
    texts = [[g] for g in GREEDY] if params.n == 1 else SAMPLED
    return [Completion(i, s, torch.tensor([0]), torch.tensor([0.0]), "stop", 0, texts[i][s])
            for i in range(len(prompts)) for s in range(params.n)]


def score(prompts, responses, answers, columns, extra):
    task = ArithmeticTask()
    return [task.verify(r, a) for r, a in zip(responses, answers)]


def test_greedy_pass_at_k_and_avg_at_k_by_hand(tmp_path):
    res = evaluate(fake_generate, lambda p: [1, 2], PROBLEMS, score, max_new_tokens=4, k=4)
    m = res.metrics
    assert m["eval/accuracy"] == pytest.approx(2 / 3)
    # pass@1 = mean fraction correct = (3/4 + 1/4 + 0) / 3
    assert m["eval/pass@1"] == pytest.approx(1 / 3)
    # pass@4 with n=4 samples: a prompt passes iff any sample is right -> 2 of 3
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/avg@4"] == pytest.approx(1 / 3)
    assert len(res.samples) == 3 + 12
    report, samples = write_report(res, tmp_path, extra={"model": "fake"})
    assert json.loads(report.read_text())["metrics"]["eval/accuracy"] == pytest.approx(2 / 3)
    first = json.loads(samples.read_text().splitlines()[1])
    assert first == {"mode": "greedy", "prompt": "2+2=", "answer": "4", "response": "5", "reward": 0.0,
                     "finish_reason": "stop"}


def test_no_problems_is_an_error():
    with pytest.raises(ValueError, match="no problems"):
        evaluate(fake_generate, lambda p: [1], [], score, max_new_tokens=4)
