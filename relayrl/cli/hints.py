"""Did-you-mean lines for a command-line flag no relayrl command takes (``--stepz 3``, ``--debugg``): the
command's own flag it is close to, or, for a command that takes dotted overrides, the config key it may mean
(``--steps 3``: ``trainer.steps=3``). A peer framework's flag is named by ``relayrl.config.foreign_keys`` first;
these are for the rest. :func:`unknown_flags` finds them before argparse checks the command's required
arguments, so that ``relayrl eval --bogus`` names ``--bogus`` rather than the missing ``--model``."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

__all__ = ["command_flags", "config_leaves", "unknown_flag_hint", "unknown_hints", "unknown_flags", "refuse"]


def command_flags(parser: argparse.ArgumentParser, command: str | None) -> list[str]:
    """The long option strings of ``relayrl COMMAND`` (and the top-level ones)."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            flags += [s for a in action.choices[command]._actions for s in a.option_strings if s.startswith("--")]
    return sorted(set(flags))


def config_leaves(model: Any, prefix: str = "") -> list[str]:
    """Every dotted key of the pydantic config ``model`` that holds a value (sections walked, not listed)."""
    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += config_leaves(kind, f"{key}.")
        else:
            out.append(key)
    return out


def unknown_flag_hint(arg: str, value: str | None, flags: list[str], keys: list[str]) -> str | None:
    """The line for ``arg`` (``--name`` or ``--name=value``, ``value`` the next argument when it is one): the
    close flag among ``flags``, else the config keys among ``keys`` whose last part is ``name`` or close to it,
    written as the override (``trainer.steps=3``); None when nothing is close."""
    if not arg.startswith("--"):
        return None
    flag, eq, given = arg.partition("=")
    close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.75)
    if close:
        return f"{flag}: did you mean {close[0]}?"
    name = flag[2:].replace("-", "_")
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
        by_leaf.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    leaves = [name] if name in by_leaf else difflib.get_close_matches(name, list(by_leaf), n=1, cutoff=0.75)
    if not leaves:
        return None
    shown = given if eq else value
    said = [f"{k}={shown}" if shown is not None else k for k in by_leaf[leaves[0]][:3]]
    return f"{flag}: relayrl takes dotted overrides (section.key=value), not flags; did you mean {' or '.join(said)}?"


def unknown_hints(parser: argparse.ArgumentParser, command: str | None, overrides: bool, extra: list[str],
                  values: list[str | None]) -> list[str]:
    """The lines for the unknown arguments ``extra`` of ``relayrl COMMAND`` (``values``: each one's next
    argument when it is a value); config keys are offered only to a command that takes dotted ``overrides``."""
    from relayrl.config.schema import Config

    flags = command_flags(parser, command)
    keys = config_leaves(Config) if overrides else []
    return [h for a, v in zip(extra, values) if (h := unknown_flag_hint(a, v, flags, keys))]


def unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[str | None, bool, list[str], list[str | None]]:
    """The ``--flags`` of ``argv`` that neither ``relayrl`` nor its command takes (an abbreviation of one of its
    flags is taken, as argparse takes it; nothing after ``--`` is a flag): ``(command, whether it takes dotted
    overrides, the flags as written, each one's next argument when that is a value)``. Found before parsing:
    argparse reports a missing required argument first, and ``relayrl eval --bogus`` said "--model is
    required" of a command line whose mistake was ``--bogus``."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = next((t for t in argv if not t.startswith("-")), None)
    if sub is None or command not in sub.choices:
        return None, False, [], []  # (argparse names the bad command)
    overrides = any(a.dest == "overrides" for a in sub.choices[command]._actions)
    flags = command_flags(parser, command)
    unknown, values = [], []
    for i, t in enumerate(argv):
        if t == "--":
            break
        if not t.startswith("--"):
            continue
        flag = t.partition("=")[0]
        if any(f.startswith(flag) for f in flags):
            continue
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        unknown.append(t)
        values.append(nxt if nxt is not None and not nxt.startswith("-") and "=" not in nxt and "=" not in t else None)
    return command, overrides, unknown, values


def refuse(parser: argparse.ArgumentParser, command: str | None, overrides: bool, extra: list[str],
           values: list[str | None], *, with_values: bool = False) -> None:
    """argparse's usage error (exit 2) for the unknown arguments ``extra``, with a line per one we can place:
    a peer's flag's relayrl key (OpenRLHF's --n_samples_per_prompt 8: rollout.n=8), else the command's own flag
    it is close to, or the override it may mean. ``with_values``: the message shows each flag's value after it
    (``extra`` holds the flags alone: :func:`unknown_flags`)."""
    from relayrl.config.foreign_keys import flag_hint

    hints = [h for h in map(flag_hint, extra, values) if h]
    if not hints:
        hints = unknown_hints(parser, command, overrides, extra, values)
    said = [f"{a} {v}" if with_values and v is not None else a for a, v in zip(extra, values)]
    parser.error(f"unrecognized arguments: {' '.join(said)}" + "".join(f"\n  {h}" for h in hints))
