"""``toolsum``: a built-in task the tiny model solves only with its calculator.

Sums of ``terms`` numbers of ``digits`` digits (``48213+99377=``) are far beyond what the tiny default
model can add (it takes hundreds of steps to learn 2-digit sums, demo stage 1); with the calculator the
task is copying: copy the expression into a tool call, copy the result into the answer::

    48213+99377=<tool>{"name": "calculator", "arguments": {"expression": "48213+99377"}}</tool>
    <result>147590</result>147590<|endoftext|>

(no newlines in the real text; the ``<result>`` tag is written by the environment). The verifier reads
only the final turn (its first line against the true sum), never the tool calls: GRPO gets the outcome.

The SFT stage imitates a teacher who reaches for the calculator in only ``tool_rate`` of its
demonstrations and writes the sum "in its head" otherwise (the true sum, which the tiny model cannot
learn to produce). After SFT the model calls the tool in about that fraction of its samples, and greedy
decoding, which follows the more likely start, mostly answers directly and wrongly; RL with the
verifier alone then has to discover that the calls pay (the analogue of the demo's careless teacher).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from relayrl.data.tasks import Problem, extract_answer
from relayrl.environments.tools import format_call

__all__ = ["ToolSumTask"]


@dataclass
class ToolSumTask:
    digits: int = 5
    terms: int = 2
    tool_rate: float = 1.0
    """Demonstrations only: the fraction that use the calculator (the others write the sum directly)."""
    tag: str = "tool"
    eval_size: int = 200
    eval_seed: int = 4321
    name: str = "toolsum"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 12 or not 2 <= self.terms <= 6:
            raise ValueError(f"toolsum task: need 1 <= digits <= 12 and 2 <= terms <= 6, got digits={self.digits}, "
                             f"terms={self.terms}")
        if not 0.0 <= self.tool_rate <= 1.0:
            raise ValueError(f"toolsum task: tool_rate is a fraction in [0, 1], got {self.tool_rate}")

    def sample(self, rng: random.Random) -> Problem:
        lo = 10 ** (self.digits - 1) if self.digits > 1 else 0
        xs = [rng.randint(lo, 10 ** self.digits - 1) for _ in range(self.terms)]
        expr = "+".join(map(str, xs))
        return Problem(f"{expr}=", str(sum(xs)), {"operands": xs, "expression": expr})

    def eval_set(self) -> list[Problem]:
        rng = random.Random(self.eval_seed)
        seen, out = set(), []
        while len(out) < self.eval_size:
            p = self.sample(rng)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        return out

    def verify(self, response: str, answer: str) -> float:
        """The final turn's first line against the true sum."""
        return 1.0 if extract_answer(response) == answer.strip() else 0.0

    def corpus(self, n: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return ["".join(t for t, _ in self.demonstration(self.sample(rng), rng, tool=True)) for _ in range(n)]

    def demonstration(self, problem: Problem, rng: random.Random, *, tool: bool | None = None) -> list[tuple[str, bool]]:
        """The teacher's episode as ``(text, written by the model)`` segments, after the prompt (the
        end-of-sequence token is the caller's). ``tool``: force the calculator on or off."""
        use = rng.random() < self.tool_rate if tool is None else tool
        if not use:
            return [(problem.answer, True)]
        call = format_call("calculator", {"expression": problem.meta["expression"]}, self.tag)
        return [(call, True), (f"<result>{problem.answer}</result>", False), (problem.answer, True)]
