"""Row-wise verifiers: exact match, answer extraction, math equivalence (math-verify), format."""

import re
import threading

import pytest

from relayrl.engines.reward import exact_reward, extract_boxed, extract_last_number, format_reward, math_reward
from relayrl.engines.reward.verifiers import MathVerifyError


def test_exact_reward_strips_whitespace_only():
    assert exact_reward("  42\n", "42") == 1.0
    assert exact_reward("42.0", "42") == 0.0
    assert exact_reward("4 2", "42") == 0.0


@pytest.mark.parametrize(
    "text, want",
    [
        (r"so \boxed{12}", "12"),
        (r"\boxed{\frac{1}{2}} then", r"\frac{1}{2}"),
        (r"first \boxed{1} later \boxed{2}", "2"),
        (r"nested \boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),
        (r"unclosed \boxed{\frac{1}{2}", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize(
    "text, want",
    [("a 3 then -12", "-12"), ("cost 1,000 dollars", "1000"), ("pi is 3.14.", "3.14"), ("ratio 3/4", "3/4"), ("none", None)],
)
def test_extract_last_number(text, want):
    assert extract_last_number(text) == want


@pytest.mark.parametrize(
    "answer, response, want",
    [
        (r"\frac{1}{2}", r"The answer is \boxed{0.5}", 1.0),
        ("0.5", r"so we get \boxed{\frac{1}{2}}", 1.0),
        (r"\frac{1}{2}", "after simplifying, 1/2", 1.0),  # last number, as a fraction
        ("3", "1+2 = 3", 1.0),
        ("3", "1+2 = 3.0", 1.0),
        (r"\sqrt{2}", r"\boxed{\sqrt 2}", 1.0),
        ("x+1", r"\boxed{1+x}", 1.0),
        (r"\boxed{7}", r"\boxed{7}", 1.0),  # a boxed ground truth is unwrapped too
        ("7", r"\boxed{7}, checked against 8", 1.0),  # the box wins over a later number
        ("4", "1+2 = 3", 0.0),
        ("2", r"\boxed{3}", 0.0),
        (r"\frac{1}{3}", r"\boxed{0.5}", 0.0),
        ("10", "I do not know", 0.0),  # nothing to extract: a wrong answer, not an error
        ("10", r"\boxed{}", 0.0),
        # an escaped dollar is a dollar sign, not a math delimiter (it left the text unwrapped: a boxed \$18 scored
        # 0 against 18, and MATH's money answers could not be parsed at all)
        ("18", r"\boxed{\$18}", 1.0),
        (r"\$77", "77", 1.0),
        (r"so the answer is $\boxed{\$18.90}$.", r"\boxed{18.90}", 1.0),
        (r"so the answer is $\boxed{\$18.90}$.", "The answer is 18.90", 1.0),
        (r"\$18.90", r"\boxed{\$19}", 0.0),
        (r"$\frac{1}{2}$", r"\boxed{0.5}", 1.0),  # an unescaped delimiter still counts as one
    ],
)
def test_math_reward_cases(answer, response, want):
    assert math_reward(response, answer) == want


def test_math_reward_unparseable_gold_and_overlong_answers_raise():
    with pytest.raises(MathVerifyError, match="ground truth"):
        math_reward(r"\boxed{1}", "")
    with pytest.raises(MathVerifyError, match="math_max_chars=10"):
        math_reward(r"\boxed{" + "1+" * 20 + "1}", "41", max_chars=10)


def test_math_reward_in_a_worker_thread_matches_main_thread():
    """math-verify's SIGALRM timeout raises off the main thread; the verifier must switch it off there."""
    cases = [(r"\boxed{0.5}", r"\frac{1}{2}"), (r"\boxed{3}", "2"), ("it is 1/4", "0.25")]
    main = [math_reward(r, a) for r, a in cases]
    out: list = []
    t = threading.Thread(target=lambda: out.append([math_reward(r, a) for r, a in cases]))
    t.start()
    t.join()
    assert out == [main]
    assert main == [1.0, 0.0, 1.0]


def test_format_reward_searches_pattern():
    assert format_reward("123", re.compile(r"^\d+$")) == 1.0
    assert format_reward("12a", re.compile(r"^\d+$")) == 0.0
    assert format_reward(r"so \boxed{2} done", re.compile(r"\\boxed\{.+\}")) == 1.0
    assert format_reward("so 2 done", re.compile(r"\\boxed\{.+\}")) == 0.0


def test_math_timeout_becomes_a_counted_row_error(monkeypatch):
    """math-verify signals a timeout with a BaseException; it must become an ordinary row error scored 0."""
    import math_verify
    from math_verify.errors import TimeoutException

    from relayrl.engines.reward import RewardConfig, RewardEngine

    def slow_verify(*args, **kwargs):
        raise TimeoutException("Timeout during comparison")

    monkeypatch.setattr(math_verify, "verify", slow_verify)
    with pytest.raises(MathVerifyError, match="timed out after 5 s"):
        math_reward(r"\boxed{2}", "2")
    rewards, metrics = RewardEngine(RewardConfig(verifier="math")).score(["q", "q"], [r"\boxed{2}", "none"], ["2", "2"])
    assert rewards == [0.0, 0.0] and metrics["reward/errors"] == 1.0
