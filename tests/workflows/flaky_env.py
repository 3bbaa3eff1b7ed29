"""A multi-turn environment for the failure tests whose tool crashes on some prompts."""

from __future__ import annotations

from relayrl.environments.base import StepResult


def crashes_on(prompt: str) -> bool:
    """The prompts whose tool crashes: those whose characters sum to a multiple of 3 (about a third)."""
    return sum(map(ord, prompt)) % 3 == 0


class CrashingTool:
    """One turn: the answer scores by its length (rewards vary within a group), except that the tool behind
    it crashes on some prompts (a sandbox that dies, not a bad call by the model)."""

    def reset(self, problem) -> str:
        self.prompt = problem.prompt
        return ""

    def step(self, action: str) -> StepResult:
        if crashes_on(self.prompt):
            raise RuntimeError(f"sandbox crashed running the tool for {self.prompt!r}")
        return StepResult("", reward=float(len(action) % 3) / 2.0, done=True)
