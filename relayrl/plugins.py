"""Objects a config names by path: a user's reward function, environment or tool.

A path is ``package.module:attribute`` (the attribute may be dotted: ``module:Class.method``),
``package.module.attribute``, or a file and an attribute: ``path/to/my_rewards.py:score`` (verl's
``custom_reward_function.path``). A module must be importable in every process that loads it (installed,
or its directory on ``PYTHONPATH``); a file needs nothing of the kind. The config makes a file's path
absolute when it loads (:func:`absolute_file`), so rank processes and Ray workers, whose working
directory is another, open the same file.

An advantage estimator or a policy loss named by path (``algorithm.advantage``, ``algorithm.policy_loss``:
:mod:`relayrl.algorithms.plugins`) is refused with :class:`PluginError`, which names the key and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from relayrl.errors import UserError

__all__ = ["PluginError", "absolute_file", "is_path", "resolve"]


class PluginError(UserError, ValueError):
    """A user's plugin named by path in the config (an advantage estimator, a policy loss) that cannot be loaded
    or breaks its contract; the message names the config key, the object and the fix."""


def is_path(value: str) -> bool:
    """Whether a config value names an object by path (``file.py:name``, ``package.module:name`` or
    ``package.module.name``) rather than by a registered name (which holds neither ``:`` nor ``.``)."""
    return ":" in value or "." in value


def _file_split(path: str) -> tuple[str, str] | None:
    """``(file, attribute)`` of ``path/to/file.py:attribute``, else None."""
    file, sep, attr = path.rpartition(":")
    return (file, attr) if sep and file.endswith(".py") else None


def absolute_file(path: str, key: str) -> str:
    """``path`` with a file's path made absolute (a module path unchanged). A file that does not exist is a
    ``ValueError`` naming the config ``key``, raised when the config loads."""
    split = _file_split(path.strip())
    if split is None:
        return path
    file, attr = split
    resolved = Path(file).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(f"{key}={path!r}: no file {resolved}")
    if not attr:
        raise ValueError(f"{key}={path!r}: name the object in the file after the colon ({file}:my_function)")
    return f"{resolved}:{attr}"


def _candidates(path: str) -> list[tuple[str, str]]:
    """Candidate (module, attribute path) splits of ``path``, most specific module first."""
    if ":" in path:
        mod, _, attr = path.partition(":")
        return [(mod, attr)]
    parts = path.split(".")
    return [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]


def _import(name: str, label: str, error: type[Exception]) -> Any:
    """Import module ``name``; None when that module itself does not exist (an error inside it is raised)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise error(f"{label}: importing module {name!r} failed: {e}") from e
    except Exception as e:
        raise error(f"{label}: importing module {name!r} raised {type(e).__name__}: {e}") from e


def _load_file(file: str, label: str, error: type[Exception]) -> Any:
    """The module of a Python file, loaded once per process under a name made from its path."""
    resolved = Path(file).expanduser().resolve()
    name = f"relayrl_user_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    if not resolved.is_file():
        raise error(f"{label}: no file {resolved}")
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling by reference look the module up here)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise error(f"{label}: running {resolved} raised {type(e).__name__}: {e}") from e
    return module


def _attribute(module: Any, owner: str, attr_path: str, label: str, error: type[Exception]) -> Any:
    obj = module
    parts = attr_path.split(".")
    for i, attr in enumerate(parts):
        if not hasattr(obj, attr):
            where = ".".join([owner, *parts[:i]])
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise error(f"{label}: {where!r} has no attribute {attr!r} (callables there: "
                        f"{', '.join(public[:12]) or 'none'})")
        obj = getattr(obj, attr)
    return obj


def resolve(path: Any, label: str, error: type[Exception], shape: str = "package.module:attribute") -> Any:
    """The object at ``path``. Errors are ``error(f"{label}: ...")``, saying what is missing and how to fix it;
    ``shape`` is the example of a module path they show."""
    if not isinstance(path, str) or not path.strip():
        raise error(f"{label} must look like '{shape}' or 'path/to/file.py:attribute', got {path!r}")
    path = path.strip()
    split = _file_split(path)
    if split is not None:
        file, attr = split
        if not attr:
            raise error(f"{label} must name the object after the colon: '{file}:my_function'")
        return _attribute(_load_file(file, label, error), Path(file).name, attr, label, error)
    if path.endswith(".py") and ":" not in path:  # a file without its object (read as module 'x', object 'py')
        raise error(f"{label}={path!r} names a file but not the object in it: '{path}:my_function'")
    splits = _candidates(path)
    if not splits or not all(m and a for m, a in splits):
        raise error(f"{label} must look like '{shape}', 'package.module.attribute' or 'path/to/file.py:attribute'")
    tried = []
    for mod_name, attr_path in splits:
        module = _import(mod_name, label, error)
        if module is None:
            tried.append(mod_name)
            continue
        return _attribute(module, mod_name, attr_path, label, error)
    mod_name, attr_path = splits[0]
    raise error(f"{label}: no module named {tried[0]!r}: install it, put its directory on PYTHONPATH, or name "
                f"the file: {mod_name.replace('.', '/')}.py:{attr_path}")
