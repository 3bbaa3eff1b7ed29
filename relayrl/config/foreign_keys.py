"""Other frameworks' config keys and names, and relayrl's for them: the hints an unknown key, flag or value gets.

A user's first command carries the keys of the framework they come from: verl's dotted keys
(``data.train_batch_size``), NeMo-RL's YAML sections (``grpo.num_generations_per_prompt``), OpenRLHF's flat
command-line flags (``--n_samples_per_prompt 8``), TRL's flat dataclass fields, alone or under a relayrl section
(``num_generations=8``, ``dpo.loss_type=ipo``). Each is refused like any unknown key, and the message names
relayrl's key for it from that framework's table (:mod:`relayrl.config.verl_keys`,
:mod:`relayrl.config.nemo_rl_keys`, :mod:`relayrl.config.openrlhf_keys`, :mod:`relayrl.config.trl_keys`: the
one-to-one rows of
docs/migrating.md's tables; a test checks every key they name exists). Only hints: nothing here renames a key,
so a recipe says what it means in relayrl's own terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any, Mapping

__all__ = ["Framework", "frameworks", "key_hint", "key_lines", "advantage_hint", "flag_hint", "leaf_keys"]


@dataclass(frozen=True)
class Framework:
    """One framework's table of keys and names."""

    name: str
    """How messages name it (``"verl"``, ``"NeMo-RL"``, ``"OpenRLHF"``, ``"TRL"``)."""
    keys: Mapping[str, str]
    """Its key (dotted, or a flag's name without ``--``) -> relayrl's key or keys, a note after `` (``."""
    sections: frozenset[str] = field(default_factory=frozenset)
    """Its top-level sections that relayrl has no section of that name for: every key under one is its."""
    advantages: Mapping[str, str] = field(default_factory=dict)
    """Its advantage-estimator names that relayrl spells otherwise -> relayrl's ``algorithm.advantage``."""
    flags: bool = False
    """Its keys are command-line flags (``--n_samples_per_prompt 8``), not dotted keys."""
    same_values: frozenset[str] = field(default_factory=frozenset)
    """Its keys whose value is the value of relayrl's key unchanged: a hint names the override with it."""
    flat: bool = False
    """Its keys are flat names (TRL's dataclass fields), written alone or under one of relayrl's sections: an
    unknown dotted key's last part is looked up too (``trainer.sync_ref_model``) when no table has the key whole."""


@cache
def frameworks() -> tuple[Framework, ...]:
    """Every framework with a table (imported on first use: only an unknown key needs them)."""
    from relayrl.config import nemo_rl_keys, openrlhf_keys, trl_keys, verl_keys

    return (Framework("verl", verl_keys.VERL_KEYS, verl_keys.VERL_SECTIONS, verl_keys.VERL_ADVANTAGES),
            Framework("NeMo-RL", nemo_rl_keys.NEMO_RL_KEYS, nemo_rl_keys.NEMO_RL_SECTIONS),
            Framework("OpenRLHF", openrlhf_keys.OPENRLHF_KEYS, advantages=openrlhf_keys.OPENRLHF_ADVANTAGES,
                      flags=True, same_values=openrlhf_keys.OPENRLHF_SAME_VALUES),
            Framework("TRL", trl_keys.TRL_KEYS, same_values=trl_keys.TRL_SAME_VALUES, flat=True))


def _matches(key: str) -> list[tuple[Framework, str]]:
    """The frameworks whose table holds ``key``, each with its name for it: the key whole, or else (a flat
    framework's name under one of relayrl's sections: ``dpo.loss_type``) its last part. Not the last part of a
    key under another framework's section (``actor_rollout_ref.actor.weight_decay`` is verl's, not TRL's)."""
    whole = [(fw, key) for fw in frameworks() if key in fw.keys]
    if whole or any(key.split(".", 1)[0] in fw.sections for fw in frameworks()):
        return whole
    last = key.rsplit(".", 1)[-1]
    return [(fw, last) for fw in frameworks() if fw.flat and last in fw.keys]


def leaf_keys(prefix: str, value: Any) -> list[str]:
    """The dotted keys of ``value``'s leaves under ``prefix`` (``value`` itself when not a mapping)."""
    if not isinstance(value, Mapping) or not value:
        return [prefix]
    return [k for name, v in value.items() for k in leaf_keys(f"{prefix}.{name}", v)]


def _say(fw: Framework, key: str, value: Any = None, flag: bool = False) -> str:
    """``"verl's KEY is RELAYRL here"`` (``flag``: the key was given as a command-line flag, ``--KEY``)."""
    ours, _, note = fw.keys[key].partition(" (")
    shown = f"--{key}" if fw.flags or flag else key
    if value is not None and key in fw.same_values and not isinstance(value, Mapping):
        value = str(value).lower() if isinstance(value, bool) else value
        # (an estimator relayrl spells otherwise: relayrl's name)
        mine = fw.advantages.get(str(value), value) if ours == "algorithm.advantage" else value
        return f"{fw.name}'s {shown} {value} is {ours}={mine} here{f' ({note}' if note else ''}"
    return f"{fw.name}'s {shown} is {ours} here{f' ({note}' if note else ''}"


def key_hint(key: str, value: Any = None) -> str | None:
    """``"verl's KEY is RELAYRL here (docs/migrating.md)"`` for a key in a framework's table, else None (two
    frameworks that share the key: both, joined by ``;``). With the ``value`` given to it, a key whose value
    carries over unchanged (``n_samples_per_prompt=8``) is named with it: ``rollout.n=8``."""
    said = [_say(fw, name, value) for fw, name in _matches(key)]
    return f"{'; '.join(said)} (docs/migrating.md)" if said else None


def key_lines(key: str, value: Any) -> list[str]:
    """For an unknown ``key`` holding another framework's keys (``data.train_batch_size``, a ``grpo`` section
    with its ``num_generations_per_prompt``): a line per leaf key naming relayrl's; ``[]`` when none is known."""
    leaves = leaf_keys(key, value)
    hints = [key_hint(k, value if k == key else None) for k in leaves]  # (a scalar's value; a section's: no)
    owners = [fw.name for fw in frameworks() if key.split(".", 1)[0] in fw.sections]
    if not any(hints) and not owners:
        return []
    owner = owners[0] if owners else next(fw.name for k in leaves for fw, _ in _matches(k))
    other = f"no key of that name here; docs/migrating.md maps {owner}'s keys"
    return [f"{k}: unknown key; {h or other}" for k, h in zip(leaves, hints)]


def advantage_hint(name: str) -> str:
    """``"; verl's reinforce_plus_plus is algorithm.advantage=reinforce++"`` for an estimator name another
    framework spells otherwise, else ``""``."""
    said = [f"{fw.name}'s {name} is algorithm.advantage={fw.advantages[name]}"
            for fw in frameworks() if name in fw.advantages]
    return f"; {'; '.join(said)}" if said else ""


def flag_hint(arg: str, value: str | None = None) -> str | None:
    """For a command-line argument ``--name`` or ``--name=value`` that is a framework's flag: the line naming
    relayrl's key (dotted overrides are ``section.key=value``), and the override itself where the flag's value
    carries over (``--n_samples_per_prompt 8``, its ``value`` the next argument: ``rollout.n=8``); else None."""
    if not arg.startswith("--"):
        return None
    name, eq, given = arg[2:].partition("=")
    name = name.replace("-", "_")
    value = given if eq else value
    said = [_say(fw, name, value, flag=True) for fw in frameworks() if (fw.flags or fw.flat) and name in fw.keys]
    # (TRL's fields are its CLI's flags too: trl grpo --learning_rate 1e-6)
    if not said and "." in name and value is not None:  # (a dotted override written as a flag: --trainer.steps=3)
        return f"{arg.split('=', 1)[0]}: relayrl takes dotted overrides without dashes: {arg[2:].partition('=')[0]}" \
               f"={value}"
    if not said:
        return None
    return f"{arg.split('=', 1)[0]}: relayrl takes dotted overrides (section.key=value), not flags; {'; '.join(said)}" \
           " (docs/migrating.md)"
