"""The config errors the pages quote are the ones relayrl prints, and so are the "is unused" start-up lines they
quote (at the end). A session on a page (``$ relayrl train RECIPE OVERRIDES`` and the ``relayrl: error: invalid
config:`` lines after it) is replayed through ``load_run_config``,
and the message must be the page's, as words (the pages wrap long lines). A reworded check, or a rule that no
longer fires, fails here instead of leaving a page that quotes a message nobody sees.

Left out: sessions whose message depends on the machine (``this machine has``: its core count) or that name a
user's file this repository does not have (``my_envs.py:Sandboxed``: the error would be that the file is
missing). The other errors on the pages (data, run directory, model, reward function at run time) have their
tests in ``tests/cli`` and ``tests/workflows`` (docs/errors.md names them)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from test_doc_commands import PAGES, ROOT, _fenced

_START = "relayrl: error: invalid config:"


def config_sessions(text: str) -> list[tuple[int, list[str], str]]:
    """(line number, arguments after ``relayrl train``, the message as the page prints it) of each ``$ relayrl
    train`` session in a fenced block whose output is a config error: the lines after the command (its ``\\``
    continuation lines joined, its ``# comment`` cut) up to the next ``$`` line or a blank one."""
    out = []
    for first, block in _fenced(text.splitlines()):
        i = 0
        while i < len(block):
            line = block[i].strip()
            if not line.startswith("$ relayrl train "):
                i += 1
                continue
            start, command = first + i, line[2:]
            while command.rstrip().endswith("\\") and i + 1 < len(block):
                i += 1
                command = command.rstrip()[:-1] + " " + block[i]
            i += 1
            message = []
            while i < len(block) and block[i].strip() and not block[i].lstrip().startswith("$ "):
                message.append(block[i].strip())
                i += 1
            if message and message[0] == _START:
                out.append((start, shlex.split(command, comments=True)[2:], " ".join(message)))
    return out


def _replayable(argv: list[str], message: str) -> bool:
    if "this machine has" in message:  # (the core count of the machine the page was written on)
        return False
    files = [a.split("=", 1)[1].split(":")[0] for a in argv[1:] if ".py:" in a]
    return all((ROOT / f).is_file() for f in files)


SESSIONS = [pytest.param(argv, message, id=f"{page.name}:{line}")
            for page in PAGES for line, argv, message in config_sessions(page.read_text())
            if _replayable(argv, message)]


def test_the_pages_quote_config_errors():
    # (the extraction itself: a change of the pages' format that finds nothing would pass every case below)
    assert len(SESSIONS) >= 6
    assert {c.id.split(":")[0] for c in SESSIONS} >= {"errors.md", "recipes.md", "README.md"}


@pytest.mark.parametrize("argv,message", SESSIONS)
def test_a_quoted_config_error_is_the_one_relayrl_prints(argv, message, monkeypatch):
    from relayrl.config.loader import ConfigError, load_run_config

    monkeypatch.chdir(ROOT)  # (the pages' recipe paths are relative to the repository)
    with pytest.raises(ConfigError) as e:
        load_run_config(argv[0], argv[1:])
    printed = " ".join(f"relayrl: error: {e.value}".split())
    assert printed == " ".join(message.split()), f"the page quotes:\n{message}\nrelayrl prints:\n{printed}"


def test_a_reworded_message_fails():
    page = ("```\n$ relayrl train recipes/arith_grpo.yaml trainer.stepz=3   # a typo\n" + _START + "\n"
            "  trainer.stepz: unknown key; did you mean trainer.stops?\n\n$ relayrl train x.yaml\nrelayrl: error: "
            "data/train.jsonl: 3 bad rows\n```\n")
    [(line, argv, message)] = config_sessions(page)
    assert (line, argv) == (2, ["recipes/arith_grpo.yaml", "trainer.stepz=3"])
    with pytest.raises(AssertionError, match="the page quotes"):
        test_a_quoted_config_error_is_the_one_relayrl_prints(argv, message, pytest.MonkeyPatch())


# The start-up lines the pages quote for an option that a feature turned off leaves unread (not refused:
# ``AlgorithmConfig.idle_options``), e.g. `relayrl: algorithm.overlong_cache=2 is unused: ...` in algorithms.md.
_UNUSED = re.compile(r"`relayrl: (algorithm\.[\w.]+=[^\s`]+) is unused:\s+([^`]+)`")


def unused_quotes(text: str) -> list[tuple[str, str]]:
    """(the override, the line as the page prints it) of each quoted "is unused" start-up line (a quote may
    wrap across the page's lines)."""
    return [(m.group(1), f"relayrl: {m.group(1)} is unused: {' '.join(m.group(2).split())}")
            for m in _UNUSED.finditer(text)]


UNUSED = [pytest.param(over, line, id=f"{page.name}:{over}")
          for page in PAGES for over, line in unused_quotes(page.read_text())]


def test_the_pages_quote_an_unused_option_line():
    assert UNUSED  # (the extraction: algorithms.md quotes algorithm.overlong_cache=2's)


@pytest.mark.parametrize("override,line", UNUSED)
def test_a_quoted_unused_option_line_is_the_one_the_run_prints(override, line, monkeypatch):
    from relayrl.config.loader import load_run_config
    from relayrl.config.plan import step_plan

    monkeypatch.chdir(ROOT)
    printed = [f"relayrl: {n}" for n in step_plan(load_run_config("recipes/arith_grpo.yaml", [override])).notes]
    assert line in printed, f"the page quotes:\n{line}\nthe run prints:\n" + "\n".join(printed)


def test_a_reworded_unused_line_fails():
    [(over, line)] = unused_quotes("e.g. `relayrl: algorithm.overlong_cache=2 is unused:\nit shapes the penalty`.")
    assert (over, line) == ("algorithm.overlong_cache=2", "relayrl: algorithm.overlong_cache=2 is unused: it shapes "
                                                          "the penalty")
    with pytest.raises(AssertionError, match="the page quotes"):
        test_a_quoted_unused_option_line_is_the_one_the_run_prints(over, line, pytest.MonkeyPatch())
