"""docs/migrating.md maps TRL and verl options to relayrl keys: every relayrl key it names must exist.

The page's mapping tables have the relayrl key(s) in their second column (header ``relayrl``); every backticked
item in that column is ``section.key`` or ``section.key=value``, and a row with no equivalent says so in plain
words (no backticks). The keys of the worked ``relayrl train`` commands are checked too. The valid keys come
from the pydantic schema itself (``relayrl.config.schema.Config``, imported without torch)."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "migrating.md"


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``Optional[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _is_dict(annotation) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_dict(arg) for arg in typing.get_args(annotation))
    return annotation is dict or typing.get_origin(annotation) is dict


def config_keys(model: type[BaseModel] | None = None, prefix: str = "") -> tuple[set[str], set[str]]:
    """(leaf keys, dict-valued keys) of the config, dotted: nested models give ``section.key``; a dict-valued
    field (``placement.pools``) is a key itself and takes any sub-key."""
    if model is None:
        from relayrl.config.schema import Config

        model = Config
    leaves: set[str] = set()
    dicts: set[str] = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = _models(field.annotation)
        if nested:
            for sub in nested:
                sub_leaves, sub_dicts = config_keys(sub, f"{key}.")
                leaves |= sub_leaves
                dicts |= sub_dicts
            continue
        leaves.add(key)
        if _is_dict(field.annotation):
            dicts.add(key)
    return leaves, dicts


def is_config_key(key: str, keys: tuple[set[str], set[str]]) -> bool:
    leaves, dicts = keys
    return key in leaves or any(key.startswith(f"{d}.") for d in dicts)


def table_keys(text: str) -> list[tuple[int, str]]:
    """(line number, item) for every backticked item in the relayrl column of the page's mapping tables."""
    found = []
    in_table = False
    for i, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_table:
            in_table = len(cells) >= 2 and cells[1].lower() == "relayrl"
            continue
        if set(line) <= set("|-: "):
            continue  # the header's separator row
        found += [(i, item) for item in re.findall(r"`([^`]+)`", cells[1])]
    return found


def command_keys(text: str) -> list[tuple[int, str]]:
    """(line number, dotted key) of every key=value of the page's ``relayrl train`` commands."""
    found = []
    in_command = False
    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("relayrl train "):
            in_command = True
        if in_command:
            for token in stripped.split():
                token = token.strip("'\"")
                m = re.match(r"([a-z_]+(?:\.[a-z_0-9]+)+)=", token)
                if m:
                    found.append((i, m.group(1)))
            in_command = stripped.endswith("\\")
    return found


def _bad(items: list[tuple[int, str]], keys) -> list[str]:
    bad = []
    for line, item in items:
        key = item.split("=", 1)[0]
        if not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key) or not is_config_key(key, keys):
            bad.append(f"docs/migrating.md:{line}: `{item}`")
    return bad


def test_the_schema_walk_sees_nested_and_dict_keys():
    keys = config_keys()
    for key in ("rollout.n", "model.lora.r", "engine.optim.lr", "algorithm.correction.high",
                "rollout.vllm.memory_utilization", "placement.pools.gen"):
        assert is_config_key(key, keys), key
    for key in ("rollout.num_generations", "algorithm.beta", "model.lora", "engine.optim.lr.x"):
        assert not is_config_key(key, keys), key


def test_every_relayrl_key_on_the_migration_page_exists():
    text = PAGE.read_text()
    keys = config_keys()
    items = table_keys(text)
    assert len(items) > 60, "the mapping tables were not found (the relayrl column must be the second one)"
    commands = command_keys(text)
    assert len(commands) > 20, "the worked relayrl train commands were not found"
    bad = _bad(items + commands, keys)
    assert not bad, ("relayrl keys on the migration page that the config does not have (see "
                     "docs/reference/config.md):\n  " + "\n  ".join(bad))


def test_a_made_up_key_fails():
    keys = config_keys()
    page = ("| TRL | relayrl | note |\n|---|---|---|\n| `beta` | `algorithm.kl_coef`, `algorithm.klcoef=0.1` | x |\n"
            "\nrelayrl train r.yaml rollout.n=8 \\\n  trainer.stepz=3\n")
    assert _bad(table_keys(page), keys) == ["docs/migrating.md:3: `algorithm.klcoef=0.1`"]
    assert _bad(command_keys(page), keys) == ["docs/migrating.md:6: `trainer.stepz`"]
