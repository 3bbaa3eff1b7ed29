"""Recipes: YAML files that derive from each other, plus dotted command-line overrides.

A recipe may name a ``base`` recipe (a path relative to itself); the base is
loaded first and the recipe's keys are merged over it, so a recipe reads as a
diff (``arith_dapo.yaml`` is ``arith_grpo.yaml`` plus a few DAPO switches).
Overrides ``a.b.c=value`` are applied last; values are parsed as YAML
(``3``, ``1e-4``, ``true``, ``[1, 2]``, ``null``; numbers as YAML 1.2 reads them, in recipes too: ``010`` is
10, not YAML 1.1's octal 8, and ``1:30`` is text, not base-60 90), each whole: a ``#`` in an override is text, not a YAML
comment (``data.answer_regex=####\\s*(.+)$``; a recipe's comments are YAML's). A mapping value is merged
into the section as a base recipe's keys are (``engine.optim={lr: 1e-4}``
keeps the recipe's other optimizer keys); ``{}`` empties it.

A run's saved ``config.json`` is a recipe too (:func:`saved_run_config`), and so is the YAML that ``relayrl
train --print-config`` prints (every section of the config): they list every key, defaults included, and the keys at their defaults are read as unset, so that the checks refusing a key nothing reads
(``rollout.interrupt.answer_tokens`` without ``after_tokens``) see the keys the run set, as its recipe had them.

Every error names the key path and how to fix it, and happens before any work
starts. Numbers are strict: pydantic's lax mode reads ``true`` as 1 for an
integer or float key (``trainer.steps=true`` ran one step); :func:`validate`
refuses a boolean wherever a number was validated, and a NaN, infinite or beyond-float32 number except
infinity in a field declared ``Field(allow_inf_nan=True)``.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from relayrl.errors import UserError

if TYPE_CHECKING:  # (the schema, and all it imports, loads with the first config, not with this module)
    from relayrl.config.schema import Config

__all__ = ["ConfigError", "load_recipe_dict", "apply_overrides", "validate", "load_config", "load_run_config",
           "field_errors", "saved_run_config", "without_defaults", "SAVED_RUN_KEYS"]

M = TypeVar("M", bound=BaseModel)


class ConfigError(UserError, ValueError):
    """A recipe, override or value that cannot be used; the message names the key and the fix."""


class _Yaml12Numbers(yaml.SafeLoader):
    """YAML's safe loader, with numbers as YAML 1.2 reads them: PyYAML follows YAML 1.1, where ``010`` is the
    octal number 8 and ``1:30`` the base-60 number 90 (``trainer.steps=010`` ran 8 steps). Such a scalar is
    kept as its text here, which a number key then reads in decimal (``010``: 10) or refuses naming it
    (``1:30``), and a text key keeps as written."""


def _int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    digits = node.value.replace("_", "").lstrip("+-")
    if ":" in digits or (len(digits) > 1 and digits[0] == "0" and digits.isdigit()):
        return node.value
    return loader.construct_yaml_int(node)


def _float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    return node.value if ":" in node.value else loader.construct_yaml_float(node)


_Yaml12Numbers.add_constructor("tag:yaml.org,2002:int", _int)
_Yaml12Numbers.add_constructor("tag:yaml.org,2002:float", _float)


class _StrictLoader(_Yaml12Numbers):
    """YAML's safe loader (numbers as YAML 1.2 reads them: :class:`_Yaml12Numbers`) that refuses a key written
    twice in one mapping (PyYAML keeps the last silently)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


TASK_OPTION_KEYS = ("task_options", "eval_task_options")
"""The options of the built-in task ``data.task``: a later layer (a recipe over its base, an override) that sets
``data.task`` to null drops the ones the earlier layers gave that task (:func:`_drop_task_options`)."""


def _drop_task_options(base: dict, over: dict) -> dict:
    """``base`` without its ``data.task_options`` and ``data.eval_task_options`` when ``over`` sets ``data.task``
    to null over a task ``base`` names (the options were that task's); ``base`` itself otherwise."""
    data, new = base.get("data"), over.get("data")
    if not (isinstance(data, dict) and isinstance(new, dict) and "task" in new and new["task"] is None
            and data.get("task") is not None):
        return base
    return {**base, "data": {k: v for k, v in data.items() if k not in TASK_OPTION_KEYS}}


SHIPPED = Path(__file__).resolve().parents[2] / "recipes"
"""The recipes that come with relayrl (a checkout's ``recipes/``; absent from a wheel install)."""


def resolve_recipe(arg: str | Path) -> Path:
    """The recipe file ``arg`` names: a path, or the name of a shipped recipe (``arith_grpo`` or
    ``arith_grpo.yaml``, from any directory). A missing one is refused, naming the shipped recipes like it."""
    path = Path(arg)
    if path.exists():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    if len(path.parts) != 1 or not SHIPPED.is_dir():
        shipped = SHIPPED / name
        hint = (f"; the shipped recipe of that name is {shipped}: give its name ({shipped.stem}) to use it"
                if shipped.is_file() else "")
        raise ConfigError(f"recipe {path.resolve()} does not exist{hint}")
    if (SHIPPED / name).is_file():
        return SHIPPED / name
    if "=" in str(arg):
        raise ConfigError(f"recipe {arg}: that is an override; the recipe comes first (relayrl train RECIPE "
                          f"{arg} ...: a file, or a shipped recipe's name such as arith_grpo)")
    names = sorted(p.stem for p in SHIPPED.glob("*.yaml"))
    close = difflib.get_close_matches(path.stem, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ConfigError(f"recipe {arg} is neither a file here ({path.resolve()}) nor a shipped recipe; {hint}the "
                      f"shipped recipes ({SHIPPED}): {', '.join(names)}")


def load_recipe_dict(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a recipe and its ``base`` chain into one dict."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"recipe base chain loops: {chain}")
    if path.is_dir():
        yamls = sorted(p.name for p in path.glob("*.yaml"))[:6]
        raise ConfigError(f"recipe {path} is a directory; give a recipe file"
                          + (f" in it ({', '.join(yamls)})" if yamls else " (e.g. recipes/arith_grpo.yaml)"))
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    data = _parse_json(path, text) if path.suffix == ".json" else _parse_yaml(path, text)
    if data is None:
        raise ConfigError(f"recipe {path} is empty; a recipe is a mapping of keys (see recipes/ for examples)")
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of keys, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"recipe {path}: base must be the path of one recipe, got {base!r}")
        data = _merge(_drop_task_options(load_recipe_dict(path.parent / base, (*_seen, path)), data), data)
    return data


def _parse_yaml(path: Path, text: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path} is not valid YAML: {e}") from None


def _parse_json(path: Path, text: str) -> Any:
    """A ``.json`` recipe (a run's saved ``config.json``) as JSON reads it: YAML, a superset, reads JSON's
    ``1e-05`` as a string. A key written twice in one object is refused, as in YAML."""
    def pairs(items: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for k, v in items:
            if k in seen:
                raise ConfigError(f"recipe {path}: key {k!r} is written twice in one object")
            seen[k] = v
        return seen

    try:
        return json.loads(text, object_pairs_hook=pairs) if text.strip() else None
    except json.JSONDecodeError as e:
        raise ConfigError(f"recipe {path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def _override_value(raw: str) -> Any:
    """The value of an override ``key=raw``, typed as YAML types it (``3``, ``1e-4``, ``true``, ``null``,
    ``[a, b]``, ``{a: 1}``), but whole: an override is one value, so a ``#`` in it is text, never a YAML comment
    (``data.system_prompt=#1 rule`` read as a comment was null, ``x=a # b`` was ``a``). Text YAML cannot read
    is kept as given."""
    if not raw.strip():
        return ""
    try:
        if _holds_comment(raw):
            return raw
        return yaml.load(raw, Loader=_Yaml12Numbers)
    except yaml.YAMLError:
        return raw


def _holds_comment(raw: str) -> bool:
    """Whether YAML reads part of ``raw`` as a comment: its tokens (a comment makes none) end before the text
    does. The end of a block or of the stream is not text read, so it does not count."""
    if "#" not in raw:
        return False
    skip = (yaml.StreamEndToken, yaml.BlockEndToken)
    ends = [t.end_mark.index for t in yaml.scan(raw, Loader=yaml.SafeLoader) if not isinstance(t, skip)]
    return max(ends, default=0) < len(raw.rstrip())


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``a.b=value`` overrides to a nested dict (returns a new dict)."""
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence):
        example = f"[{overrides!r}]" if isinstance(overrides, str) else "['trainer.steps=3', 'run.dir=runs/x']"
        raise ConfigError(f"overrides must be a list of 'key.path=value' strings, got {type(overrides).__name__} "
                          f"{overrides!r}; write {example}")
    out = _merge({}, data)
    set_by: dict[str, str] = {}  # key path -> the override that set a value there
    options_given: set[str] = set()  # data.task_options / eval_task_options set by one of these overrides
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(f"override {item!r} is not a string ({type(item).__name__}); an override is "
                              f"'key.path=value' (e.g. 'trainer.steps=3')")
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. trainer.steps=3)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key part")
        value = _override_value(raw)
        squashed = [k for k, v in value.items() if v is None and isinstance(k, str) and ":" in k] \
            if isinstance(value, dict) else []
        if squashed:  # {a:1} is YAML for {"a:1": null}
            raise ConfigError(f"override {item!r}: YAML needs a space after the colon in a mapping "
                              f"({squashed[0]!r} reads as one key); write {key}={{{squashed[0].replace(':', ': ', 1)}}} "
                              f"or {key}.{squashed[0].split(':', 1)[0]}={squashed[0].split(':', 1)[1]}")
        parts = key.split(".")
        if parts == ["data", "task"] or parts == ["data"]:  # data.task=null drops the task's earlier options
            nested = {"data": {"task": value}} if parts == ["data", "task"] else {"data": value}
            kept = out.get("data")
            out = _drop_task_options(out, nested)
            if isinstance(kept, dict) and out.get("data") is not kept:  # ... unless an override here gave them
                out["data"].update({k: kept[k] for k in TASK_OPTION_KEYS if k in kept and k in options_given})
        if len(parts) >= 2 and parts[0] == "data" and parts[1] in TASK_OPTION_KEYS:
            options_given.add(parts[1])
        elif parts == ["data"] and isinstance(value, dict):
            options_given.update(k for k in TASK_OPTION_KEYS if k in value)
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                path = ".".join(parts[:i + 1])
                if path in set_by:  # `data=foo data.task=arith`: the earlier override is the mistake
                    raise ConfigError(f"override {set_by[path]!r} made {path} a value, so {item!r} has no section "
                                      f"to set a key in; set {path}'s keys one by one ({path}.<key>=...) or "
                                      f"give a mapping ({path}={{key: value}})")
                raise ConfigError(f"override {item!r}: {path} is a value, not a section")
            else:
                nxt = node[part] = dict(nxt)
            node = nxt
        old = node.get(parts[-1])
        merge = isinstance(value, dict) and value and isinstance(old, dict)
        node[parts[-1]] = _merge(old, value) if merge else value
        if isinstance(value, dict):  # a section again
            set_by = {k: v for k, v in set_by.items() if k != key and not k.startswith(key + ".")}
        else:
            set_by[key] = item
    return out


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        cls = field.annotation
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            for arg in getattr(cls, "__args__", ()):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    cls = arg
                    break
            else:
                return []
    return sorted(getattr(cls, "model_fields", {}))


def field_errors(err: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One line per error of ``err``: the key path and what is wrong (an unknown key of ``model`` with the close
    one or the valid keys; a validator's own message as written)."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden" and model is not None:
            from relayrl.config.foreign_keys import key_lines

            foreign = key_lines(key, e.get("input"))  # verl's, NeMo-RL's or OpenRLHF's keys, with relayrl's
            if foreign:
                lines.extend(foreign)
                continue
            known = _fields_at(model, loc)
            import difflib

            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean {'.'.join(map(str, loc[:-1] + (close[0],)))}?" if close else f"valid keys here: {', '.join(known)}"
            lines.append(f"{key}: unknown key; {hint}")
        elif e["type"] == "value_error" and "error" in e.get("ctx", {}):
            # A validator's own message already names its keys and the fix; print it as written.
            msg = str(e["ctx"]["error"])
            lines.append(msg if not loc else f"{key}: {msg}")
        else:
            got = e.get("input")
            got_s = f" (got {got!r})" if not isinstance(got, dict) and got is not None else ""
            if got is None and "input" in e and e["type"] != "missing":
                got_s = (" (got null, which this key does not take: YAML reads null, ~ and a key with nothing after "
                         "it as null; leave the key out for its default, or write the value out, a home directory "
                         "as its full path)")
            if isinstance(got, bool) and e["type"] == "literal_error":  # YAML 1.1: on/off/yes/no are booleans
                got_s += (f"; YAML reads on, off, yes and no as {str(got).lower()}: write one of the values above, "
                          f"quoted in a recipe if it is one of those words")
            lines.append(f"{key}: {e['msg']}{got_s}")
    return lines


def _format(err: ValidationError, model: type[BaseModel]) -> str:
    return "invalid config:\n" + "\n".join(f"  {line}" for line in field_errors(err, model))


def validate(model: type[M], data: dict) -> M:
    """``data`` validated into ``model`` (a config section or the whole :class:`~relayrl.config.schema.Config`);
    :class:`ConfigError` lists every wrong key with its fix (a misspelt key with the key it is close to), and
    refuses ``true``/``false`` given for a number."""
    try:
        out = model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, model)) from None
    lines = _booleans_read_as_numbers(out, data, "") + _nonfinite_numbers(out, "")
    if lines:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {line}" for line in lines))
    return out


def _nonfinite_numbers(value: Any, key: str, allow_inf: bool = False, default: Any = None) -> list[str]:
    """The keys whose validated value is a float that is NaN, infinite, or beyond float32's range (infinite
    once a float32 tensor holds it: ``rollout.temperature=1e308`` divides the logits to 0), walking models,
    mappings and lists. A bound does not refuse infinity (``rollout.temperature=inf`` is ``>= 0``: it sampled
    uniformly) and a key with none takes NaN. A field declared ``Field(allow_inf_nan=True)``, where infinity
    means something (``engine.optim.max_grad_norm=inf`` clips nothing), takes any number but NaN."""
    from relayrl.engines.reward.user import FLOAT32_MAX  # (the bound rewards have; imported with the schema)

    at = (lambda k: f"{key}.{k}" if key else str(k))
    if isinstance(value, float):
        if abs(value) <= FLOAT32_MAX or (allow_inf and not math.isnan(value)):
            return []
        why = "is not a finite number" if not math.isfinite(value) else \
            f"is beyond float32's range (+-{FLOAT32_MAX:.1e}), infinite in the run's tensors"
        hint = f" (its default is {default!r})" if isinstance(default, (int, float)) else ""
        return [f"{key}={value:g} {why}; write a finite number{hint}"]
    if isinstance(value, BaseModel):  # (a section's defaults are its parent's for it, where the parent gives an instance)
        base = default if isinstance(default, type(value)) else None
        return [line for name, f in type(value).model_fields.items()
                for line in _nonfinite_numbers(getattr(value, name), at(f.alias or name), _allows_inf(f),
                                               f.default if base is None else getattr(base, name))]
    if isinstance(value, dict):
        return [line for k, v in value.items() for line in _nonfinite_numbers(v, at(k))]
    if isinstance(value, (list, tuple)):
        return [line for i, v in enumerate(value) for line in _nonfinite_numbers(v, at(i), allow_inf)]
    return []


def _allows_inf(field: Any) -> bool:
    return any(getattr(m, "allow_inf_nan", False) is True for m in field.metadata)


def _booleans_read_as_numbers(value: Any, raw: Any, key: str) -> list[str]:
    """The keys whose input was ``true``/``false`` and whose validated value is a number (walking the validated
    models, mappings and lists beside the input they came from)."""
    if isinstance(raw, bool):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            kind = "an integer" if isinstance(value, int) else "a number"
            return [f"{key}={str(raw).lower()}: {kind} is expected, not a boolean; write the number (e.g. "
                    f"{key}={int(raw)})"]
        return []
    at = (lambda k: f"{key}.{k}" if key else str(k))
    if isinstance(value, BaseModel) and isinstance(raw, dict):
        pairs = [(getattr(value, name), raw[f.alias or name], f.alias or name)
                 for name, f in type(value).model_fields.items() if (f.alias or name) in raw]
    elif isinstance(value, dict) and isinstance(raw, dict):
        pairs = [(value[k], raw[k], k) for k in raw if k in value]
    elif isinstance(value, (list, tuple)) and isinstance(raw, (list, tuple)) and len(value) == len(raw):
        pairs = [(v, r, str(i)) for i, (v, r) in enumerate(zip(value, raw))]
    else:
        return []
    return [line for v, r, k in pairs for line in _booleans_read_as_numbers(v, r, at(k))]


SAVED_RUN_KEYS = frozenset({"workflow", "run", "model", "trainer"})
"""Top-level keys every run's saved ``config.json`` has (``relayrl.checkpoint.rundir.RUN_CONFIG_KEYS``, which
imports torch)."""


def saved_run_config(path: Path, data: dict) -> bool:
    """Whether the recipe ``path`` (read as ``data``) is a run's saved config: a JSON file with every key of
    :data:`SAVED_RUN_KEYS` (a run writes ``RUN_DIR/config.json`` and each checkpoint's so)."""
    return path.suffix == ".json" and SAVED_RUN_KEYS <= data.keys()


def without_defaults(saved: dict, default: BaseModel) -> dict:
    """``saved`` (a dump of a model like ``default``) without the keys at ``default``'s values, in its sections
    too (a section left with no key goes; a mapping or list that is a value is compared whole). Validated, it
    gives the same values as ``saved`` does; only the keys the dump lists for completeness are unset again."""
    fields, dumped = type(default).model_fields, default.model_dump(mode="json")
    out = {}
    for k, v in saved.items():
        if k in dumped and v == dumped[k]:
            continue
        section = getattr(default, k) if k in fields else None
        fresh = _fresh(type(section)) if isinstance(section, BaseModel) and isinstance(v, dict) else None
        # (a section given in part takes its class's defaults for the rest, which may not be the parent's)
        out[k] = v if fresh is None else without_defaults(v, fresh)
    return out


def _fresh(section: type[BaseModel]) -> BaseModel | None:
    """``section`` at its class's defaults, or None when it has required keys."""
    try:
        return section()
    except ValidationError:
        return None


def load_config(model: type[M], recipe: str | Path | None, overrides: Sequence[str] = ()) -> M:
    """Recipe (or the defaults when ``recipe`` is None) + overrides, validated into ``model``; a run's saved
    config as a recipe, or one that lists every section (``relayrl train --print-config``'s), has its keys at
    their defaults unset first (:func:`without_defaults`)."""
    data = {}
    if recipe is not None:
        path = resolve_recipe(recipe)
        data = load_recipe_dict(path)
        saved = saved_run_config(path, data)
        if saved or set(model.model_fields) <= data.keys():  # (or a whole printed config)
            data = without_defaults(data, model())
            if saved and isinstance(data.get("data"), dict) \
                    and "task" in data["data"] and data["data"]["task"] is None:
                # (a run saved before null tasks refused options kept its recipe's, which it never read)
                data = {**data, "data": {k: v for k, v in data["data"].items() if k not in TASK_OPTION_KEYS}}
    return validate(model, apply_overrides(data, overrides))


def load_run_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """A run's :class:`~relayrl.config.schema.Config` from a recipe (a file, a shipped recipe's name, a run's
    ``config.json``; None: the defaults) and dotted overrides, a list of ``key.path=value`` strings (what
    ``relayrl train`` and ``relayrl plan`` read); :class:`ConfigError` names a wrong key and the fix."""
    from relayrl.config.schema import Config

    return load_config(Config, recipe, overrides)
