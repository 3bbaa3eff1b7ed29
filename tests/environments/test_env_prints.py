"""A user environment's prints (its reset and step) stay off the trainer's console, as a tool's do
(:mod:`relayrl.environments.user_prints`)."""

from __future__ import annotations

import sys

from relayrl.data.tasks import Problem
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.environments.base import EpisodeEnd, StepResult
from relayrl.environments.episodes import EpisodeLimits, run_episodes
from relayrl.environments.tools import FunctionTool, ToolEnvironment, format_call

MB = 1 << 20


class LoudEnv:
    """Prints a megabyte in every step (both streams) and a line in reset; two turns, reward 1 at the end."""

    def reset(self, problem):
        self.t = 0
        print("reset: starting", problem.prompt)
        return ""

    def step(self, action):
        self.t += 1
        print("step debug\n" + "x" * MB)
        print("e" * MB, file=sys.stderr)
        return StepResult(f"<obs{self.t}>", reward=1.0 if self.t == 2 else 0.0, done=self.t == 2)


def test_an_environment_printing_a_megabyte_in_step_leaves_the_console_at_most_one_line(tiny_model, tiny_tokenizer,
                                                                                         capsys, caplog):
    """Six episodes of two steps, each printing 2 MB: the console gets at most one line, the log one warning
    for the class (not one per call), and the episodes are what the environment returned. (Every byte reached
    the trainer's console.)"""
    from relayrl.environments import user_prints

    user_prints._noted.discard(("environment", "LoudEnv"))
    engine = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=8)
    probs = [Problem(f"{i}+{i}=", str(2 * i)) for i in range(3)]
    prompts = [tiny_tokenizer(p.prompt)["input_ids"] for p in probs]
    with caplog.at_level("WARNING", logger="relayrl.environments.user_prints"):
        eps = run_episodes(engine, tiny_tokenizer, probs, prompts, LoudEnv, SamplingParams(n=2, max_new_tokens=3),
                           EpisodeLimits(max_turns=5, max_tokens=100))
    out, err = capsys.readouterr()
    assert len(out) + len(err) < 400 and (out + err).count("\n") <= 1, (out[:200], err[:200])
    assert all(e.end is EpisodeEnd.DONE and e.reward == 1.0 and e.turns == 2 for e in eps)
    notes = [r.getMessage() for r in caplog.records if "printed" in r.getMessage()]
    assert len(notes) == 1 and "'LoudEnv'" in notes[0], notes  # once per environment class per run
    assert "reset: starting" in notes[0] or "step debug" in notes[0], notes[0]  # (whichever call printed first)
    assert type(sys.stdout).__name__ != "_Router" and type(sys.stderr).__name__ != "_Router"  # put back


def _chatty(n: int) -> str:
    """A tool that prints (said of the tool, not of the environment that calls it)."""
    print("tool line " * n)
    return "7"


def test_a_tools_prints_inside_an_environment_step_are_said_of_the_tool(capsys, caplog):
    """A capture inside another (the tool's in the environment's step) keeps its own buffer: the tool's prints
    are said of the tool, and the environment that printed nothing itself is not named."""
    from relayrl.environments import user_prints
    from relayrl.environments.user_prints import captured_prints, note_env_prints

    user_prints._noted.discard(("tool", "_chatty"))
    user_prints._noted.discard(("environment", "ToolEnvironment"))
    env = ToolEnvironment({"_chatty": FunctionTool(_chatty)}, score=lambda p, t: 0.0)
    env.reset(Problem("q", "a"))
    with caplog.at_level("WARNING", logger="relayrl.environments.user_prints"):
        with captured_prints() as outer:  # (as the episode loop runs env.step)
            r = env.step(format_call("_chatty", {"n": 3}))
        note_env_prints("ToolEnvironment", "env.step", outer)
    assert r.observation == "<result>7</result>" and outer.chars == 0
    notes = [r.getMessage() for r in caplog.records if "printed" in r.getMessage()]
    assert len(notes) == 1 and "tool '_chatty'" in notes[0] and "tool line" in notes[0], notes
    out, err = capsys.readouterr()
    assert out == "" and err == ""
