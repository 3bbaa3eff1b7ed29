"""Row-wise rule verifiers: exact match, math equivalence (math-verify), format.

Each verifier maps one ``(response, answer)`` pair to a reward in ``[0, 1]`` and
may raise on inputs it cannot handle; the engine turns a raise into a zero
reward and counts it under ``reward/errors``.

Math answers follow the rule-based reward of DAPO / DeepSeek-R1: the
model's final answer is the content of its last ``\\boxed{...}``, or, when it
boxed nothing, the last number in the response; it is compared with the ground
truth for mathematical equivalence (``\\frac{1}{2}`` equals ``0.5``) by Hugging
Face's ``math-verify`` (sympy underneath).

Departure / caveat: math-verify enforces its timeouts with ``SIGALRM``, which
Python allows only on the main thread (math-verify raises ``ValueError`` off
it; see huggingface/Math-Verify#50 and #55). Here the timeout is used when the
verifier runs on the main thread and switched off (``None``) in worker threads;
there, runaway sympy work is bounded only by capping the extracted answer
length (``math_max_chars``), since a Python thread cannot be interrupted.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

__all__ = [
    "CORRECT",
    "exact_reward",
    "math_reward",
    "extract_boxed",
    "extract_last_number",
    "format_reward",
    "MathVerifyError",
]


CORRECT = 1.0
"""The score from which a row counts as correct (``train/accuracy``, ``eval/accuracy``, pass@k,
``reward/verifier_accuracy``): what the built-in verifiers give a right answer."""


class MathVerifyError(ValueError):
    """The math verifier could not judge a row (unparseable gold answer, over-long answer, timeout)."""


def exact_reward(response: str, answer: str) -> float:
    """1.0 when ``response`` equals ``answer`` after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None.

    An unclosed last box yields None (the model ran out of tokens mid-answer).
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (``-12``, ``3.5``, ``1,000``, ``3/4``), thousands separators removed, or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeout is off; here that is deliberate in worker threads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")
"""A math delimiter: ``$`` not escaped (``\\$`` is a dollar sign, MATH's money answers: ``\\boxed{\\$18.90}``),
``\\(`` or ``\\[``."""


def _as_latex(text: str) -> str:
    """Wrap bare LaTeX/number text in ``$...$`` so math-verify's LaTeX extractor sees it (text that has a
    delimiter of its own is left as it is)."""
    text = text.strip()
    if _MATH_DELIMITER.search(text):
        return text
    return f"${text}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(latex: str, timeout: int | None) -> tuple:
    """math-verify's parse of a ground truth, cached: a GRPO group repeats one answer for all its responses."""
    from math_verify import parse

    return tuple(parse(latex, parsing_timeout=timeout, raise_on_error=True))


def math_reward(response: str, answer: str, *, timeout_s: int = 5, max_chars: int = 2000) -> float:
    """1.0 when the response's final answer is mathematically equivalent to ``answer``, else 0.0.

    The final answer is the last ``\\boxed{}`` content, else the last number; a
    response with neither scores 0 (a wrong answer, not an error). Raises
    :class:`MathVerifyError` when the gold answer cannot be parsed or the answer is
    longer than ``max_chars``, and when math-verify's timeout (main thread only)
    fires.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    on_main = threading.current_thread() is threading.main_thread()
    timeout = timeout_s if on_main else None
    pred_text = extract_boxed(response)
    if pred_text is None:
        pred_text = extract_last_number(response)
    if pred_text is None or not pred_text.strip():
        return 0.0
    if len(pred_text) > max_chars or len(answer) > max_chars:
        raise MathVerifyError(f"answer longer than math_max_chars={max_chars} ({len(pred_text)} / {len(answer)} chars)")
    gold_text = extract_boxed(answer) or answer
    try:
        gold = list(_parse_gold(_as_latex(gold_text), timeout))
        if not gold:
            raise MathVerifyError(f"math-verify could not parse the ground truth {answer!r}")
        pred = parse(_as_latex(pred_text), parsing_timeout=timeout, raise_on_error=True)
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout, raise_on_error=True) else 0.0
    except TimeoutException:  # a BaseException in math-verify: turn it into an ordinary row error
        raise MathVerifyError(f"math-verify timed out after {timeout_s} s") from None


def format_reward(text: str, pattern: re.Pattern[str]) -> float:
    """1.0 when ``pattern`` is found in ``text`` (``re.search``), else 0.0."""
    return 1.0 if pattern.search(text) else 0.0
