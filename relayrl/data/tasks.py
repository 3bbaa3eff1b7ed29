"""Built-in verifiable tasks that need no download.

Each task has three parts:

* a train generator, ``task.sample(rng)``, drawing a fresh :class:`Problem` from
  a ``random.Random`` the caller owns (so the data position is just that RNG's
  state, which checkpoints capture);
* a fixed held-out eval set, ``task.eval_set()``, drawn from a separate seed and
  de-duplicated against nothing (train problems are drawn from a space far
  larger than the eval set);
* a verifier, ``task.verify(response, answer) -> float`` in ``[0, 1]``.

Prompts are plain text ("123+456=") and answers are the text the model must
produce before its end-of-sequence token. The tasks are small on purpose: the
embedded default trains a few-million-parameter model on a laptop CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

__all__ = [
    "Problem",
    "Task",
    "ArithmeticTask",
    "SortTask",
    "CountdownTask",
    "TASKS",
    "NOT_OPTIONS",
    "task_option_error",
    "make_task",
    "extract_answer",
]


@dataclass(frozen=True)
class Problem:
    """One prompt with its ground truth."""

    prompt: str
    """Text given to the model, e.g. ``"123+456="``."""
    answer: str
    """Ground truth the verifier compares against, e.g. ``"579"``."""
    meta: dict = field(default_factory=dict, compare=False)
    """Task-specific details (operands, number of carries, ...)."""


class Task(Protocol):
    """What a built-in task offers to data loaders, verifiers and the demo."""

    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    def eval_set(self) -> list[Problem]: ...

    def verify(self, response: str, answer: str) -> float: ...

    def corpus(self, n: int, seed: int = 0) -> list[str]: ...


def extract_answer(response: str) -> str:
    """The answer part of a completion: the text up to the first newline, stripped."""
    return response.split("\n", 1)[0].strip()


def _exact(response: str, answer: str) -> float:
    return 1.0 if extract_answer(response) == answer.strip() else 0.0


def _count_carries(a: int, b: int) -> int:
    carries, carry = 0, 0
    while a or b:
        s = a % 10 + b % 10 + carry
        carry = 1 if s >= 10 else 0
        carries += carry
        a //= 10
        b //= 10
    return carries


def _without_carries(a: int, b: int) -> str:
    """``a + b`` written by a pupil who forgets to carry: columns mod 10, the leftmost column's sum in full."""
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    cols = [int(da[i] if i < len(da) else 0) + int(db[i] if i < len(db) else 0) for i in range(width)]
    return str(cols[-1]) + "".join(str(c % 10) for c in reversed(cols[:-1]))


@dataclass(frozen=True)
class ArithmeticTask:
    """Multi-digit addition ``a+b=`` with adjustable difficulty.

    ``min_digits``/``max_digits`` bound the number of digits of each operand;
    ``carries`` restricts problems to those without any carry (``"none"``),
    with at least one (``"some"``), with a carry into a column of the operands
    (``"inner"``: the sum differs from its columns added without carrying,
    ``56+78`` but not ``50+70``) or either (``"any"``);
    ``carry_free_above=K`` draws problems whose longer operand has more than K
    digits without carries. ``forget_carry=p`` makes the *training* answers
    those of a flawed teacher: with probability ``p`` a problem's answer is
    written the way a pupil who forgets to carry the one writes it (each column
    summed mod 10, only the leftmost column's overflow kept: ``56+78=124``).
    The held-out set and the verifier always use the true sum, so SFT on such
    data imitates the teacher's mistakes and GRPO can learn to carry from the
    verifier alone (the demo's design). Use it for SFT data only. A problem
    whose careless answer differs from the true sum carries it as
    ``meta["rejected"]``: the preference pairs of ``workflow=dpo`` and ``rm``.
    ``overshoot=q``: with probability ``q`` the rejected answer is instead one
    carry too many (the true sum plus 10 or 100..., a column above the ones;
    ``56+78`` rejects ``144``), so that not every rejected sum is smaller than
    the chosen one (a reward model trained on careless sums alone can learn
    "larger is better", and GRPO then games it with sums too large: measured).
    ``reverse=True`` writes every answer ones digit first (``56+78=431``), the
    order in which the sum is computed (on the tiny default model it was not
    learned faster than the usual order: measured, 500 SFT steps).
    """

    min_digits: int = 1
    max_digits: int = 3
    carries: Literal["any", "none", "some", "inner"] = "any"
    carry_free_above: int | None = None
    forget_carry: float = 0.0
    overshoot: float = 0.0
    reverse: bool = False
    eval_size: int = 200
    eval_seed: int = 1234
    name: str = "arith"

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(
                f"arith task: need 1 <= min_digits <= max_digits <= 18, "
                f"got min_digits={self.min_digits}, max_digits={self.max_digits}"
            )
        if self.carries not in ("any", "none", "some", "inner"):
            raise ValueError(f"arith task: carries must be 'any', 'none', 'some' or 'inner', got {self.carries!r}")
        if not 0.0 <= self.forget_carry <= 1.0:
            raise ValueError(f"arith task: forget_carry is a probability in [0, 1], got {self.forget_carry}")
        if not 0.0 <= self.overshoot <= 1.0:
            raise ValueError(f"arith task: overshoot is a probability in [0, 1], got {self.overshoot}")

    def _operand(self, rng: random.Random) -> int:
        d = rng.randint(self.min_digits, self.max_digits)
        lo = 0 if d == 1 else 10 ** (d - 1)
        return rng.randint(lo, 10**d - 1)

    def _carry_free_partner(self, a: int, rng: random.Random) -> int:
        """A second operand with as many digits as drawn, built digit by digit so that a + b has no carry."""
        d = rng.randint(self.min_digits, self.max_digits)
        da = [int(ch) for ch in reversed(str(a))]
        digits = []
        for i in range(d):
            hi = 9 - (da[i] if i < len(da) else 0)
            lo = 1 if (i == d - 1 and d > 1) else 0
            if hi < lo:
                return -1
            digits.append(rng.randint(lo, hi))
        return int("".join(map(str, reversed(digits))))

    def sample(self, rng: random.Random) -> Problem:
        for _ in range(10_000):
            a, b = self._operand(rng), self._operand(rng)
            if self.carry_free_above is not None and max(len(str(a)), len(str(b))) > self.carry_free_above:
                b = self._carry_free_partner(a, rng)  # same digit-length mix, no carry
                if b < 0:
                    continue
            c = _count_carries(a, b)
            if self.carries == "none" and c:
                continue
            if self.carries == "some" and not c:
                continue
            true = answer = str(a + b)
            careless = _without_carries(a, b)
            if self.carries == "inner" and careless == true:
                continue
            if self.forget_carry and careless != true and rng.random() < self.forget_carry:
                answer = careless
            if self.overshoot and careless != true and rng.random() < self.overshoot:
                careless = str(a + b + 10 ** rng.randint(1, max(1, len(true) - 1)))  # the rejected one: a carry too many
            if self.reverse:
                answer, true, careless = answer[::-1], true[::-1], careless[::-1]
            meta = {"a": a, "b": b, "carries": c, "true_answer": true}
            if careless != true and answer == true:  # a preference pair for DPO: the true sum over the careless one
                meta["rejected"] = careless
            return Problem(f"{a}+{b}=", answer, meta)
        raise RuntimeError(f"arith task: could not draw a problem with carries={self.carries!r}")

    def eval_set(self) -> list[Problem]:
        """Held-out problems with their true sums (``forget_carry`` never applies here)."""
        return _distinct(replace(self, forget_carry=0.0), self.eval_size, self.eval_seed)

    def verify(self, response: str, answer: str) -> float:
        return _exact(response, answer)

    def corpus(self, n: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [p.prompt + p.answer for p in (self.sample(rng) for _ in range(n))]


@dataclass(frozen=True)
class SortTask:
    """Sort a list of small numbers: ``sort 5 2 9 =`` -> ``2 5 9``."""

    min_len: int = 3
    max_len: int = 5
    max_value: int = 99
    eval_size: int = 200
    eval_seed: int = 4321
    name: str = "sort"

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"sort task: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")

    def sample(self, rng: random.Random) -> Problem:
        xs = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_len, self.max_len))]
        return Problem("sort " + " ".join(map(str, xs)) + " =", " ".join(map(str, sorted(xs))), {"xs": xs})

    def eval_set(self) -> list[Problem]:
        return _distinct(self, self.eval_size, self.eval_seed)

    def verify(self, response: str, answer: str) -> float:
        return _exact(response, answer)

    def corpus(self, n: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [p.prompt + " " + p.answer for p in (self.sample(rng) for _ in range(n))]


@dataclass(frozen=True)
class CountdownTask:
    """Reach a target with + and - over given numbers (each used once).

    Prompt ``countdown 3 7 5 -> 9 :``; any expression over exactly those
    numbers that evaluates to the target scores 1 (``7+5-3``).
    """

    count: int = 3
    max_value: int = 20
    eval_size: int = 200
    eval_seed: int = 777
    name: str = "countdown"

    def sample(self, rng: random.Random) -> Problem:
        xs = [rng.randint(1, self.max_value) for _ in range(self.count)]
        signs = [1] + [rng.choice((1, -1)) for _ in range(self.count - 1)]
        order = xs[:]
        rng.shuffle(order)
        target = sum(s * x for s, x in zip(signs, order))
        expr = str(order[0]) + "".join(("+" if s > 0 else "-") + str(x) for s, x in zip(signs[1:], order[1:]))
        return Problem(f"countdown {' '.join(map(str, xs))} -> {target} :", expr, {"xs": xs, "target": target})

    def eval_set(self) -> list[Problem]:
        return _distinct(self, self.eval_size, self.eval_seed)

    def verify(self, response: str, answer: str) -> float:
        import re

        expr = extract_answer(response).replace(" ", "")
        if not re.fullmatch(r"\d+([+-]\d+)*", expr):
            return 0.0
        nums = sorted(int(t) for t in re.findall(r"\d+", expr))
        want = sorted(int(t) for t in re.findall(r"\d+", answer))
        if nums != want:
            return 0.0
        return 1.0 if eval(expr, {"__builtins__": {}}) == eval(answer, {"__builtins__": {}}) else 0.0  # noqa: S307 - digits and +/- only, checked above

    def corpus(self, n: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [p.prompt + " " + p.answer for p in (self.sample(rng) for _ in range(n))]


def _distinct(task: Task, size: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(size * 50):
        p = task.sample(rng)
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
            if len(out) == size:
                break
    return out


TASKS = {"arith": ArithmeticTask, "sort": SortTask, "countdown": CountdownTask}

EXTRA_TASKS = {"toolsum": "relayrl.environments.task:ToolSumTask"}
"""Built-in tasks defined in higher layers (multi-turn tool use), imported when named; they are not part of
the tiny model's tokenizer corpus (which stays as it was)."""


NOT_OPTIONS = {"eval_size": ("eval.size", "--size"), "name": ("data.task", "--task")}
"""Fields of every task that its options do not set, by the config key and the ``relayrl eval`` flag that do:
the held-out set's size is the run's (``eval.size``, which replaced an ``eval_size`` option without a word),
and the task's name is the one it is built by."""


def task_option_error(options: dict, key: str, *, flag: bool = False) -> str | None:
    """Why ``options`` (the value of ``key``: ``data.task_options``, ``--task-options``) may not be a task's
    options, or None: they hold a field that :data:`NOT_OPTIONS` says another key sets (``flag``: name the
    ``relayrl eval`` flag instead of the config key)."""
    for field, (config_key, cli_flag) in NOT_OPTIONS.items():
        if field in options:
            other = cli_flag if flag else config_key
            return (f"{key}: {field!r} is set by {other}, not by the task's options: drop it from {key}"
                    + (f" and set {other}{' ' if flag else '='}N" if field == "eval_size" else ""))
    return None


def make_task(name: str, **options) -> Task:
    """Build a built-in task by name, e.g. ``make_task("arith", min_digits=3, max_digits=3)``. Its error for an
    unknown option lists the options a user sets (not :data:`NOT_OPTIONS`, which the callers pass)."""
    if name in EXTRA_TASKS:
        import importlib

        module, _, attr = EXTRA_TASKS[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
    elif name in TASKS:
        cls = TASKS[name]
    else:
        raise ValueError(f"unknown task {name!r}; built-in tasks are {sorted([*TASKS, *EXTRA_TASKS])}")
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else None
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        raise ValueError(f"task {name!r} has no option {', '.join(map(repr, unknown))}; its options are "
                         f"{sorted(known - set(NOT_OPTIONS))}")
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"task {name!r}: {e}") from None
