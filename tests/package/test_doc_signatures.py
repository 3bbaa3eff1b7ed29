"""The calls docs/algorithms.md writes out name the functions' own arguments. Each `` `module.fn(a, b, key=...)` ``
of a ``relayrl.algorithms`` module on the page must resolve to a function (or class) there, every argument name
it shows, positional or keyword, must be a parameter of it (a keyword may also go to its ``**common``), and a
call written in full (no ``...``) must give every required parameter. A renamed argument, a removed function or
a required one the page leaves out (``solved_at`` of ``retire.pass_rates`` was) fails here instead of leaving a
page whose calls raise ``TypeError``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import relayrl.algorithms

PAGE = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"
MODULES = {m.name for m in pkgutil.iter_modules(relayrl.algorithms.__path__)}
_CALL = re.compile(r"`((\w+)\.(\w+)(?:\.(\w+))?)\(([^`]*)\)")
_NAME = re.compile(r"^(\w+)\s*(=.*)?$")


def page_calls(text: str) -> list[tuple[str, list[str | None], list[str], bool]]:
    """(dotted name, positional arguments, keyword argument names, whether the call is written in full) of each
    written-out call of a ``relayrl.algorithms`` module's function on the page. A positional literal
    (``"k2"``) is None: it holds its place, its name is not compared; ``...`` marks an excerpt."""
    out = []
    for m in _CALL.finditer(text):
        if m.group(2) not in MODULES:
            continue
        positional, keywords, full = [], [], True
        for arg in (a.strip() for a in _split(m.group(5))):
            name = _NAME.match(arg)
            if arg == "..." or arg.startswith("*"):
                full = False
            elif name and name.group(2) is not None:
                keywords.append(name.group(1))
            elif not keywords:
                positional.append(name.group(1) if name else None)
        out.append((m.group(1), positional, keywords, full))
    return out


def _split(args: str) -> list[str]:
    """``args`` split at its top-level commas (a default like ``(0.5, 2)`` stays whole)."""
    parts, depth, cur = [], 0, ""
    for ch in args:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur] if cur.strip() else parts


def _resolve(dotted: str):
    module, *attrs = dotted.split(".")
    obj = importlib.import_module(f"relayrl.algorithms.{module}")
    for a in attrs:
        obj = getattr(obj, a)
    return obj


CALLS = page_calls(PAGE.read_text())


def test_the_page_writes_out_calls():
    # (the extraction itself: a change of the page's format that finds nothing would pass every case below)
    assert len(CALLS) >= 40
    assert {c[0] for c in CALLS} >= {"advantages.gae", "losses.policy_loss", "retire.pass_rates", "kl.kl_loss"}


def problems(dotted: str, positional: list[str | None], keywords: list[str], full: bool) -> list[str]:
    """What is wrong with the page's call of ``dotted`` (nothing: [])."""
    params = list(inspect.signature(_resolve(dotted)).parameters.values())
    names = {p.name for p in params}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    out = [f"no parameter {n!r}" for n in positional if n is not None and n not in names]
    out += [f"no parameter {n!r}" for n in keywords if n not in names and not takes_kwargs]
    if full:
        given = {p.name for p in params[:len(positional)]} | set(keywords)
        out += [f"{p.name!r} is required and not given" for p in params
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given]
    return out


@pytest.mark.parametrize("dotted,positional,keywords,full", CALLS, ids=[f"{c[0]}:{i}" for i, c in enumerate(CALLS)])
def test_each_call_names_the_functions_own_arguments(dotted, positional, keywords, full):
    wrong = problems(dotted, positional, keywords, full)
    params = list(inspect.signature(_resolve(dotted)).parameters)
    assert not wrong, f"docs/algorithms.md writes {dotted}({positional} {keywords}): {wrong} (its parameters: {params})"


def test_a_wrong_name_and_a_missing_required_argument_are_caught():
    [call] = page_calls("`retire.pass_rates(scores, groupz)` -> `{group: pass rate}`")
    assert problems(*call) == ["no parameter 'groupz'", "'solved_at' is required and not given"]
    [call] = page_calls("`retire.pass_rates(scores, ...)`")  # (an excerpt: what it shows is checked, not arity)
    assert problems(*call) == []
    [call] = page_calls('`kl.kl_estimate(logprobs, ref_logprobs, "k2")`')  # (a literal holds its place)
    assert problems(*call) == []
    assert page_calls("`routing.Routing(model)`, `fsdp.mix_weights(model, named, alpha)`") == []  # (not here)
