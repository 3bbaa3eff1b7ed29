"""The ``relayrl`` commands the README, the docs and the recipes' comments show are ones relayrl accepts: every
flag is one its parser knows, and the config a ``train``, ``plan`` or ``eval --recipe`` command builds from a
shipped recipe and its overrides validates. A renamed key or flag, a removed value or a recipe that changed under
a page fails here, not on a user's first try.

A command shown as typed at a prompt (``$ relayrl train ...``) is one the page shows failing (errors.md,
recipes.md, the README's error example), and ``relayrl plan: ...`` lines are output: both are left to the tests
of their messages (the quoted config errors: ``test_doc_errors.py``). A command may name files of the user's (``reward.user_fn=my_rewards.py:fn``,
``env.tools=[my_tools.py:lookup]``) that this repository does not have; the one config error accepted is that
such a file is missing. ``...`` (a part the page leaves out) and a trailing ``&`` are dropped.

Each ``python`` block on the pages compiles, and the names it imports from relayrl exist."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(r"^\s*relayrl (train|eval|plan|serve|plot|dock|demo)\b(?!:)")


def shown_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, arguments after ``relayrl``) of each command line in the page's fenced code blocks, its
    ``\\`` continuation lines joined, its ``# comment`` cut. A block with a ``$`` prompt in it is a session, its
    other lines output; a usage synopsis (``[--devices N]``) is not a command."""
    out = []
    for first, block in _fenced(text.splitlines()):
        if any(line.lstrip().startswith("$ ") for line in block):
            continue
        i = 0
        while i < len(block):
            if _COMMAND.search(block[i]):
                start, command = first + i, block[i]
                while command.rstrip().endswith("\\") and i + 1 < len(block):
                    i += 1
                    command = command.rstrip()[:-1] + " " + block[i]
                argv = [a for a in shlex.split(command, comments=True)[1:] if a not in ("...", "&")]
                if not any(a.startswith("[-") for a in argv):
                    out.append((start, argv))
            i += 1
    return out


def _fenced(lines: list[str], language: str | None = None) -> list[tuple[int, list[str]]]:
    """(line number of its first line, lines) of each fenced code block (only those opened with ``language``,
    e.g. ```` ```python ````, when given)."""
    blocks, current, opened = [], None, ""
    for n, line in enumerate(lines, start=1):
        if line.lstrip().startswith("```"):
            if current is None:
                current, opened = (n + 1, []), line.strip()[3:]
            else:
                if language is None or opened == language:
                    blocks.append(current)
                current = None
        elif current is not None:
            current[1].append(line)
    return blocks


def recipe_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, arguments after ``relayrl``) of each command a recipe's ``#`` comments show (``# relayrl
    train recipes/arith_grpo.yaml ...``), its ``\\`` continuation on the next comment line joined."""
    lines = [ln.lstrip()[1:] if ln.lstrip().startswith("#") else None for ln in text.splitlines()]
    return [(n, argv) for n, argv in shown_commands("```\n" + "\n".join(ln or "" for ln in lines) + "\n```")]


RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
CASES = [pytest.param(argv, id=f"{page.name}:{line}")
         for page in PAGES for line, argv in shown_commands(page.read_text())]
CASES += [pytest.param(argv, id=f"{recipe.name}:{line - 1}")  # (less the fence line the extraction added)
          for recipe in RECIPES for line, argv in recipe_commands(recipe.read_text())]


def _user_file_missing(message: str) -> bool:
    """Every problem the error lists is a user's file that is not in this repository."""
    problems = [ln for ln in message.splitlines()[1:] if ln.strip()]
    return bool(problems) and all(": no file " in ln for ln in problems)


def _recipe(args) -> str | None:
    """The shipped recipe a command's config starts from (None: a run's own config.json, or no config)."""
    recipe = args.recipe if args.command in ("train", "plan", "eval") else None
    if recipe is None or recipe.startswith("runs/") or recipe.isupper():  # (RECIPE: a placeholder)
        return None
    return recipe


def test_the_pages_show_commands():
    # (the extraction itself: a change of the pages' format that finds nothing would pass every case below)
    assert len(CASES) >= 70
    pages = {c.id.split(":")[0] for c in CASES}
    assert pages >= {"README.md", "quickstart.md", "algorithms.md", "migrating.md", "planner.md", "serving.md",
                     "arith_grpo.yaml", "gpu_grpo.yaml", "toolsum_grpo.yaml"}  # (a recipe's comments too)
    commands = {c.values[0][0] for c in CASES}
    assert commands >= {"train", "eval", "plan", "serve", "plot"}


@pytest.mark.parametrize("argv", CASES)
def test_a_documented_command_parses_and_its_config_validates(argv, monkeypatch):
    from relayrl.config.loader import ConfigError, load_run_config

    from relayrl.cli.main import parse_args

    monkeypatch.chdir(ROOT)  # (the pages' recipe paths are relative to the repository)
    try:
        args = parse_args(argv)
    except SystemExit:
        pytest.fail(f"relayrl {' '.join(argv)}: the CLI refuses its arguments")
    recipe = _recipe(args)
    if recipe is None:
        return
    try:
        load_run_config(recipe, args.overrides)
    except ConfigError as e:
        if not _user_file_missing(str(e)):
            raise


def test_a_stale_key_or_flag_in_a_shown_command_fails():
    from relayrl.cli.main import parse_args
    from relayrl.config.loader import ConfigError, load_run_config

    page = ("```bash\nrelayrl train recipes/arith_grpo.yaml \\\n  trainer.step=3   # a typo\n"
            "relayrl plan: PREDICTED for ...\nrelayrl eval --model m --task arith --samples 4\n"
            "relayrl plan --from-run R [--devices N]\n```\nrelayrl train x.yaml\n"
            "```\n$ relayrl train recipes/arith_grpo.yaml trainer.stepz=3\nrelayrl plan --from-run R: output\n```\n")
    (_, train), (_, evaluate) = shown_commands(page)
    assert train == ["train", "recipes/arith_grpo.yaml", "trainer.step=3"]
    with pytest.raises(ConfigError, match="trainer.step: unknown key"):
        load_run_config(str(ROOT / train[1]), parse_args(train).overrides)
    with pytest.raises(SystemExit):
        parse_args(evaluate)
    assert not _user_file_missing("invalid config:\n  trainer.step: unknown key; did you mean trainer.steps?")


PYTHON = [pytest.param(textwrap.dedent("\n".join(block)), id=f"{page.name}:{first}")
          for page in PAGES for first, block in _fenced(page.read_text().splitlines(), "python")]


@pytest.mark.parametrize("source", PYTHON)
def test_a_documented_python_example_compiles_and_its_relayrl_imports_resolve(source):
    import ast
    import importlib

    tree = ast.parse(source)  # (a SyntaxError names the line)
    imports = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("relayrl") for alias in node.names]
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"from {module} import {name}: no such name"


def test_the_pages_show_python_examples():
    assert len(PYTHON) >= 10 and any("from relayrl" in c.values[0] for c in PYTHON)
